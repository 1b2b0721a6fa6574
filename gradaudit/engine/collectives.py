"""The engine's merge rule across ranks: stats rows of shards into the rows of whole tensors.

Per-parameter stats rows computed on local shards combine into the rows of the
whole parameters exactly as chunk rows combine into a tensor (counts add,
maxima take the max, sums of squares add after rescaling to the largest scale),
so two ``all_reduce`` calls on a small ``[k, 7]`` float64 matrix (MAX, then SUM)
give every rank the stats of every whole parameter. Other per-parameter counts
(the exponent histograms of a monitor's ``precision=``) add up like the rows'
counts, so they ride in the same SUM: no third collective. The rows stay on the
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
    merged, _ = _all_reduce(rows, None, group)
    return merged


def all_reduce_rows_and_counts(
    rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`all_reduce_rows`, and integer ``counts`` ``[k, m]`` (int64, on the rows' device)
    summed across the same ranks in the same SUM collective: row i of both is tensor i's.

    For the exponent histograms of a monitor's ``precision=`` (``m`` = 293 bins): bin
    counts add up across shards as element counts do. They travel as float64 beside the
    rows' counts, exact while every sum stays below 2**53 (a count of elements of one
    parameter always does), and come back as int64: one collective fewer than an int64
    SUM of their own, and the one that every collecting step would pay.
    """
    merged, summed = _all_reduce(rows, counts, group)
    assert summed is not None
    return merged, summed


def _all_reduce(
    rows: torch.Tensor, counts: torch.Tensor | None, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The two collectives of :func:`all_reduce_rows`, ``counts`` (when given) in the SUM."""
    scale = torch.where(
        rows[:, MAX_ABS] > 0, rows[:, SCALE], torch.full_like(rows[:, SCALE], _NEUTRAL_SCALE)
    )
    peaks = torch.stack([rows[:, MAX_ABS], scale], dim=1)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    ratio = scale / peaks[:, 1]
    sums = torch.stack([*(rows[:, slot] for slot in _COUNTS), rows[:, SSQ] * ratio * ratio], dim=1)
    width = sums.shape[1]
    if counts is not None:
        sums = torch.cat([sums, counts.to(torch.float64)], dim=1)
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
    merged = torch.stack([c for c in columns if c is not None], dim=1)
    summed = None if counts is None else sums[:, width:].to(torch.int64)
    return merged, summed
