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

from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, Role, Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions, more_flagged
from gradaudit.report.console import string_console
from gradaudit.report.fit import (
    Column,
    Layout,
    dropped_note,
    fitted_table,
    sane_width,
    shorten_path,
)
from gradaudit.report.text import count, number, plural, printable
from gradaudit.report.verdict import (
    ROLE_LABELS,
    audited_line,
    findings_by_tensor,
    flagged_line,
    reading_lines,
    skipped_lines,
    verdict_line,
)
from gradaudit.results import FileResult, Finding, Report, TensorStats
from gradaudit.scan.judge import exit_code

_STATUS_ORDER = tuple(FindingKind)
_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.IGNORED: "dim"}
#: A file column (several inputs) keeps the end of each path, in at most this many cells.
_FILE_CELLS = 28
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


def _rank(report: Report, options: RenderOptions) -> tuple[list[TensorStats], int, int]:
    """Rows to show, how many flagged rows were left out (past :data:`MAX_FLAGGED_ROWS`
    without ``--all``) and how many unflagged ones."""
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
        flagged = flagged_failing + flagged_warning
        if options.show_all:
            return flagged, 0, 0
        return flagged[:MAX_FLAGGED_ROWS], max(0, len(flagged) - MAX_FLAGGED_ROWS), 0
    flagged = flagged_failing + flagged_warning + flagged_ignored
    rest.sort(key=lambda s: s.norm, reverse=True)
    if not options.show_all:
        shown_rest = rest[: options.top]
        hidden_flagged = max(0, len(flagged) - MAX_FLAGGED_ROWS)
        return (
            flagged[:MAX_FLAGGED_ROWS] + shown_rest,
            hidden_flagged,
            len(rest) - len(shown_rest),
        )
    return flagged + rest, 0, 0


def _tensor_table(report: Report, rows: list[TensorStats], width: int) -> tuple[Table, Layout]:
    """The tensor rows, fitted to ``width``: low-value columns go before a name is cut."""
    findings = findings_by_tensor(report)
    several_files = len({t.source for t in report.tensors}) > 1
    # A gradient dump's table stays as it was; a role column appears once roles differ.
    roles = any(t.role is not Role.GRADIENT for t in report.tensors)
    names: list[Text | str] = []
    statuses: list[Text | str] = []
    for stats in rows:
        found = findings.get((stats.source, stats.name), [])
        style = ""
        if any(f.failing for f in found):
            style = "red"
        elif any(f.severity is Severity.WARNING for f in found):
            style = "yellow"
        names.append(Text(printable(stats.name), style=style))
        statuses.append(_status(stats, found))
    columns: list[Column] = []
    if several_files:
        files = [shorten_path(printable(s.source or ""), _FILE_CELLS) for s in rows]
        columns.append(Column("file", files, priority=75))
    columns += [
        Column("name", names, kind="name"),
        *([Column("role", [ROLE_LABELS[s.role] for s in rows], priority=72)] if roles else []),
        Column("shape", ["×".join(str(d) for d in s.shape) or "()" for s in rows], priority=40),
        Column("dtype", [s.dtype for s in rows], priority=50),
        Column("norm", [number(s.norm) for s in rows], justify="right"),
        Column("rms", [number(s.rms) for s in rows], justify="right", priority=10),
        Column("max|g|", [number(s.max_abs) for s in rows], justify="right", priority=30),
        Column("zero %", [f"{100.0 * s.zero_fraction:.1f}" for s in rows], "right", priority=20),
        Column("NaN", [count(s.nan) for s in rows], justify="right", priority=70),
        Column(
            "±Inf", [f"{count(s.pos_inf)}/{count(s.neg_inf)}" for s in rows], "right", priority=60
        ),
        Column("status", statuses),
    ]
    return fitted_table(columns, width)


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
    names = [
        Text(
            printable(e.parameter),
            style="yellow" if (e.source, e.tensor) in flagged else "",
        )
        for e in rows
    ]
    columns = [
        Column("parameter", names, kind="name"),
        Column("grad rms norm", [number(e.rms_norm) for e in rows], justify="right"),
        Column("grad mean norm", [number(e.mean_norm) for e in rows], "right", priority=30),
        Column("read from", [e.basis for e in rows], kind="prose", priority=20),
    ]
    title = (
        f"Gradients estimated from optimizer state ({len(rows)} of "
        f"{len(report.estimates)} parameters)"
    )
    return fitted_table(columns, sane_width(options.width), title=title)[0]


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


def _files_table(report: Report, width: int) -> Table:
    """Per-input totals, shown when a run has several inputs."""
    excluded = any(f.excluded for f in report.files)
    files = report.files
    columns = [
        Column("file", [Text(printable(r.path)) for r in files], kind="name"),
        Column("tensors", [count(r.tensors) for r in files], "right"),
        Column("skipped", [count(r.skipped) for r in files], "right", priority=20),
    ]
    if excluded:
        columns.append(Column("excluded", [count(r.excluded) for r in files], "right", priority=10))
    columns += [
        Column("elements", [count(r.elements) for r in files], "right", priority=30),
        Column("global norm", [number(r.global_norm) for r in files], "right", priority=40),
        Column("verdict", [_file_verdict(report, r) for r in files], kind="prose"),
    ]
    return fitted_table(columns, width)[0]


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
    # Unread floating-point data first and not dimmed: it is a finding (kind skipped).
    lines += [
        Text(line, style="yellow" if unaudited else "dim")
        for line, unaudited in skipped_lines(report)
    ]
    lines += _limit_lines(report)
    for problem in report.errors:
        text = f"input error: {printable(problem.path)}: {printable(problem.message)}"
        lines.append(Text(text, style="bold red"))
    lines.append(Text(verdict_line(report), style=_VERDICT_STYLE[exit_code(report)]))
    return lines


def render_table(report: Report, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    rows, hidden_flagged, hidden = _rank(report, options)
    if rows:
        table, layout = _tensor_table(report, rows, sane_width(options.width))
        console.print(table)
        if (note := dropped_note(layout)) is not None:
            console.print(note)
    if hidden_flagged:
        console.print(Text(more_flagged(hidden_flagged), style="bold"))
    estimates = None if options.quiet else _estimates_table(report, options)
    if estimates is not None:
        console.print(estimates)
    if options.quiet:
        for line in _limit_lines(report):
            console.print(line)
    elif not report.tensors and report.errors:
        # Nothing was audited: the errors are on stderr; a summary of nothing (a global
        # norm of 0, zero flagged tensors) would only read like a result.
        console.print(Text(verdict_line(report), style=_VERDICT_STYLE[exit_code(report)]))
    else:
        if len(report.files) > 1:
            console.print(_files_table(report, sane_width(options.width)))
        for line in _summary_lines(report, hidden):
            console.print(line)
    return buffer.getvalue()
