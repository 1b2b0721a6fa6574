"""``gradaudit compare --format table``: dual stats, the interpretation, A vs B per parameter.

Sections, top to bottom: a two-row table (host, seed) with norms, parameter
counts and NaN/Inf/vanishing/exploding counts; the raw and normalized ratios and
one sentence saying what they mean; the per-parameter table when the sides share
names (flagged rows first, then the largest changes; ``--all`` shows every row),
the names only in A or only in B and the mismatches; the findings; the verdict.
``--quiet`` keeps only the flagged rows and the findings. Names are ``Text``
after :func:`printable`, never Rich markup.
"""

from __future__ import annotations

import io

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
    change_text,
    compared_line,
    interpretation,
    mismatch_parts,
    notable,
    ratio_line,
    shape_text,
    side_input,
    tensor_findings_by_severity,
    verdict_line,
)
from gradaudit.report.console import string_console
from gradaudit.report.text import count, number, plural, printable

_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.IGNORED: "dim"}
_VERDICT_STYLE = {
    ExitCode.OK: "bold green",
    ExitCode.FINDINGS: "bold red",
    ExitCode.INPUT_ERROR: "bold red",
}
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
        Text(f"{ratio_line(dual)}   (= {SHORT_FORMULA})"),
        Text(interpretation(dual), style=style),
    ]


def _status(change: ParameterChange) -> Text:
    if change.note is not None:
        return Text(change.note, style="yellow")
    if change.flagged:
        return Text("changed", style="bold red")
    return Text("ok", style="green")


def _parameter_table(parameters: ParameterComparison, options: RenderOptions) -> tuple[Table, int]:
    ordered = sorted(parameters.changes, key=change_order)
    if options.quiet:  # only the findings: the rows behind the large_change finding
        shown = [c for c in ordered if c.flagged]
        rest: list[ParameterChange] = []
    else:
        shown = [c for c in ordered if notable(c)]
        rest = [c for c in ordered if not notable(c)]
    shown_rest = rest if options.show_all else rest[: options.top]
    table = Table(header_style="bold")
    table.add_column("name", overflow="fold")
    table.add_column("shape", overflow="fold")
    for header in ("norm A", "norm B", "B/A", "change"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for change in shown + shown_rest:
        table.add_row(
            Text(printable(change.name), style="red" if change.flagged else ""),
            shape_text(change.shape),
            number(change.norm_a),
            number(change.norm_b),
            number(change.ratio),
            change_text(change),
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
        parts = "; ".join(mismatch_parts(mismatch))
        lines.append(Text(f"mismatch {printable(mismatch.name)}: {parts}", "yellow"))
    if len(parameters.mismatches) > _LIST_LIMIT:
        lines.append(Text(f"… and {len(parameters.mismatches) - _LIST_LIMIT} more mismatches"))
    return lines


def _finding_lines(comparison: Comparison, options: RenderOptions) -> list[Text]:
    tensor_findings = tensor_findings_by_severity(comparison)
    if options.quiet:
        tensor_findings = [f for f in tensor_findings if not f.ignored]
    limit = len(tensor_findings) if options.show_all or options.quiet else _FINDING_LIMIT
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
        Text(f"LIMIT: {printable(f.message)}", style="bold red")
        for f in comparison.report.limit_findings
    ]
    lines += [
        Text(f"{f.severity.value}: {f.message}", style=_SEVERITY_STYLE[f.severity])
        for f in comparison.findings
    ]
    return lines


def _summary_lines(comparison: Comparison) -> list[Text]:
    report = comparison.report
    lines = [
        Text(
            f"{compared_line(comparison)} · device {report.device} · "
            f"engine {report.engine} · {report.elapsed_s:.2f} s"
        )
    ]
    for skipped in report.skipped[:_LIST_LIMIT]:
        side = f"{skipped.source} " if skipped.source else ""
        lines.append(Text(f"skipped {side}{printable(skipped.name)}: {skipped.reason}", "dim"))
    if len(report.skipped) > _LIST_LIMIT:
        lines.append(Text(f"… and {len(report.skipped) - _LIST_LIMIT} more skipped", "dim"))
    code = comparison_exit_code(comparison)
    lines.append(Text(verdict_line(comparison), style=_VERDICT_STYLE[code]))
    return lines


def _quiet(comparison: Comparison, options: RenderOptions) -> list[Table | Text]:
    """Only what is wrong: flagged shared tensors, then every finding; nothing when healthy."""
    out: list[Table | Text] = []
    parameters = comparison.parameters
    if parameters is not None and parameters.flagged:
        out.append(_parameter_table(parameters, options)[0])
    return out + _finding_lines(comparison, options)


def render_comparison_table(comparison: Comparison, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    if options.quiet:
        for renderable in _quiet(comparison, options):
            console.print(renderable)
        return buffer.getvalue()
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
