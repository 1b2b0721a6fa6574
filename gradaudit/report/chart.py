"""The gradient-flow chart in the terminal: one bar of log10(norm) per layer.

Rows follow the model (see :mod:`gradaudit.grouping`); every bar starts at the
left edge of one shared log axis, so a starving depth of the network shows as a
run of short bars and an exploding one as a bar past the exploding mark. Bars
are coloured by the worst finding among the layer's tensors (green: none,
yellow: a warning, red: a failing finding); the vanishing and exploding
thresholds are drawn as ``┊`` in every row that does not cover them.

Geometry (what the tests check):

* the axis spans whole decades ``[lo, hi]``: ``lo`` is the decade at or below
  the smallest positive norm or threshold (one decade lower when that value is
  itself a power of ten, so it is not drawn on the border), ``hi`` likewise above
  the largest;
* a bar of ``norm`` is ``floor(B * (log10(norm) - lo) / (hi - lo) + 0.5)`` cells
  of ``█``, at least 1 for a positive norm; 0 for a zero norm; all ``B`` for an
  infinite one;
* a threshold ``t`` is marked in cell ``min(position(t), B - 1)``.

Thresholds apply to tensors, so a group of many tensors can pass the exploding
mark with no exploding tensor in it; the colour and the status column say
whether any of its tensors was flagged.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text

from gradaudit.grouping import GroupBy, Layer, group_layers, resolve
from gradaudit.policy import Role, Severity, Thresholds
from gradaudit.report.base import RenderOptions
from gradaudit.report.console import string_console
from gradaudit.report.fit import shorten_left
from gradaudit.report.styles import ROW_STYLE
from gradaudit.report.text import number, plural, printable
from gradaudit.results import Report, TensorStats

#: ``--chart`` is on by default only on a terminal at least this wide.
MIN_AUTO_CHART_WIDTH = 80
#: Bars never get narrower than this, however narrow the output.
MIN_BAR_CELLS = 10
_VALUE_CELLS = 9
_BAR = "█"
_MARK = "┊"


@dataclass(frozen=True)
class LogAxis:
    """A log10 axis over whole decades ``[lo, hi]`` drawn in ``cells`` cells."""

    lo: int
    hi: int
    cells: int

    @classmethod
    def covering(cls, values: Sequence[float], cells: int) -> LogAxis:
        positive = [v for v in values if v > 0 and math.isfinite(v)]
        if not positive:
            return cls(-1, 1, cells)
        low, high = math.log10(min(positive)), math.log10(max(positive))
        lo = math.floor(low) - (1 if low == math.floor(low) else 0)
        hi = math.ceil(high) + (1 if high == math.ceil(high) else 0)
        return cls(lo, hi, cells)

    def position(self, value: float) -> float:
        """Where ``value`` falls, in cells from the left edge (not clamped)."""
        return self.cells * (math.log10(value) - self.lo) / (self.hi - self.lo)

    def bar(self, value: float) -> int:
        """Cells of the bar for ``value`` (see the module docstring)."""
        if math.isnan(value) or value <= 0:
            return 0
        if math.isinf(value):
            return self.cells
        return min(self.cells, max(1, math.floor(self.position(value) + 0.5)))

    def mark(self, value: float) -> int:
        """The cell that marks a threshold ``value``."""
        return min(self.cells - 1, max(0, math.floor(self.position(value) + 0.5)))


def status_text(layer: Layer) -> Text:
    """``nan``, ``1 of 6 vanishing`` …: the findings in a layer, coloured by severity.

    A group's status comes from its members: a module whose norm is healthy but
    whose key bias vanishes says ``1 of 6 vanishing``, not ``vanishing``.
    A bar past a drawn threshold with no member flagged says so too
    (``group > 100``), so the picture never contradicts its own lines.
    """
    text = Text()
    for kind, tensors in layer.kind_counts():
        if text:
            text.append(", ")
        severity = next(f.severity for f in layer.findings if f.kind is kind)
        label = kind.value if layer.tensors == 1 else f"{tensors} of {layer.tensors} {kind.value}"
        text.append(label, style="bold red" if severity is Severity.ERROR else "yellow")
    return text


def beyond_threshold(layer: Layer, thresholds: Thresholds) -> str | None:
    """``group > 100`` / ``group < 1e-07`` when a group's norm passes a drawn threshold line
    that none of its tensors passes on its own (thresholds judge tensors, not groups)."""
    if layer.tensors <= 1 or not math.isfinite(layer.norm):
        return None
    kinds = {kind.value for kind, _ in layer.kind_counts()}
    if layer.norm > thresholds.exploding and "exploding" not in kinds:
        return f"group > {number(thresholds.exploding)}"
    if 0 < layer.norm < thresholds.vanishing and "vanishing" not in kinds:
        return f"group < {number(thresholds.vanishing)}"
    return None


def drawn_severity(layer: Layer, thresholds: Thresholds) -> Severity | None:
    """The colour a layer's bar gets: its findings', or the colour of a threshold line it passes."""
    note = beyond_threshold(layer, thresholds)
    if layer.severity is Severity.ERROR or (note is not None and ">" in note):
        return Severity.ERROR
    if note is not None:
        return Severity.WARNING
    return layer.severity


def layer_status(layer: Layer, thresholds: Thresholds) -> Text:
    """:func:`status_text` plus the note of :func:`beyond_threshold`, if any."""
    text = status_text(layer)
    note = beyond_threshold(layer, thresholds)
    if note is not None:
        if text:
            text.append(", ")
        text.append(note, style="red" if ">" in note else "yellow")
    return text


def _marks(thresholds: Thresholds) -> list[tuple[float, str, str]]:
    """(value, label, style) of the thresholds that can be drawn on a log axis."""
    marks = []
    if thresholds.vanishing > 0:
        marks.append(
            (thresholds.vanishing, f"vanishing < {number(thresholds.vanishing)}", "yellow")
        )
    marks.append((thresholds.exploding, f"exploding > {number(thresholds.exploding)}", "red"))
    return marks


def _place(line: list[str], start: int, text: str) -> bool:
    """Write ``text`` into ``line`` at ``start`` if it fits on blanks with a gap; say if it did."""
    end = start + len(text)
    if start < 0 or end > len(line):
        return False
    if any(c != " " for c in line[max(0, start - 1) : min(len(line), end + 1)]):
        return False
    line[start:end] = list(text)
    return True


def _header(axis: LogAxis, thresholds: Thresholds) -> list[str]:
    """Lines above the bars naming each threshold next to its mark.

    Indices are those of a row's ``│bar│``: 0 is the left border, cell ``i`` is ``i + 1``.
    """
    lines: list[list[str]] = []
    for value, label, _ in _marks(thresholds):
        index = axis.mark(value) + 1
        for line in [*lines, [" "] * (axis.cells + 2)]:
            if line[index] != " ":
                continue
            if _place(line, index + 2, label) or _place(line, index - len(label) - 1, label):
                line[index] = _MARK
                if line not in lines:
                    lines.append(line)
                break
    return ["".join(line).rstrip() for line in lines]


def _footer(axis: LogAxis) -> tuple[str, str]:
    """The axis line with a tick per labelled decade, and the decade labels under it."""
    decades = axis.hi - axis.lo
    steps = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)
    step = next((s for s in steps if axis.cells * s / decades >= 7), decades)
    rule = ["└", *("─" * axis.cells), "┘"]
    labels = [" "] * (axis.cells + 2)
    first = -(-axis.lo // step) * step
    for decade in range(first, axis.hi + 1, step):
        index = axis.mark(10.0**decade) + 1 if decade < axis.hi else axis.cells + 1
        if 0 < index <= axis.cells:
            rule[index] = "┴"
        text = number(10.0**decade)
        if not _place(labels, index, text):
            _place(labels, index - len(text) + 1, text)
    return "".join(rule), "".join(labels).rstrip()


def chart_lines(
    layers: Sequence[Layer],
    thresholds: Thresholds,
    width: int,
    *,
    title: str | None = None,
) -> list[Text]:
    """The chart as Rich ``Text`` lines that fit ``width`` columns (bars at least 10 cells)."""
    if not layers:
        return []
    statuses = [layer_status(layer, thresholds) for layer in layers]
    status_cells = max(len(s) for s in statuses)
    labels = [printable(layer.name) for layer in layers]
    label_cells = min(max(len(label) for label in labels), max(12, width // 3))
    fixed = 3 + _VALUE_CELLS + (status_cells + 1 if status_cells else 0)
    if width - label_cells - fixed < MIN_BAR_CELLS:
        label_cells = max(8, width - fixed - MIN_BAR_CELLS)
    cells = max(MIN_BAR_CELLS, width - label_cells - fixed)
    values = [layer.norm for layer in layers] + [value for value, _, _ in _marks(thresholds)]
    axis = LogAxis.covering(values, cells)
    marks = [(axis.mark(value), style) for value, _, style in _marks(thresholds)]
    indent = " " * (label_cells + 1)

    lines: list[Text] = []
    if title:
        lines.append(Text(title, style="bold"))
    lines += [Text(indent + line, style="dim") for line in _header(axis, thresholds)]
    several_files = len({layer.source for layer in layers}) > 1
    source: object = object()
    for layer, label, status in zip(layers, labels, statuses, strict=True):
        if several_files and layer.source != source:
            source = layer.source
            lines.append(Text(printable(layer.source or "(in memory)"), style="bold"))
        label = shorten_left(label, label_cells)
        severity = drawn_severity(layer, thresholds)
        filled = axis.bar(layer.norm)
        # A healthy layer's bar is green, its label plain; a flagged one's both in its row style.
        row = Text(label.ljust(label_cells), style="" if severity is None else ROW_STYLE[severity])
        row.append(" │")
        row.append(_BAR * filled, style="green" if severity is None else ROW_STYLE[severity])
        rest = [" "] * (cells - filled)
        styles: dict[int, str] = {}
        for cell, style in marks:
            if cell >= filled:
                rest[cell - filled] = _MARK
                styles[cell - filled] = style
        for offset, char in enumerate(rest):
            row.append(char, style=styles.get(offset, ""))
        row.append("│")
        row.append(number(layer.norm).rjust(_VALUE_CELLS))
        if status:
            row.append(" ")
            row.append_text(status)
        lines.append(row)
    rule, ticks = _footer(axis)
    lines.append(Text(indent + rule, style="dim"))
    lines.append(Text(indent + ticks, style="dim"))
    return lines


def chart_title(report: Report, layers: Sequence[Layer], spec: GroupBy) -> str:
    """The chart's title names what it shows: gradient flow only when the bars are gradients."""
    roles = {t.role for t in charted_tensors(report)}
    # One role: name it; several (a checkpoint of neither weights nor gradients): "Tensors".
    titles: dict[Role | None, str] = {Role.GRADIENT: "Gradient flow", Role.WEIGHT: "Weights"}
    what = titles.get(roles.pop() if len(roles) == 1 else None, "Tensors")
    return (
        f"{what}: L2 norm per layer, log10 scale · group-by {spec} · {plural(len(layers), 'row')}"
    )


def charted_tensors(report: Report) -> tuple[TensorStats, ...]:
    """The tensors a chart shows: one role only, gradients first, else weights.

    A layer's bar is a norm over its tensors; a norm over a weight, its Adam moments and
    a buffer together means nothing, so a checkpoint's chart shows its weights.
    """
    for role in (Role.GRADIENT, Role.WEIGHT):
        chosen = tuple(t for t in report.tensors if t.role is role)
        if chosen:
            return chosen
    return tuple(report.tensors)


def report_layers(report: Report, group_by: GroupBy) -> tuple[GroupBy, tuple[Layer, ...]]:
    """Resolve ``group_by`` over the charted names and group those tensors."""
    tensors = charted_tensors(report)
    spec = resolve(group_by, (t.name for t in tensors))
    return spec, group_layers(tensors, report.findings, spec)


def render_chart(report: Report, options: RenderOptions, group_by: GroupBy) -> str:
    """The chart of ``report`` as text (empty when nothing was audited), ending in a blank line."""
    if not report.tensors:
        return ""
    spec, layers = report_layers(report, group_by)
    buffer = io.StringIO()
    console = string_console(buffer, options)
    for line in chart_lines(
        layers, report.thresholds, options.width, title=chart_title(report, layers, spec)
    ):
        console.print(line, overflow="crop", no_wrap=True)
    console.print()
    return buffer.getvalue()
