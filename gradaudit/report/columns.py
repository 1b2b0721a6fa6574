"""Columns that the table and Markdown show alike: a header, a cell's text, its alignment.

A tensor's zero % or a side's ``norm/√params`` once had two definitions, one per
format, and they drifted (the zero % column stood before NaN in the table and
after ±Inf in Markdown). Each is defined here once; a format picks the columns
it shows, in this order, and adds only what is its own (a styled status in the
table, a code span in Markdown). The priority says how early the table may drop
the column at a narrow width (see :mod:`gradaudit.report.fit`); Markdown ignores it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from gradaudit.compare.model import ParameterChange, SideStats
from gradaudit.report.compare_text import change_text, shape_text
from gradaudit.report.fit import KEEP
from gradaudit.report.text import count, number
from gradaudit.results import TensorStats

Row = TypeVar("Row")


@dataclass(frozen=True)
class Field(Generic[Row]):
    """One column: ``header``, and the text of the cell for a row."""

    header: str
    text: Callable[[Row], str]
    justify: Literal["left", "right"] = "right"
    #: The table drops columns of lower priority first; :data:`~gradaudit.report.fit.KEEP`: never.
    priority: int = KEEP
    #: A style for the cell in a terminal (a count of NaN in red); Markdown has no colour.
    style: Callable[[Row], str] | None = None


def _inf(plus: int, minus: int) -> str:
    return f"{count(plus)}/{count(minus)}"


# A scanned tensor's numbers, in the order every format shows them.
TENSOR_SHAPE: Field[TensorStats] = Field(
    "shape", lambda s: "×".join(str(d) for d in s.shape) or "()", "left", priority=40
)
TENSOR_DTYPE: Field[TensorStats] = Field("dtype", lambda s: s.dtype, "left", priority=50)
TENSOR_NORM: Field[TensorStats] = Field("norm", lambda s: number(s.norm))
TENSOR_RMS: Field[TensorStats] = Field("rms", lambda s: number(s.rms), priority=10)
TENSOR_MAX_ABS: Field[TensorStats] = Field("max|g|", lambda s: number(s.max_abs), priority=30)
TENSOR_ZERO: Field[TensorStats] = Field(
    "zero %", lambda s: f"{100.0 * s.zero_fraction:.1f}", priority=20
)
TENSOR_NAN: Field[TensorStats] = Field("NaN", lambda s: count(s.nan), priority=70)
TENSOR_INF: Field[TensorStats] = Field("±Inf", lambda s: _inf(s.pos_inf, s.neg_inf), priority=60)


def _nonfinite_style(side: SideStats, value: int) -> str:
    return "red" if side.nonfinite and value else ""


# One side of a comparison (host/seed or A/B), after its "side" and "input" cells.
SIDE_FIELDS: tuple[Field[SideStats], ...] = (
    Field("tensors", lambda s: count(s.tensors), priority=20),
    Field("params", lambda s: count(s.params), priority=30),
    Field("norm", lambda s: number(s.norm)),
    Field("norm/√params", lambda s: number(s.norm_per_sqrt_param), priority=40),
    Field("NaN", lambda s: count(s.nan), priority=60, style=lambda s: _nonfinite_style(s, s.nan)),
    Field("±Inf", lambda s: count(s.inf), priority=50, style=lambda s: _nonfinite_style(s, s.inf)),
    Field("vanishing", lambda s: count(s.vanishing_tensors), priority=10),
    Field("exploding", lambda s: count(s.exploding_tensors), priority=15),
)

# A tensor both sides share, after its name (and the table's dtype when dtypes differ).
CHANGE_SHAPE: Field[ParameterChange] = Field(
    "shape", lambda c: shape_text(c.shape), "left", priority=10
)
CHANGE_NUMBERS: tuple[Field[ParameterChange], ...] = (
    Field("norm A", lambda c: number(c.norm_a), priority=20),
    Field("norm B", lambda c: number(c.norm_b), priority=30),
    Field("B/A", lambda c: number(c.ratio)),
    Field("change", change_text, priority=40),
)
