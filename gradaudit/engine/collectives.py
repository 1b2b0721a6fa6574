"""The engine's merge rule across ranks: stats rows of shards into the rows of whole tensors.

Per-parameter stats rows computed on local shards combine into the rows of the
whole parameters exactly as chunk rows combine into a tensor (counts add,
maxima take the max, sums of squares add after rescaling to the largest scale),
so two ``all_reduce`` calls on a small ``[k, 7]`` float64 matrix (MAX, then SUM)
give every rank the stats of every whole parameter. The rows stay on the
device. Collective: call it on every rank of the group, in the same order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gradaudit.engine.stats import MAX_ABS, NAN, NEG_INF, POS_INF, ROW_WIDTH, SCALE, SSQ, ZEROS

_COUNTS = (NAN, POS_INF, NEG_INF, ZEROS)
#: The smallest positive float64: the scale of a row without a finite non-zero
#: element, so that it never wins the MAX of scales (its sum of squares is 0).
_NEUTRAL_SCALE = math.ulp(0.0)


def all_reduce_rows(rows: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Merge stats rows ``[k, 7]`` across the ranks of ``group``: row i is a part of tensor i.

    The engine's merge rule as two collectives on the device: MAX over
    ``[max_abs, scale]``, then each rank rescales its sum of squares to the
    largest scale (``ssq * (scale / scale_max)**2``, multiplied in twice so a
    large ``ssq`` meets the small factor before it can underflow) and a SUM
    adds the counts and the rescaled sums of squares. Every rank gets the same
    merged rows. A row with no finite non-zero element (an empty or all-zero
    shard) has a sum of squares of 0 whatever its scale, so its scale is made
    the smallest positive float64 first: otherwise the scale 1 of an empty
    shard would beat the tiny scale of a float64 shard of 1e-300s and flush
    that shard's squares to zero.
    """
    scale = torch.where(
        rows[:, MAX_ABS] > 0, rows[:, SCALE], torch.full_like(rows[:, SCALE], _NEUTRAL_SCALE)
    )
    peaks = torch.stack([rows[:, MAX_ABS], scale], dim=1)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    ratio = scale / peaks[:, 1]
    sums = torch.stack([*(rows[:, slot] for slot in _COUNTS), rows[:, SSQ] * ratio * ratio], dim=1)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    columns: list[torch.Tensor | None] = [None] * ROW_WIDTH
    for position, slot in enumerate(_COUNTS):
        columns[slot] = sums[:, position]
    columns[MAX_ABS] = peaks[:, 0]
    columns[SCALE] = peaks[:, 1]
    columns[SSQ] = sums[:, len(_COUNTS)]
    missing = [slot for slot, column in enumerate(columns) if column is None]
    if missing:  # a slot added to the engine without a merge rule here
        raise RuntimeError(f"no cross-rank merge rule for stats slots {missing}")
    return torch.stack([c for c in columns if c is not None], dim=1)
