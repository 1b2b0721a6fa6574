"""``--format table``: a Rich table of tensors and a summary, for people.

Flagged tensors come first (failing before warnings), then the largest norms;
``--all`` shows every row. Names are shown as ``Text`` (never parsed as Rich
markup) after escaping control characters.
"""

from __future__ import annotations

import io

from rich.table import Table
from rich.text import Text

from gradaudit.checks import exit_code
from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, Severity
from gradaudit.report.base import RenderOptions
from gradaudit.report.console import string_console
from gradaudit.report.text import count, number, plural, printable
from gradaudit.results import Finding, Report, TensorStats

_STATUS_ORDER = (FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING, FindingKind.VANISHING)
_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow"}


def _status(stats: TensorStats, findings: list[Finding]) -> Text:
    if not findings:
        return Text("ok", style="green")
    text = Text()
    for finding in sorted(findings, key=lambda f: _STATUS_ORDER.index(f.kind)):
        if text:
            text.append(",")
        text.append(finding.kind.value, style=_SEVERITY_STYLE[finding.severity])
    return text


def _rank(report: Report, options: RenderOptions) -> tuple[list[TensorStats], int]:
    """Rows to show and how many were left out."""
    findings = _findings_by_tensor(report)
    flagged_failing, flagged_warning, rest = [], [], []
    for stats in report.tensors:
        found = findings.get((stats.source, stats.name), [])
        if any(f.failing for f in found):
            flagged_failing.append(stats)
        elif found:
            flagged_warning.append(stats)
        else:
            rest.append(stats)
    rest.sort(key=lambda s: s.norm, reverse=True)
    if not options.show_all:
        shown_rest = rest[: options.top]
        return flagged_failing + flagged_warning + shown_rest, len(rest) - len(shown_rest)
    return flagged_failing + flagged_warning + rest, 0


def _findings_by_tensor(report: Report) -> dict[tuple[str | None, str], list[Finding]]:
    by_tensor: dict[tuple[str | None, str], list[Finding]] = {}
    for finding in report.findings:
        by_tensor.setdefault((finding.source, finding.tensor), []).append(finding)
    return by_tensor


def _tensor_table(report: Report, options: RenderOptions) -> tuple[Table, int]:
    rows, hidden = _rank(report, options)
    findings = _findings_by_tensor(report)
    several_files = len({t.source for t in report.tensors}) > 1
    table = Table(show_lines=False, header_style="bold")
    if several_files:
        table.add_column("file", overflow="fold")
    table.add_column("name", overflow="fold")
    table.add_column("shape", overflow="fold")
    table.add_column("dtype", no_wrap=True)
    for header in ("norm", "rms", "max|g|", "zero %", "NaN", "±Inf"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for stats in rows:
        found = findings.get((stats.source, stats.name), [])
        style = None
        if any(f.failing for f in found):
            style = "red"
        elif found:
            style = "yellow"
        cells: list[Text | str] = []
        if several_files:
            cells.append(Text(printable(stats.source or "")))
        cells += [
            Text(printable(stats.name), style=style or ""),
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
    return table, hidden


def _summary_lines(report: Report, hidden: int) -> list[Text]:
    s = report.summary
    lines: list[Text] = []
    if hidden:
        lines.append(Text(f"… {plural(hidden, 'more tensor')} not shown (--all shows every row)"))
    files = len(report.files)
    where = f" in {plural(files, 'file')}" if files else ""
    lines.append(
        Text(
            f"Audited {plural(s.tensors, 'tensor')} ({count(s.elements)} elements){where}, "
            f"skipped {s.skipped} · global norm {number(s.global_norm)} · "
            f"device {report.device} · engine {report.engine} · {report.elapsed_s:.2f} s"
        )
    )
    lines.append(
        Text(
            f"Flagged tensors: NaN {s.nan_tensors} · Inf {s.inf_tensors} · "
            f"exploding {s.exploding_tensors} · vanishing {s.vanishing_tensors}"
            f"   (thresholds: vanishing < "
            f"{number(report.thresholds.vanishing)}, exploding > "
            f"{number(report.thresholds.exploding)})"
        )
    )
    for skipped in report.skipped[:10]:
        lines.append(Text(f"skipped {printable(skipped.name)}: {skipped.reason}", style="dim"))
    if len(report.skipped) > 10:
        lines.append(Text(f"… and {len(report.skipped) - 10} more skipped", style="dim"))
    code = exit_code(report)
    if code is ExitCode.INPUT_ERROR:
        what = (
            plural(len(report.errors), "input") + " could not be audited"
            if report.errors
            else ("nothing to audit: no floating-point tensor found")
        )
        lines.append(Text(f"INCOMPLETE: {what}", style="bold red"))
    elif code is ExitCode.FINDINGS:
        kinds = sorted({f.kind.value for f in report.findings if f.failing})
        lines.append(
            Text(
                f"FAIL: {plural(s.failing_findings, 'failing finding')} ({', '.join(kinds)})",
                style="bold red",
            )
        )
    else:
        note = f" ({plural(s.warnings, 'warning')})" if s.warnings else ""
        lines.append(Text(f"OK: no failing findings{note}", style="bold green"))
    return lines


def render_table(report: Report, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    if report.tensors:
        table, hidden = _tensor_table(report, options)
        console.print(table)
    else:
        hidden = 0
    for line in _summary_lines(report, hidden):
        console.print(line)
    return buffer.getvalue()
