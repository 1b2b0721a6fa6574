"""Columns that the table and Markdown show alike: a header, a getter, a formatter.

A tensor's zero % or a side's ``norm/√params`` once had two definitions, one per
format, and they drifted (the zero % column stood before NaN in the table and
after ±Inf in Markdown). Each is defined here once; a format picks the columns
it shows, in this order, and adds only what is its own (a styled status in the
table, a code span in Markdown). The priority says how early the table may drop
the column at a narrow width (see :mod:`gradaudit.report.fit`); Markdown ignores it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from gradaudit.report.compare_text import change_text, shape_text
from gradaudit.report.fit import KEEP
from gradaudit.report.text import count, number
from gradaudit.results import TensorStats
from gradaudit.results.comparison import ParameterChange, SideStats

Row = TypeVar("Row")


@dataclass(frozen=True)
class Field(Generic[Row]):
    """One column: its header, what a row holds there (``get``), and how that is written."""

    header: str
    get: Callable[[Row], Any]
    format: Callable[[Any], str] = number
    justify: Literal["left", "right"] = "right"
    #: The table drops columns of lower priority first; :data:`~gradaudit.report.fit.KEEP`: never.
    priority: int = KEEP
    #: A style for the cell in a terminal (a count of NaN in red); Markdown has no colour.
    style: Callable[[Row], str] | None = None

    def text(self, row: Row) -> str:
        """The cell of ``row``."""
        return self.format(self.get(row))


def _percent(fraction: float) -> str:
    return f"{100.0 * fraction:.1f}"


def _inf(counts: tuple[int, int]) -> str:
    return f"{count(counts[0])}/{count(counts[1])}"


def _same(text: str) -> str:
    return text


# A scanned tensor's numbers, in the order every format shows them.
TENSOR_SHAPE: Field[TensorStats] = Field(
    "shape", lambda s: s.shape, shape_text, justify="left", priority=40
)
TENSOR_DTYPE: Field[TensorStats] = Field(
    "dtype", lambda s: s.dtype, _same, justify="left", priority=50
)
# A tensor with no finite element shows nan, never a norm of 0 (a dead layer).
TENSOR_NORM: Field[TensorStats] = Field("norm", lambda s: math.nan if s.unmeasured else s.norm)
TENSOR_RMS: Field[TensorStats] = Field(
    "rms", lambda s: math.nan if s.unmeasured else s.rms, priority=10
)
TENSOR_MAX_ABS: Field[TensorStats] = Field(
    "max|x|", lambda s: math.nan if s.unmeasured else s.max_abs, priority=30
)
TENSOR_ZERO: Field[TensorStats] = Field("zero %", lambda s: s.zero_fraction, _percent, priority=20)
TENSOR_NAN: Field[TensorStats] = Field("NaN", lambda s: s.nan, count, priority=70)
TENSOR_INF: Field[TensorStats] = Field("±Inf", lambda s: (s.pos_inf, s.neg_inf), _inf, priority=60)


def _nonfinite_style(side: SideStats, value: int) -> str:
    return "red" if side.nonfinite and value else ""


# One side of a comparison (host/seed or A/B), after its "side" and "input" cells.
SIDE_FIELDS: tuple[Field[SideStats], ...] = (
    Field("tensors", lambda s: s.tensors, count, priority=20),
    Field("params", lambda s: s.params, count, priority=30),
    Field("norm", lambda s: s.norm),
    Field("norm/√params", lambda s: s.norm_per_sqrt_param, priority=40),
    Field("NaN", lambda s: s.nan, count, priority=60, style=lambda s: _nonfinite_style(s, s.nan)),
    Field("±Inf", lambda s: s.inf, count, priority=50, style=lambda s: _nonfinite_style(s, s.inf)),
    Field("vanishing", lambda s: s.vanishing_tensors, count, priority=10),
    Field("exploding", lambda s: s.exploding_tensors, count, priority=15),
)

# A tensor both sides share, after its name (and the table's dtype when dtypes differ).
CHANGE_SHAPE: Field[ParameterChange] = Field(
    "shape", lambda c: c.shape, shape_text, justify="left", priority=10
)
CHANGE_NUMBERS: tuple[Field[ParameterChange], ...] = (
    Field("norm A", lambda c: c.norm_a, priority=20),
    Field("norm B", lambda c: c.norm_b, priority=30),
    Field("B/A", lambda c: c.ratio),
    Field("change", lambda c: c, change_text, priority=40),
)
