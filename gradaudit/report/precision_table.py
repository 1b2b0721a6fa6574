"""``scan --precision``: the headroom table, as plain text of a given width.

One row per tensor (flagged ones, marked ``!``, and the worst ``top`` by
flushed fraction, or all), the whole run last, then the findings. Columns: non-zero values, the
fractions that would flush to zero, turn subnormal and overflow, the span of
binary exponents ``floor(log2|x|)``, and the power-of-two scale that brings
the most values into range without overflow.

The row choice (:func:`shown_rows`), the cells (:func:`cells`), the format's
range sentence (:func:`range_line`) and the one-line summary of a row
(:func:`summary_sentence`) are shared with the Markdown, GitHub and JUnit
formats, so every format shows the same rows with the same numbers.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from gradaudit.precision.formats import FORMATS, Precision
from gradaudit.precision.headroom import Headroom
from gradaudit.precision.judging import PrecisionReport
from gradaudit.report.fit import shorten_left
from gradaudit.report.text import count, printable

#: The number columns, in order (Markdown uses the same headers).
NUMBERS = ("values", "flush", "subnorm", "overflow", "log2|x|", "scale")
_WIDTHS = (11, 7, 8, 8, 10, 6)


def percent(part: int, whole: int) -> str:
    if not part:
        return "0"
    share = part / whole
    return f"{share:.1%}" if share >= 0.001 else "<0.1%"


def span(row: Headroom) -> str:
    """``min..max`` of ``floor(log2|x|)`` over the non-zero values, ``-`` when there are none."""
    if row.min_exponent is None or row.max_exponent is None:
        return "-"
    return f"{row.min_exponent}..{row.max_exponent}"


def cells(row: Headroom) -> tuple[str, ...]:
    """The :data:`NUMBERS` of one row as text."""
    return (
        count(row.nonzero),
        percent(row.flushed, row.nonzero),
        percent(row.subnormal, row.nonzero),
        percent(row.overflowed, row.nonzero),
        span(row),
        "-" if row.scale_log2 is None else f"2^{row.scale_log2}",
    )


def _line(name: str, cells: tuple[str, ...], name_width: int, mark: str = " ") -> str:
    name = shorten_left(name, name_width - 1)  # the one shortening rule (report/fit.py)
    parts = [(mark + name).ljust(name_width)]
    parts += [cell.rjust(width) for cell, width in zip(cells, _WIDTHS, strict=True)]
    return " ".join(parts).rstrip()


def shown_rows(report: PrecisionReport, *, top: int, show_all: bool) -> list[Headroom]:
    """The tensors a headroom table lists, in model order: every flagged one and the
    ``top`` with the largest flushed (then subnormal) fraction; all with ``show_all``."""
    rows = list(report.tensors)
    if show_all:
        return rows
    flagged = {f.tensor for f in report.findings}
    worst = sorted(rows, key=lambda r: (-r.flushed_fraction, -r.subnormal_fraction))[:top]
    keep = {id(r) for r in worst} | {id(r) for r in rows if r.name in flagged}
    return [r for r in rows if id(r) in keep]


def range_parts(precision: Precision) -> tuple[str, str]:
    """The format's range: where normals and subnormals begin; the largest value and beyond."""
    spec = FORMATS[precision]
    return (
        f"normal from {spec.min_normal:.3g}, subnormal from {spec.min_subnormal:.3g}",
        f"largest {spec.max:.5g} (beyond: {spec.overflow_result})",
    )


def range_line(precision: Precision) -> str:
    """:func:`range_parts` as one sentence."""
    return ", ".join(range_parts(precision))


def summary_sentence(row: Headroom) -> str:
    """One row in words, for formats without a table (a GitHub notice, a JUnit log)."""
    if not row.nonzero:
        return "no non-zero finite values"
    scale = "" if row.scale_log2 is None else f"; scale 2^{row.scale_log2}"
    return (
        f"{count(row.nonzero)} non-zero values: {percent(row.flushed, row.nonzero)} flush to "
        f"zero, {percent(row.subnormal, row.nonzero)} subnormal, "
        f"{percent(row.overflowed, row.nonzero)} overflow; log2|x| {span(row)}{scale}"
    )


def render_precision(
    report: PrecisionReport, *, width: int = 100, top: int = 10, show_all: bool = False
) -> str:
    """The headroom table for a terminal or a log, ``width`` columns at most."""
    spec = FORMATS[report.precision]
    flagged = {f.tensor for f in report.findings}
    rows = shown_rows(report, top=top, show_all=show_all)
    numbers_width = sum(_WIDTHS) + len(_WIDTHS)
    name_width = max(12, min(48, width - numbers_width))
    low, high = range_parts(report.precision)
    out = [
        f"Headroom in {spec.label}: {low},",
        f"{high}; values = non-zero finite",
        _line("tensor", NUMBERS, name_width, mark=""),
    ]
    for row in rows:
        mark = "!" if row.name in flagged else " "
        out.append(_line(printable(row.name), cells(row), name_width, mark))
    hidden = len(report.tensors) - len(rows)
    if hidden:
        out.append(f" … {hidden} more tensors (--all shows them)")
    out.append(_line(report.total.name, cells(report.total), name_width))
    for finding in report.findings:
        line = f"{finding.kind}: {printable(finding.tensor)}: {finding.message}"
        # Wrapped to the width like the rest (a name longer than it stays whole).
        out.append(textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False))
    if not report.findings:
        out.append(
            f"no tensor loses more than {report.max_underflow:g} of its values to underflow "
            f"in {spec.label}, none overflows"
        )
    return "\n".join(out) + "\n"


def render_headroom_trend(rows: Sequence[tuple[int, Headroom]], precision: Precision) -> str:
    """``trend --precision``: the whole dump's headroom at each step, one line per step."""
    spec = FORMATS[precision]
    out = [
        f"Headroom in {spec.label} over {len(rows)} steps (all tensors of each dump)",
        _line("step", NUMBERS, 10, mark=""),
    ]
    for step, row in rows:
        out.append(_line(str(step), cells(row), 10))
    return "\n".join(out) + "\n"
