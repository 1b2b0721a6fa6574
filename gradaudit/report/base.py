"""The interfaces every output format implements: one per result type.

A :class:`Report` and a :class:`Comparison` are different results, so each has
its own formatter protocol; both share :class:`RenderOptions`, and each output
format maps to one formatter per result type (``formats.py``,
``compare_formats.py``), with a test that every mapping is exhaustive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gradaudit.compare.model import Comparison
from gradaudit.results import Report

#: Rows shown by default in the table: the flagged tensors plus this many of the largest norms.
DEFAULT_TOP_ROWS = 20
#: Flagged tensors (or findings) listed one by one in every human format without ``--all``.
#: A dump taken after ``zero_grad(set_to_none=False)`` flags every tensor as vanishing;
#: a million table rows or annotations help nobody. The rest is counted, and
#: ``--all`` or ``--format json`` shows every one.
MAX_FLAGGED_ROWS = 50


def more_flagged(hidden: int, what: str = "flagged tensor") -> str:
    """``… 999,950 more flagged tensors not shown (--all or --format json lists every one)``."""
    return (
        f"… {hidden:,} more {what}{'' if hidden == 1 else 's'} not shown "
        "(--all or --format json lists every one)"
    )


@dataclass(frozen=True)
class RenderOptions:
    """How a report is rendered; formats ignore what does not apply to them."""

    width: int = 120
    color: bool = False
    show_all: bool = False
    top: int = DEFAULT_TOP_ROWS
    #: Only findings: no summary, no unflagged rows (data formats ignore it).
    quiet: bool = False


class Formatter(Protocol):
    """Turns a report into text. Where the text goes is the CLI's decision."""

    def __call__(self, report: Report, options: RenderOptions) -> str: ...


class ComparisonFormatter(Protocol):
    """Turns a comparison into text. Where the text goes is the CLI's decision."""

    def __call__(self, comparison: Comparison, options: RenderOptions) -> str: ...
