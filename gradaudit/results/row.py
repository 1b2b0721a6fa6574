"""The engine's stats row, ``[nan, pos_inf, neg_inf, zeros, max_abs, scale, ssq]``, and its
merge rule.

Defined here, without torch, so the host side (:mod:`gradaudit.results.stats_table`, the
torch-free scan of :mod:`gradaudit.scan.torch_free`) reads the same slots and merges
with the same rule as the device side (:mod:`gradaudit.engine.stats`, which documents
the row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar

NAN, POS_INF, NEG_INF, ZEROS, MAX_ABS, SCALE, SSQ = range(7)
ROW_WIDTH = 7

_COUNT_SLOTS = slice(NAN, ZEROS + 1)

#: A numpy array or a torch tensor of rows: :func:`merge_rows` returns the same kind.
Rows = TypeVar("Rows")


def merge_rows(rows: Rows) -> Rows:
    """Merge stats rows ``[k, 7]`` (k >= 1) into one row ``[7]``; the one merge rule.

    The same code merges device rows (torch tensors: pieces of a tensor, ranks; nothing
    is read back) and host rows (numpy arrays: files and the whole scan, after the one
    host read, with or without torch): the operations used here mean the same in both
    libraries, so there is one rule, not one per library.

    Rescaling multiplies by ``(scale_i / scale)`` twice rather than by its
    square so that a large ``ssq`` meets the small factor before it can
    underflow; contributions that still underflow are below 2**-1074 of the
    largest one and cannot change the result.
    """
    xp = _namespace(rows)
    table: Any = rows
    counts = table[:, _COUNT_SLOTS].sum(0)
    max_abs = table[:, MAX_ABS].max()
    # Only rows that hold a sum of squares choose the common scale: an all-zero
    # float32 row (scale 1) must not flush a float64 row of 1e-300 values to zero.
    live = table[:, SSQ] > 0
    scale = xp.where(live, table[:, SCALE], 0.0).max()
    scale = xp.where(scale > 0, scale, 1.0)
    ratio = table[:, SCALE] / scale
    ssq = xp.where(live, table[:, SSQ] * ratio * ratio, 0.0).sum()
    out = xp.empty_like(table[0])
    out[_COUNT_SLOTS] = counts
    out[MAX_ABS] = max_abs
    out[SCALE] = scale
    out[SSQ] = ssq
    merged: Rows = out
    return merged


def _namespace(rows: object) -> Any:
    """numpy for a numpy array, torch for a tensor (already imported: a tensor exists)."""
    import numpy as np

    if isinstance(rows, np.ndarray):
        return np
    import torch

    return torch


def skip_reason(name: str, *, floating: bool) -> str:
    """Why a tensor of the dtype ``name`` (torch's spelling), which the engine does not
    audit, is skipped: one wording whether torch or the torch-free scan says it."""
    if floating:
        return f"dtype {name} is not supported by the engine; not audited"
    return f"dtype {name} is not floating-point; not audited"


def row_norm(values: list[float]) -> float:
    """The L2 norm a host stats row stands for: ``scale * sqrt(ssq)``."""
    return values[SCALE] * math.sqrt(values[SSQ])


@dataclass(frozen=True)
class HostRow:
    """One stats row after the host read, with the derived norm.

    For a caller holding rows of its own (``engine.kernels.collect_rows`` in a compiled
    step, docs/training.md); a scan derives the same numbers as columns
    (:class:`~gradaudit.results.stats_table.StatsTable`), never a row object per tensor.
    """

    nan: int
    pos_inf: int
    neg_inf: int
    zeros: int
    max_abs: float
    norm: float

    @classmethod
    def from_values(cls, values: list[float]) -> HostRow:
        return cls(
            nan=int(values[NAN]),
            pos_inf=int(values[POS_INF]),
            neg_inf=int(values[NEG_INF]),
            zeros=int(values[ZEROS]),
            max_abs=values[MAX_ABS],
            norm=row_norm(values),
        )
