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
from gradaudit.report.json_report import encode_float
from gradaudit.report.text import number, plural, printable
from gradaudit.trend import (
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
#: Steps listed one by one in the table without ``--all``.
MAX_STEP_ROWS = 24
_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow"}


def sparkline(
    norms: Sequence[float | None], nonfinite: Sequence[int], width: int | None = None
) -> str:
    """One character per step (or per bucket of steps when ``width`` is smaller)."""
    count = len(norms)
    columns = count if width is None else max(1, min(width, count))
    logs = [math.log10(v) for v in norms if v is not None and 0 < v < math.inf]
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
    flags = []
    if layer.first_nonfinite_step is not None:
        flags.append(f"nonfinite@{layer.first_nonfinite_step}")
    if layer.spikes:
        worst = max(layer.spikes, key=lambda s: s.ratio)
        flags.append(f"spike@{layer.spikes[0].step} ×{worst.ratio:.3g}")
    if layer.collapse_step is not None:
        flags.append(f"collapse@{layer.collapse_step}")
    return ", ".join(flags)


def _finding_style(report: TrendReport, layer: str) -> str:
    severities = {f.severity for f in report.findings if f.layer == layer}
    if Severity.ERROR in severities:
        return "red"
    return "yellow" if severities else ""


def _present(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def _layers_table(report: TrendReport, options: RenderOptions) -> Table:
    steps = len(report.steps)
    labels = [printable(layer.name) for layer in report.layers]
    flags = [_layer_flags(layer) for layer in report.layers]
    label_cells = min(max([13, *(len(x) for x in labels)]), max(13, options.width // 4))
    flag_cells = min(max([8, *(len(x) for x in flags)]), 34)
    # Six columns: 7 borders and 2 cells of padding each; three numbers of 9 cells.
    # The sparkline gets what is left once the findings column has 16 cells (it folds).
    room = options.width - label_cells - min(flag_cells, 16) - 3 * 9 - 19
    spark_cells = max(8, min(steps, room))
    first, last = report.steps[0].step, report.steps[-1].step
    table = Table(
        title=f"Gradient norm per layer over {plural(steps, 'step')} ({first} … {last})",
        header_style="bold",
        title_justify="left",
    )
    table.add_column("layer", overflow="fold", max_width=label_cells)
    table.add_column("norm by step", no_wrap=True, min_width=spark_cells)
    for header in ("first", "last", "max"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("findings", overflow="fold", max_width=flag_cells)
    global_norms: list[float | None] = [s.global_norm if s.tensors else None for s in report.steps]
    table.add_row(
        Text("(global)", style="bold"),
        sparkline(global_norms, [s.nonfinite_tensors for s in report.steps], spark_cells),
        number(_present(global_norms)[0] if _present(global_norms) else None),
        number(_present(global_norms)[-1] if _present(global_norms) else None),
        number(max(_present(global_norms), default=None)),
        "",
        end_section=True,
    )
    for layer, label, flag in zip(report.layers, labels, flags, strict=True):
        norms = _present(layer.norms)
        style = _finding_style(report, layer.name)
        table.add_row(
            Text(label, style=style),
            Text(sparkline(layer.norms, layer.nonfinite, spark_cells), style=style),
            number(norms[0] if norms else None),
            number(norms[-1] if norms else None),
            number(max(norms, default=None)),
            Text(flag, style=style),
        )
    return table


def _steps_table(report: TrendReport, options: RenderOptions) -> tuple[Table, int]:
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
    table = Table(title=title, header_style="bold", title_justify="left")
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("file", overflow="fold")
    for header in ("tensors", "global norm", "NaN/Inf"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("findings", overflow="fold")
    for step in rows:
        here = flagged.get(step.step, [])
        text = Text()
        for finding in here:
            if text:
                text.append(", ")
            text.append(
                f"{finding.kind.value} {printable(finding.layer)}",
                style=_SEVERITY_STYLE[finding.severity],
            )
        table.add_row(
            str(step.step),
            Text(printable(Path(step.path).name if shared else step.path)),
            f"{step.tensors:,}",
            number(step.global_norm),
            Text(f"{step.nonfinite_tensors:,}", style="red" if step.nonfinite_tensors else ""),
            text,
        )
    return table, len(report.steps) - len(rows)


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
            f"{plural(len(report.layers), 'layer')} (group-by {report.group_by}) · "
            f"device {report.device} · engine {report.engine} · {report.elapsed_s:.2f} s"
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
        line = Text(f"{finding.kind.value}: ", style=_SEVERITY_STYLE[finding.severity])
        line.append(f"{printable(finding.layer)}: {printable(finding.message)}")
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
        console.print(_layers_table(report, options))
    if report.steps:
        table, hidden = _steps_table(report, options)
        console.print(table)
    for line in _summary_lines(report, hidden):
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
