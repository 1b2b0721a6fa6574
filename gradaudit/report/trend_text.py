"""Sentences and sparklines shared by the trend renderers, so the formats never disagree.

The trend counterpart of ``verdict.py`` and ``compare_text.py``. The sparkline
of a row is scaled to that row (log10, at least one decade tall, so that noise
around a flat norm stays flat): it shows each layer's shape over the run, while
the first/last/max columns give the magnitudes. ``!`` marks a step at which the
layer held NaN/Inf, ``·`` a zero norm, a blank a step at which the layer was
absent. When there are more steps than columns, each column shows the largest
norm of the steps it covers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gradaudit.errors import ExitCode
from gradaudit.policy import Severity
from gradaudit.report.text import internal_note, number, plural
from gradaudit.results.trend import LayerTrend, TrendKind, TrendReport
from gradaudit.results.verdict import trend_exit_code

_LEVELS = "▁▂▃▄▅▆▇█"
#: The sparkline gets one cell per step up to a fifth of the width, and at least this many.
MIN_SPARK_CELLS = 12


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


def layer_flags(layer: LayerTrend) -> str:
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


def finding_severity(report: TrendReport, layer: str) -> Severity | None:
    """The worst severity among a layer's findings; ``None`` without findings."""
    severities = {f.severity for f in report.findings if f.layer == layer}
    if Severity.ERROR in severities:
        return Severity.ERROR
    return Severity.WARNING if severities else None


def ends(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
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


def audited(report: TrendReport) -> bool:
    """Whether any dump held a tensor to audit (else the errors say why, and nothing else does)."""
    return any(step.tensors for step in report.steps)


def trend_line(report: TrendReport) -> str:
    """``Trend over 40 dumps (steps 0 … 39) · 12 layers (group-by depth 3) · device … · 0.41 s``."""
    span = f" (steps {report.steps[0].step} … {report.steps[-1].step})" if report.steps else ""
    engine = f" · device {report.device} · engine {report.engine}" if audited(report) else ""
    return (
        f"Trend over {plural(len(report.steps), 'dump')}{span} · "
        f"{plural(len(report.layers), 'layer')} (group-by {report.group_by})"
        f"{engine} · {report.elapsed_s:.2f} s"
    )


def findings_line(report: TrendReport) -> str:
    """``Findings: nonfinite 1 · spike 0 · collapse 0   (spike factor 10, vanishing < 1e-07)``."""
    policy = report.policy
    counts = {kind: sum(1 for f in report.findings if f.kind is kind) for kind in TrendKind}
    return (
        "Findings: "
        + " · ".join(f"{kind.value} {n}" for kind, n in counts.items())
        + f"   (spike factor {policy.spike_factor:g}, vanishing < {number(policy.vanishing)})"
    )


def verdict_line(report: TrendReport) -> str:
    """``OK: no failing findings``, ``FAIL: 2 failing findings (spike)`` or ``INCOMPLETE: …``."""
    code = trend_exit_code(report)
    if code in (ExitCode.INPUT_ERROR, ExitCode.INTERNAL_ERROR):
        what = (
            plural(len(report.errors), "input") + " could not be audited"
            if report.errors
            else "nothing to audit: no floating-point tensor in any dump"
        )
        return f"INCOMPLETE: {what}{internal_note(report.errors)}"
    if code is ExitCode.FINDINGS:
        failing = [f for f in report.findings if f.failing]
        kinds = sorted({f.kind.value for f in failing})
        return f"FAIL: {plural(len(failing), 'failing finding')} ({', '.join(kinds)})"
    warnings = len(report.findings)
    note = f" ({plural(warnings, 'warning')})" if warnings else ""
    return f"OK: no failing findings{note}"
