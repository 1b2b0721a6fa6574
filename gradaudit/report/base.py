"""What every output format implements: a renderer per result type, and the options.

A :class:`Report`, a :class:`Comparison` and a :class:`TrendReport` are
different results; each format module (``report/formats/<format>.py``) renders
all three and offers them as one :class:`Renderers`, which the registry in
:mod:`gradaudit.report.formats` maps to its :class:`OutputFormat`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gradaudit.results import Report
from gradaudit.results.comparison import Comparison
from gradaudit.results.trend import TrendReport

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


@dataclass(frozen=True)
class Renderers:
    """One format's renderer for each result type.

    A renderer yields the text in chunks (a table, a block, one JSON tensor);
    where the text goes is the CLI's decision.
    """

    scan: Callable[[Report, RenderOptions], Iterator[str]]
    compare: Callable[[Comparison, RenderOptions], Iterator[str]]
    trend: Callable[[TrendReport, RenderOptions], Iterator[str]]
