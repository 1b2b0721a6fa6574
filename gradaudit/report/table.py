"""``--format table``: a Rich table of tensors and a summary, for people.

Flagged tensors come first (failing before warnings, then tensors whose
findings are ignored), then the largest norms; ``--all`` shows every row and
``--quiet`` only the flagged rows and exceeded limits. Names are shown as
``Text`` (never parsed as Rich markup) after escaping control characters.
"""

from __future__ import annotations

import io

from rich.table import Table
from rich.text import Text

from gradaudit.checks import exit_code
from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, Role, Severity
from gradaudit.report.base import RenderOptions
from gradaudit.report.console import string_console
from gradaudit.report.text import count, number, plural, printable
from gradaudit.report.verdict import (
    ROLE_LABELS,
    audited_line,
    findings_by_tensor,
    flagged_line,
    reading_lines,
    verdict_line,
)
from gradaudit.results import FileResult, Finding, Report, TensorStats

_STATUS_ORDER = tuple(FindingKind)
_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.IGNORED: "dim"}
_VERDICT_STYLE = {
    ExitCode.OK: "bold green",
    ExitCode.FINDINGS: "bold red",
    ExitCode.INPUT_ERROR: "bold red",
}


def _status(stats: TensorStats, findings: list[Finding]) -> Text:
    if not findings:
        return Text("ok", style="green")
    text = Text()
    for finding in sorted(findings, key=lambda f: _STATUS_ORDER.index(f.kind)):
        if text:
            text.append(",")
        text.append(finding.kind.value, style=_SEVERITY_STYLE[finding.severity])
    if all(f.ignored for f in findings):
        text.append(" (ignored)", style="dim")
    return text


def _rank(report: Report, options: RenderOptions) -> tuple[list[TensorStats], int]:
    """Rows to show and how many were left out."""
    findings = findings_by_tensor(report)
    flagged_failing, flagged_warning, flagged_ignored, rest = [], [], [], []
    for stats in report.tensors:
        found = findings.get((stats.source, stats.name), [])
        if any(f.failing for f in found):
            flagged_failing.append(stats)
        elif any(f.severity is Severity.WARNING for f in found):
            flagged_warning.append(stats)
        elif found:
            flagged_ignored.append(stats)
        else:
            rest.append(stats)
    if options.quiet:
        return flagged_failing + flagged_warning, 0
    flagged = flagged_failing + flagged_warning + flagged_ignored
    rest.sort(key=lambda s: s.norm, reverse=True)
    if not options.show_all:
        shown_rest = rest[: options.top]
        return flagged + shown_rest, len(rest) - len(shown_rest)
    return flagged + rest, 0


def _tensor_table(report: Report, rows: list[TensorStats]) -> Table:
    findings = findings_by_tensor(report)
    several_files = len({t.source for t in report.tensors}) > 1
    # A gradient dump's table stays as it was; a role column appears once roles differ.
    roles = any(t.role is not Role.GRADIENT for t in report.tensors)
    table = Table(show_lines=False, header_style="bold")
    if several_files:
        table.add_column("file", overflow="fold")
    table.add_column("name", overflow="fold")
    if roles:
        table.add_column("role", no_wrap=True, min_width=6)
    table.add_column("shape", overflow="fold")
    table.add_column("dtype", no_wrap=True)
    for header in ("norm", "rms", "max|g|", "zero %", "NaN", "±Inf"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for stats in rows:
        found = findings.get((stats.source, stats.name), [])
        style = ""
        if any(f.failing for f in found):
            style = "red"
        elif any(f.severity is Severity.WARNING for f in found):
            style = "yellow"
        cells: list[Text | str] = []
        if several_files:
            cells.append(Text(printable(stats.source or "")))
        cells.append(Text(printable(stats.name), style=style))
        if roles:
            cells.append(ROLE_LABELS[stats.role])
        cells += [
            "×".join(str(d) for d in stats.shape) or "()",
            stats.dtype,
            number(stats.norm),
            number(stats.rms),
            number(stats.max_abs),
            f"{100.0 * stats.zero_fraction:.1f}",
            count(stats.nan),
            f"{count(stats.pos_inf)}/{count(stats.neg_inf)}",
            _status(stats, found),
        ]
        table.add_row(*cells)
    return table


def _estimates_table(report: Report, options: RenderOptions) -> Table | None:
    """Per-parameter gradient estimates read from optimizer state: flagged, then the largest."""
    if not report.estimates:
        return None
    flagged = {(f.source, f.tensor) for f in report.findings if not f.ignored}
    rows = sorted(
        report.estimates,
        key=lambda e: ((e.source, e.tensor) not in flagged, -(e.rms_norm or e.mean_norm or 0.0)),
    )
    if not options.show_all:
        keep = max(options.top, sum(1 for e in rows if (e.source, e.tensor) in flagged))
        rows = rows[:keep]
    table = Table(
        title=f"Gradients estimated from optimizer state ({len(rows)} of "
        f"{len(report.estimates)} parameters)",
        title_justify="left",
        show_lines=False,
        header_style="bold",
    )
    table.add_column("parameter", overflow="fold")
    table.add_column("grad rms norm", justify="right", no_wrap=True)
    table.add_column("grad mean norm", justify="right", no_wrap=True)
    table.add_column("read from", overflow="fold")
    for estimate in rows:
        style = "yellow" if (estimate.source, estimate.tensor) in flagged else ""
        table.add_row(
            Text(printable(estimate.parameter), style=style),
            number(estimate.rms_norm),
            number(estimate.mean_norm),
            estimate.basis,
        )
    return table


def _limit_lines(report: Report) -> list[Text]:
    return [Text(f"LIMIT: {printable(f.message)}", style="bold red") for f in report.limit_findings]


def _file_verdict(report: Report, result: FileResult) -> Text:
    """One word (and the reason) per input: error, FAIL, ok or nothing to audit."""
    if result.error is not None:
        return Text(f"error: {printable(result.error)}", style="bold red")
    found = [f for f in report.findings if f.source == result.path]
    failing = sorted({f.kind.value for f in found if f.failing})
    if failing:
        return Text(f"FAIL ({', '.join(failing)})", style="bold red")
    if not result.tensors:
        return Text("nothing to audit", style="yellow")
    warnings = sum(1 for f in found if not f.failing)
    return Text("ok" + (f" ({plural(warnings, 'warning')})" if warnings else ""), style="green")


def _files_table(report: Report) -> Table:
    """Per-input totals, shown when a run has several inputs."""
    excluded = any(f.excluded for f in report.files)
    table = Table(show_lines=False, header_style="bold")
    table.add_column("file", overflow="fold")
    for header in ("tensors", "skipped", *(("excluded",) if excluded else ()), "elements"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("global norm", justify="right", no_wrap=True)
    table.add_column("verdict", overflow="fold")
    for result in report.files:
        cells: list[Text | str] = [
            Text(printable(result.path)),
            count(result.tensors),
            count(result.skipped),
        ]
        if excluded:
            cells.append(count(result.excluded))
        cells += [
            count(result.elements),
            number(result.global_norm),
            _file_verdict(report, result),
        ]
        table.add_row(*cells)
    return table


def _summary_lines(report: Report, hidden: int) -> list[Text]:
    lines: list[Text] = []
    if hidden:
        lines.append(Text(f"… {plural(hidden, 'more tensor')} not shown (--all shows every row)"))
    lines.append(
        Text(
            f"{audited_line(report)} · device {report.device} · engine {report.engine} · "
            f"{report.elapsed_s:.2f} s"
        )
    )
    lines.append(Text(flagged_line(report)))
    lines += [Text(line) for line in reading_lines(report)]
    several = len(report.files) > 1
    for skipped in report.skipped[:10]:
        where = ""
        if several and skipped.source and not skipped.name.startswith(skipped.source):
            where = f" in {printable(skipped.source)}"
        lines.append(
            Text(f"skipped {printable(skipped.name)}{where}: {skipped.reason}", style="dim")
        )
    if len(report.skipped) > 10:
        lines.append(Text(f"… and {len(report.skipped) - 10} more skipped", style="dim"))
    lines += _limit_lines(report)
    for problem in report.errors:
        text = f"input error: {printable(problem.path)}: {printable(problem.message)}"
        lines.append(Text(text, style="bold red"))
    lines.append(Text(verdict_line(report), style=_VERDICT_STYLE[exit_code(report)]))
    return lines


def render_table(report: Report, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    rows, hidden = _rank(report, options)
    if rows:
        console.print(_tensor_table(report, rows))
    estimates = None if options.quiet else _estimates_table(report, options)
    if estimates is not None:
        console.print(estimates)
    if options.quiet:
        for line in _limit_lines(report):
            console.print(line)
    else:
        if len(report.files) > 1:
            console.print(_files_table(report))
        for line in _summary_lines(report, hidden):
            console.print(line)
    return buffer.getvalue()
