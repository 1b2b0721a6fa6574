"""Renderers of a :class:`~gradaudit.trend.TrendReport`: a Rich table with sparklines, and JSON.

The sparkline of a row is scaled to that row (log10, at least one decade tall,
so that noise around a flat norm stays flat): it shows each layer's shape over
the run, while the first/last/max columns give the magnitudes. ``!`` marks a
step at which the layer held NaN/Inf, ``·`` a zero norm, a blank a step at
which the layer was absent. When there are more steps than columns, each column
shows the largest norm of the steps it covers.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from rich.table import Table
from rich.text import Text

from gradaudit import __version__
from gradaudit._compat import assert_never
from gradaudit.errors import ExitCode
from gradaudit.grouping import GroupMode
from gradaudit.policy import Severity
from gradaudit.report.base import RenderOptions
from gradaudit.report.console import string_console
from gradaudit.report.fit import (
    MIN_NAME_CELLS,
    Column,
    Layout,
    dropped_note,
    fitted_table,
    sane_width,
    shorten_left,
    shorten_path,
)
from gradaudit.report.json_report import encode_float
from gradaudit.report.text import layer_label, number, plural, printable
from gradaudit.trend.builder import (
    MIN_COLLAPSE_STEPS,
    MIN_SPIKE_HISTORY,
    LayerTrend,
    TrendFinding,
    TrendKind,
    TrendReport,
    trend_exit_code,
)

#: Bumped whenever a field of the trend JSON changes meaning or disappears.
TREND_SCHEMA_VERSION = 1
_LEVELS = "▁▂▃▄▅▆▇█"
#: The sparkline gets one cell per step up to a fifth of the width, and at least this many.
MIN_SPARK_CELLS = 12
#: Cells of the steps table besides its findings: step, global norm, NaN/Inf, borders.
_STEP_COLUMNS_CELLS = 4 + 11 + 7 + 3 * 4 + 1
#: Steps listed one by one in the table without ``--all``.
MAX_STEP_ROWS = 24
_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow"}


def sparkline(
    norms: Sequence[float | None], nonfinite: Sequence[int], width: int | None = None
) -> str:
    """One character per step (or per bucket of steps when ``width`` is smaller)."""
    count = len(norms)
    columns = count if width is None else max(1, min(width, count))
    # Steps with NaN/Inf show as ``!``; their norms cover only the finite part and
    # would stretch the scale of the others.
    logs = [
        math.log10(v)
        for v, bad in zip(norms, nonfinite, strict=True)
        if v is not None and not bad and 0 < v < math.inf
    ]
    lo = min(logs, default=0.0)
    hi = max(max(logs, default=0.0), lo + 1.0)
    chars = []
    for column in range(columns):
        start, stop = column * count // columns, (column + 1) * count // columns
        values = [v for v in norms[start:stop] if v is not None]
        if any(nonfinite[start:stop]):
            chars.append("!")
        elif not values:
            chars.append(" ")
        elif max(values) == math.inf:
            chars.append(_LEVELS[-1])
        elif max(values) == 0:
            chars.append("·")
        else:
            peak = math.log10(max(values))
            level = math.floor((peak - lo) / (hi - lo) * (len(_LEVELS) - 1) + 0.5)
            chars.append(_LEVELS[min(len(_LEVELS) - 1, max(0, level))])
    return "".join(chars)


def _layer_flags(layer: LayerTrend) -> str:
    """``nonfinite@16, spike@12 ×1.06e+04 (+1 more)``: the steps the findings name.

    A spike is shown at the step of the layer's first spike with *that* step's
    ratio, as in its finding and in the JSON; later spikes are only counted.
    """
    flags = []
    if layer.first_nonfinite_step is not None:
        flags.append(f"nonfinite@{layer.first_nonfinite_step}")
    if layer.spikes:
        first = layer.spikes[0]
        more = f" (+{len(layer.spikes) - 1} more)" if len(layer.spikes) > 1 else ""
        flags.append(f"spike@{first.step} ×{number(first.ratio)}{more}")
    if layer.collapse_step is not None:
        flags.append(f"collapse@{layer.collapse_step}")
    return ", ".join(flags)


def _finding_style(report: TrendReport, layer: str) -> str:
    severities = {f.severity for f in report.findings if f.layer == layer}
    if Severity.ERROR in severities:
        return "red"
    return "yellow" if severities else ""


def _ends(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    """First, last and largest value; first and last are those of the first and last step.

    ``None`` (shown ``-``) where that step had no finite value: never a 0 that was not measured.
    """
    present = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return values[0], values[-1], max(present, default=None)


def spark_cells(steps: int, width: int) -> int:
    """Sparkline cells: one per step up to a fifth of the width (at least 12).

    With fewer cells than steps each cell shows the largest norm of its steps,
    so a one-step spike stays visible.
    """
    return max(1, min(steps, max(MIN_SPARK_CELLS, width // 5)))


def _layers_table(report: TrendReport, options: RenderOptions) -> tuple[Table, Layout]:
    steps = len(report.steps)
    width = sane_width(options.width)
    cells = spark_cells(steps, width)
    first, last = report.steps[0].step, report.steps[-1].step
    global_norms = [s.global_norm if s.tensors else None for s in report.steps]
    names: list[Text | str] = [Text("(global)", style="bold")]
    sparks: list[Text | str] = [
        sparkline(global_norms, [s.nonfinite_tensors for s in report.steps], cells)
    ]
    ends = [_ends(global_norms)]
    flags: list[Text | str] = [""]
    for layer in report.layers:
        style = _finding_style(report, layer.name)
        names.append(Text(printable(layer.name), style=style))
        sparks.append(Text(sparkline(layer.norms, layer.nonfinite, cells), style=style))
        ends.append(_ends(layer.norms))
        flags.append(Text(_layer_flags(layer), style=style))
    columns = [
        Column("layer", names, kind="name"),
        Column("norm by step", sparks),
        Column("first", [number(e[0]) for e in ends], "right", priority=10),
        Column("last", [number(e[1]) for e in ends], "right", priority=20),
        Column("max", [number(e[2]) for e in ends], "right", priority=30),
        Column("findings", flags, kind="prose"),
    ]
    title = f"Gradient norm per layer over {plural(steps, 'step')} ({first} … {last})"
    return fitted_table(columns, width, title=title, sections=(0,))


def _steps_table(report: TrendReport, options: RenderOptions) -> tuple[Table, Layout, int]:
    flagged: dict[int, list[TrendFinding]] = {}
    for finding in report.findings:
        flagged.setdefault(finding.step, []).append(finding)
    rows = list(report.steps)
    if not options.show_all and len(rows) > MAX_STEP_ROWS:
        keep = {0, 1, 2, len(rows) - 3, len(rows) - 2, len(rows) - 1}
        keep |= {i for i, s in enumerate(rows) if s.step in flagged}
        rows = [s for i, s in enumerate(rows) if i in keep]
    parents = {str(Path(s.path).parent) for s in report.steps}
    shared = parents.pop() if len(parents) == 1 else None
    title = "Global norm per step" + (f" (files in {printable(shared)})" if shared else "")
    # One finding per line, its layer shortened from the left to what the width leaves
    # after the step, global norm and NaN/Inf columns: a layer name never folds.
    room = max(MIN_NAME_CELLS, sane_width(options.width) - _STEP_COLUMNS_CELLS)
    findings: list[Text | str] = []
    for step in rows:
        text = Text()
        for finding in flagged.get(step.step, []):
            if text:
                text.append("\n")
            kind = f"{finding.kind.value} in "
            label = shorten_left(layer_label(finding.layer), max(8, room - len(kind)))
            text.append(kind + label, style=_SEVERITY_STYLE[finding.severity])
        findings.append(text)
    columns = [
        Column("step", [str(s.step) for s in rows], "right"),
        Column(
            "file",
            [shorten_path(printable(Path(s.path).name if shared else s.path), 24) for s in rows],
            priority=10,
        ),
        Column("tensors", [f"{s.tensors:,}" for s in rows], "right", priority=20),
        Column("global norm", [number(s.global_norm) for s in rows], "right"),
        Column(
            "NaN/Inf",
            [
                Text(f"{s.nonfinite_tensors:,}", style="red" if s.nonfinite_tensors else "")
                for s in rows
            ],
            "right",
        ),
        Column("findings", findings, kind="prose"),
    ]
    table, layout = fitted_table(columns, sane_width(options.width), title=title)
    return table, layout, len(report.steps) - len(rows)


def _summary_lines(report: TrendReport, hidden_steps: int) -> list[Text]:
    lines: list[Text] = []
    if hidden_steps:
        lines.append(
            Text(f"… {plural(hidden_steps, 'more step')} not shown (--all shows every step)")
        )
    policy = report.policy
    span = f" (steps {report.steps[0].step} … {report.steps[-1].step})" if report.steps else ""
    lines.append(
        Text(
            f"Trend over {plural(len(report.steps), 'dump')}{span} · "
            f"{plural(len(report.layers), 'layer')} (group-by {report.group_by})"
            + (
                f" · device {report.device} · engine {report.engine}"
                if any(step.tensors for step in report.steps)
                else ""
            )
            + f" · {report.elapsed_s:.2f} s"
        )
    )
    counts = {kind: sum(1 for f in report.findings if f.kind is kind) for kind in TrendKind}
    lines.append(
        Text(
            "Findings: "
            + " · ".join(f"{kind.value} {n}" for kind, n in counts.items())
            + f"   (spike factor {policy.spike_factor:g}, vanishing < {number(policy.vanishing)})"
        )
    )
    for finding in report.findings:
        line = Text(f"{finding.kind.value}", style=_SEVERITY_STYLE[finding.severity])
        line.append(f" in {layer_label(finding.layer)}: {printable(finding.message)}")
        lines.append(line)
    code = trend_exit_code(report)
    if code is ExitCode.INPUT_ERROR:
        what = (
            plural(len(report.errors), "input") + " could not be audited"
            if report.errors
            else "nothing to audit: no floating-point tensor in any dump"
        )
        lines.append(Text(f"INCOMPLETE: {what}", style="bold red"))
    elif code is ExitCode.FINDINGS:
        failing = [f for f in report.findings if f.failing]
        kinds = sorted({f.kind.value for f in failing})
        lines.append(
            Text(
                f"FAIL: {plural(len(failing), 'failing finding')} ({', '.join(kinds)})",
                style="bold red",
            )
        )
    else:
        warnings = len(report.findings)
        note = f" ({plural(warnings, 'warning')})" if warnings else ""
        lines.append(Text(f"OK: no failing findings{note}", style="bold green"))
    return lines


def render_trend_table(report: TrendReport, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    hidden = 0
    if report.layers:
        table, layout = _layers_table(report, options)
        console.print(table)
        if (note := dropped_note(layout)) is not None:
            console.print(note)
    if report.steps:
        table, layout, hidden = _steps_table(report, options)
        console.print(table)
        if (note := dropped_note(layout)) is not None:
            console.print(note)
    lines = _summary_lines(report, hidden)
    if report.errors and not any(step.tensors for step in report.steps):
        lines = lines[-1:]  # nothing audited: the errors are on stderr, the verdict says so
    for line in lines:
        console.print(line)
    return buffer.getvalue()


def _floats(values: Sequence[float | None]) -> list[float | str | None]:
    return [encode_float(v) for v in values]


def trend_document(report: TrendReport) -> dict[str, Any]:
    """The trend JSON document as Python data."""
    policy = report.policy
    spec = report.group_by
    first_nonfinite = next((f.step for f in report.findings if f.kind is TrendKind.NONFINITE), None)
    return {
        "schema_version": TREND_SCHEMA_VERSION,
        "gradaudit_version": __version__,
        "command": "trend",
        "device": report.device,
        "engine": report.engine,
        "elapsed_s": round(report.elapsed_s, 6),
        "group_by": {
            "mode": spec.mode.value,
            "depth": spec.depth if spec.mode is GroupMode.DEPTH else None,
            "auto": spec.chosen,
        },
        "policy": {
            "spike_factor": encode_float(policy.spike_factor),
            "vanishing": encode_float(policy.vanishing),
            "fail_on": sorted(kind.value for kind in policy.fail_on),
            "min_spike_history": MIN_SPIKE_HISTORY,
            "min_collapse_steps": MIN_COLLAPSE_STEPS,
        },
        "steps": [
            {
                "step": s.step,
                "file": s.path,
                "tensors": s.tensors,
                "global_norm": encode_float(s.global_norm),
                "nonfinite_tensors": s.nonfinite_tensors,
                "gradient_health": encode_float(s.gradient_health),
                "read_as": s.read_as,
            }
            for s in report.steps
        ],
        "layers": [
            {
                "name": layer.name,
                "norms": _floats(layer.norms),
                "max_abs": _floats(layer.max_abs),
                "nonfinite": list(layer.nonfinite),
                "spikes": [
                    {
                        "step": s.step,
                        "norm": encode_float(s.norm),
                        "median": encode_float(s.median),
                        "ratio": encode_float(s.ratio),
                    }
                    for s in layer.spikes
                ],
                "first_nonfinite_step": layer.first_nonfinite_step,
                "collapse_step": layer.collapse_step,
            }
            for layer in report.layers
        ],
        "findings": [
            {
                "kind": f.kind.value,
                "severity": f.severity.value,
                "layer": f.layer,
                "step": f.step,
                "file": f.path,
                "message": f.message,
                "tensors": [
                    {
                        "name": t.name,
                        "layer": t.layer,
                        "nan": t.nan,
                        "pos_inf": t.pos_inf,
                        "neg_inf": t.neg_inf,
                    }
                    for t in f.tensors
                ],
            }
            for f in report.findings
        ],
        "errors": [{"file": e.path, "message": e.message} for e in report.errors],
        "summary": {
            "dumps": len(report.steps),
            "layers": len(report.layers),
            "first_nonfinite_step": first_nonfinite,
            "failing_findings": sum(1 for f in report.findings if f.failing),
            "warnings": sum(1 for f in report.findings if not f.failing),
            "input_errors": len(report.errors),
        },
        "exit_code": int(trend_exit_code(report)),
    }


def render_trend_json(report: TrendReport, options: RenderOptions) -> str:
    return json.dumps(trend_document(report), indent=2, allow_nan=False) + "\n"


class TrendFormatter(Protocol):
    """Turns a trend report into text, like :class:`~gradaudit.report.base.Formatter`."""

    def __call__(self, report: TrendReport, options: RenderOptions) -> str: ...


class TrendFormat(str, Enum):
    """``gradaudit trend --format``."""

    TABLE = "table"
    JSON = "json"

    def formatter(self) -> TrendFormatter:
        if self is TrendFormat.TABLE:
            return render_trend_table
        if self is TrendFormat.JSON:
            return render_trend_json
        assert_never(self)
