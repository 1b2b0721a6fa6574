"""``gradaudit compare --format table``: dual stats, the interpretation, A vs B per parameter.

Sections, top to bottom: a two-row table (host, seed) with norms, parameter
counts and NaN/Inf/vanishing/exploding counts; the raw and normalized ratios and
one sentence saying what they mean; the per-parameter table when the sides share
names (flagged rows first, then the largest changes; ``--all`` shows every row),
the names only in A or only in B and the mismatches; the findings; the verdict.
Names are ``Text`` after :func:`printable`, never Rich markup.
"""

from __future__ import annotations

import io
import math

from rich.table import Table
from rich.text import Text

from gradaudit.compare_checks import comparison_exit_code
from gradaudit.comparison import Comparison, ParameterChange, ParameterComparison, SideStats
from gradaudit.errors import ExitCode
from gradaudit.policy import Severity
from gradaudit.report.base import RenderOptions
from gradaudit.report.compare_text import (
    SHORT_FORMULA,
    change_order,
    failing_kinds,
    interpretation,
    side_input,
)
from gradaudit.report.console import string_console
from gradaudit.report.text import count, number, plural, printable

_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow"}
#: Names listed per "only in A/B" or mismatch line, and findings listed, before "… N more".
_LIST_LIMIT = 10
_FINDING_LIMIT = 20


def _dual_table(comparison: Comparison) -> Table:
    table = Table(header_style="bold")
    table.add_column("side", no_wrap=True)
    table.add_column("input", overflow="fold")
    for header in ("tensors", "params", "norm", "norm/√params", "NaN", "±Inf"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("vanishing", justify="right", no_wrap=True)
    table.add_column("exploding", justify="right", no_wrap=True)
    dual = comparison.dual
    for side, letter in ((dual.host, "A"), (dual.seed, "B")):
        table.add_row(*_side_cells(side, letter))
    return table


def _side_cells(side: SideStats, letter: str) -> list[Text | str]:
    bad = "red" if side.nonfinite else ""
    return [
        f"{side.label} ({letter})",
        Text(printable(side_input(side))),
        count(side.tensors),
        count(side.params),
        number(side.norm),
        number(side.norm_per_sqrt_param),
        Text(count(side.nan), style=bad if side.nan else ""),
        Text(count(side.inf), style=bad if side.inf else ""),
        count(side.vanishing_tensors),
        count(side.exploding_tensors),
    ]


def _ratio_lines(comparison: Comparison) -> list[Text]:
    dual = comparison.dual
    style = "bold red" if dual.normalized_ratio is None else "bold"
    return [
        Text(
            f"raw ratio seed/host {number(dual.raw_ratio)} · "
            f"normalized ratio {number(dual.normalized_ratio)}   (= {SHORT_FORMULA})"
        ),
        Text(interpretation(dual), style=style),
    ]


def _change_text(change: ParameterChange) -> str:
    relative = change.relative_change
    if relative is None:
        return "-"
    if math.isinf(relative):
        return "+inf"
    percent = 100.0 * relative
    return f"{percent:+,.0f}%" if abs(percent) >= 1000 else f"{percent:+.3g}%"


def _status(change: ParameterChange) -> Text:
    if change.note is not None:
        return Text(change.note, style="yellow")
    if change.flagged:
        return Text("changed", style="bold red")
    return Text("ok", style="green")


def _parameter_table(parameters: ParameterComparison, options: RenderOptions) -> tuple[Table, int]:
    ordered = sorted(parameters.changes, key=change_order)
    notable = [c for c in ordered if c.flagged or c.note is not None]
    rest = [c for c in ordered if not (c.flagged or c.note is not None)]
    shown_rest = rest if options.show_all else rest[: options.top]
    table = Table(header_style="bold")
    table.add_column("name", overflow="fold")
    table.add_column("shape", overflow="fold")
    for header in ("norm A", "norm B", "B/A", "change"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for change in notable + shown_rest:
        table.add_row(
            Text(printable(change.name), style="red" if change.flagged else ""),
            "×".join(str(d) for d in change.shape) or "()",
            number(change.norm_a),
            number(change.norm_b),
            number(change.ratio),
            _change_text(change),
            _status(change),
        )
    return table, len(rest) - len(shown_rest)


def _name_list(title: str, names: list[str]) -> Text:
    shown = ", ".join(printable(name) for name in names[:_LIST_LIMIT])
    more = f", … and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return Text(f"{title} ({len(names)}): {shown}{more}")


def _parameter_lines(parameters: ParameterComparison, hidden: int) -> list[Text]:
    lines: list[Text] = []
    if hidden:
        lines.append(Text(f"… {plural(hidden, 'more shared tensor')} not shown (--all shows all)"))
    if parameters.only_in_a:
        lines.append(_name_list("only in A", list(parameters.only_in_a)))
    if parameters.only_in_b:
        lines.append(_name_list("only in B", list(parameters.only_in_b)))
    for mismatch in parameters.mismatches[:_LIST_LIMIT]:
        parts = []
        if mismatch.shape_differs:
            shape_a = "×".join(map(str, mismatch.shape_a)) or "()"
            shape_b = "×".join(map(str, mismatch.shape_b)) or "()"
            parts.append(f"shape {shape_a} vs {shape_b} (not compared)")
        if mismatch.dtype_differs:
            parts.append(f"dtype {mismatch.dtype_a} vs {mismatch.dtype_b}")
        lines.append(Text(f"mismatch {printable(mismatch.name)}: {'; '.join(parts)}", "yellow"))
    if len(parameters.mismatches) > _LIST_LIMIT:
        lines.append(Text(f"… and {len(parameters.mismatches) - _LIST_LIMIT} more mismatches"))
    return lines


def _finding_lines(comparison: Comparison, options: RenderOptions) -> list[Text]:
    tensor_findings = sorted(comparison.tensor_findings, key=lambda f: not f.failing)
    limit = len(tensor_findings) if options.show_all else _FINDING_LIMIT
    lines = [
        Text(
            f"{f.severity.value}: {printable(f.tensor)} ({f.source}): {f.kind.value}: {f.message}",
            style=_SEVERITY_STYLE[f.severity],
        )
        for f in tensor_findings[:limit]
    ]
    if len(tensor_findings) > limit:
        lines.append(
            Text(f"… {plural(len(tensor_findings) - limit, 'more tensor finding')} (--all)")
        )
    lines += [
        Text(f"{f.severity.value}: {f.message}", style=_SEVERITY_STYLE[f.severity])
        for f in comparison.findings
    ]
    return lines


def _summary_lines(comparison: Comparison) -> list[Text]:
    report = comparison.report
    dual = comparison.dual
    lines = [
        Text(
            f"Compared {count(dual.host.tensors)} host and {count(dual.seed.tensors)} seed "
            f"tensors, skipped {report.summary.skipped} · device {report.device} · "
            f"engine {report.engine} · {report.elapsed_s:.2f} s"
        )
    ]
    for skipped in report.skipped[:_LIST_LIMIT]:
        side = f"{skipped.source} " if skipped.source else ""
        lines.append(Text(f"skipped {side}{printable(skipped.name)}: {skipped.reason}", "dim"))
    if len(report.skipped) > _LIST_LIMIT:
        lines.append(Text(f"… and {len(report.skipped) - _LIST_LIMIT} more skipped", "dim"))
    code = comparison_exit_code(comparison)
    if code is ExitCode.INPUT_ERROR:
        what = plural(len(comparison.errors), "input problem")
        lines.append(Text(f"INCOMPLETE: {what}; nothing is compared", style="bold red"))
    elif code is ExitCode.FINDINGS:
        failing = sum(1 for f in comparison.tensor_findings if f.failing)
        failing += sum(1 for f in comparison.findings if f.failing)
        kinds = ", ".join(failing_kinds(comparison))
        lines.append(Text(f"FAIL: {plural(failing, 'failing finding')} ({kinds})", "bold red"))
    else:
        warnings = sum(1 for f in comparison.tensor_findings if not f.failing)
        warnings += sum(1 for f in comparison.findings if not f.failing)
        note = f" ({plural(warnings, 'warning')})" if warnings else ""
        lines.append(Text(f"OK: no failing findings{note}", style="bold green"))
    return lines


def render_comparison_table(comparison: Comparison, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    console.print(_dual_table(comparison))
    for line in _ratio_lines(comparison):
        console.print(line)
    parameters = comparison.parameters
    if parameters is None:
        console.print(Text("No tensor names shared by A and B: no per-parameter comparison."))
    else:
        k = f"{parameters.max_change:g}"
        console.print(
            Text(
                f"Per-parameter comparison, A → B: "
                f"{plural(len(parameters.changes), 'shared tensor')}, "
                f"{len(parameters.flagged)} outside [1/{k}, {k}] (--max-change)",
                style="bold",
            )
        )
        hidden = 0
        if parameters.changes:
            table, hidden = _parameter_table(parameters, options)
            console.print(table)
        for line in _parameter_lines(parameters, hidden):
            console.print(line)
    for line in _finding_lines(comparison, options) + _summary_lines(comparison):
        console.print(line)
    return buffer.getvalue()
