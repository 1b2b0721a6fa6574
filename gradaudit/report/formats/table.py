"""``--format table``: Rich tables and summary lines, for people; scan, compare and trend.

* A scan: flagged tensors first (failing before warnings, then tensors whose
  findings are ignored), then the largest norms; ``--all`` shows every row and
  ``--quiet`` only the flagged rows and exceeded limits.
* A comparison: a two-row table (host, seed) with norms, parameter counts and
  NaN/Inf/vanishing/exploding counts; the raw and normalized ratios and one
  sentence saying what they mean; the per-parameter table when the sides share
  names (flagged rows first, then the largest changes), the names only in A or
  only in B and the mismatches; the findings; the verdict. ``--quiet`` keeps
  only the flagged rows and the findings.
* A trend: one sparkline per layer over the steps, the global norm per step
  (first, last and flagged steps without ``--all``), the findings, the verdict.
  ``--quiet`` keeps one line per finding.

Every table is fitted to the width by :mod:`gradaudit.report.fit`; numbers that
both the table and Markdown show come from :mod:`gradaudit.report.columns`.
Names are shown as ``Text`` (never parsed as Rich markup) after escaping
control characters. Each table or line is yielded as soon as it is rendered.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from operator import attrgetter
from pathlib import Path
from typing import TypeVar

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from gradaudit.policy import FindingKind, Role, Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, Renderers, RenderOptions, more_flagged
from gradaudit.report.columns import (
    CHANGE_NUMBERS,
    CHANGE_SHAPE,
    SIDE_FIELDS,
    TENSOR_DTYPE,
    TENSOR_INF,
    TENSOR_MAX_ABS,
    TENSOR_NAN,
    TENSOR_NORM,
    TENSOR_RMS,
    TENSOR_SHAPE,
    TENSOR_ZERO,
    Field,
)
from gradaudit.report.compare_text import (
    FLAGGED,
    NOTABLE,
    REST,
    ab_mode,
    compared,
    compared_line,
    dtype_line,
    identity_line,
    interpretation,
    merged_tensor_findings,
    mismatch_parts,
    ordered_changes,
    ratio_line,
    shape_mismatches,
    short_formula,
    side_input,
    side_name,
    side_words,
)
from gradaudit.report.compare_text import verdict_line as compare_verdict_line
from gradaudit.report.console import printed
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
from gradaudit.report.styles import ROW_STYLE, SEVERITY_STYLE, VERDICT_STYLE
from gradaudit.report.text import count, layer_label, number, plural, printable
from gradaudit.report.trend_text import (
    audited,
    ends,
    finding_severity,
    findings_line,
    layer_flags,
    spark_cells,
    sparkline,
    trend_line,
)
from gradaudit.report.trend_text import verdict_line as trend_verdict_line
from gradaudit.report.verdict import (
    ROLE_LABELS,
    audited_line,
    file_findings,
    findings_by_tensor,
    flagged_line,
    history_lines,
    reading_lines,
    several_files,
    skipped_lines,
    tensor_severities,
    verdict_line,
)
from gradaudit.results import FileResult, Finding, Report, TensorStats
from gradaudit.results.comparison import Comparison, ParameterChange, ParameterComparison, SideStats
from gradaudit.results.stats_table import ROLES, StatsTable
from gradaudit.results.trend import TrendFinding, TrendReport
from gradaudit.results.verdict import comparison_exit_code, exit_code, trend_exit_code

Row = TypeVar("Row")

_STATUS_ORDER = tuple(FindingKind)
#: A file column (several inputs) keeps the end of each path, in at most this many cells.
_FILE_CELLS = 28
#: The tensor table's numbers, from the definitions Markdown shares.
TABLE_TENSOR_FIELDS = (
    TENSOR_SHAPE,
    TENSOR_DTYPE,
    TENSOR_NORM,
    TENSOR_RMS,
    TENSOR_MAX_ABS,
    TENSOR_ZERO,
    TENSOR_NAN,
    TENSOR_INF,
)
#: Names listed per "only in A/B" or mismatch line, and findings listed, before "… N more".
_LIST_LIMIT = 10
_FINDING_LIMIT = 20
#: Cells of the steps table besides its findings: step, global norm, NaN/Inf, borders.
_STEP_COLUMNS_CELLS = 4 + 11 + 7 + 3 * 4 + 1
#: Steps listed one by one in the trend table without ``--all``.
MAX_STEP_ROWS = 24


def field_column(field: Field[Row], rows: Sequence[Row]) -> Column:
    """A shared column definition as a fitted-table column over ``rows``."""
    cells: list[Text | str]
    if field.style is None:
        cells = [field.text(row) for row in rows]
    else:
        style = field.style
        cells = [Text(field.text(row), style=style(row)) for row in rows]
    return Column(field.header, cells, field.justify, priority=field.priority)


# ---------------------------------------------------------------------------- scan


def _tensor_status(stats: TensorStats, findings: list[Finding]) -> Text:
    if not findings:
        return Text("ok", style="green")
    text = Text()
    for finding in sorted(findings, key=lambda f: _STATUS_ORDER.index(f.kind)):
        if text:
            text.append(",")
        text.append(finding.kind.value, style=SEVERITY_STYLE[finding.severity])
    if all(f.ignored for f in findings):
        text.append(" (ignored)", style="dim")
    return text


_IGNORED = frozenset({Severity.IGNORED})


def _tensor_rows(report: Report, options: RenderOptions) -> tuple[list[TensorStats], int, int]:
    """Rows to show, how many flagged rows were left out (past :data:`MAX_FLAGGED_ROWS`
    without ``--all``) and how many unflagged ones."""
    flagged_failing: list[TensorStats] = []
    flagged_warning: list[TensorStats] = []
    flagged_ignored: list[TensorStats] = []
    unflagged = flagged_count = 0

    def sort_out() -> Iterator[TensorStats]:
        """Files the flagged tensors; yields the others (counted), none of them kept here:
        a million healthy tensors must not all be held to show the top few."""
        nonlocal unflagged, flagged_count
        # Without --all at most MAX_FLAGGED_ROWS are shown: each kind keeps that many.
        keep = len(report.tensors) if options.show_all else MAX_FLAGGED_ROWS
        for stats, severities in tensor_severities(report):
            if not severities:
                unflagged += 1
                yield stats
                continue
            if options.quiet and severities == _IGNORED:
                continue
            flagged_count += 1
            if Severity.ERROR in severities:
                kind = flagged_failing
            elif Severity.WARNING in severities:
                kind = flagged_warning
            else:
                kind = flagged_ignored
            if len(kind) < keep:
                kind.append(stats)

    if options.quiet:
        deque(sort_out(), maxlen=0)
        flagged = flagged_failing + flagged_warning
        if options.show_all:
            return flagged, 0, 0
        return flagged[:MAX_FLAGGED_ROWS], max(0, flagged_count - MAX_FLAGGED_ROWS), 0
    by_norm = attrgetter("norm")
    if not options.show_all:
        # nlargest is sorted(..., reverse=True)[:top], ties in tensor order included.
        shown_rest = heapq.nlargest(options.top, sort_out(), key=by_norm)
        flagged = flagged_failing + flagged_warning + flagged_ignored
        hidden_flagged = max(0, flagged_count - MAX_FLAGGED_ROWS)
        return (
            flagged[:MAX_FLAGGED_ROWS] + shown_rest,
            hidden_flagged,
            unflagged - len(shown_rest),
        )
    rest = sorted(sort_out(), key=by_norm, reverse=True)
    return flagged_failing + flagged_warning + flagged_ignored + rest, 0, 0


def _tensor_table(report: Report, rows: list[TensorStats], width: int) -> tuple[Table, Layout]:
    """The tensor rows, fitted to ``width``: low-value columns go before a name is cut."""
    findings = findings_by_tensor(report, only={(s.source, s.name) for s in rows})

    tensors = report.tensors
    # A gradient dump's table stays as it was; a role column appears once roles differ.
    if isinstance(tensors, StatsTable):  # a million tensors: read on the columns
        roles = bool((tensors.role_codes != ROLES.index(Role.GRADIENT)).any())
    else:
        roles = any(t.role is not Role.GRADIENT for t in tensors)
    names: list[Text | str] = []
    statuses: list[Text | str] = []
    for stats in rows:
        found = findings.get((stats.source, stats.name), [])
        style = ""
        if any(f.failing for f in found):
            style = ROW_STYLE[Severity.ERROR]
        elif any(f.severity is Severity.WARNING for f in found):
            style = ROW_STYLE[Severity.WARNING]
        names.append(Text(printable(stats.name), style=style))
        statuses.append(_tensor_status(stats, found))
    columns: list[Column] = []
    if several_files(report):
        files = [shorten_path(printable(s.source or ""), _FILE_CELLS) for s in rows]
        columns.append(Column("file", files, priority=75))
    columns += [
        Column("name", names, kind="name"),
        *([Column("role", [ROLE_LABELS[s.role] for s in rows], priority=72)] if roles else []),
        *(field_column(f, rows) for f in TABLE_TENSOR_FIELDS),
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


_HISTORY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.IGNORED: "dim"}


def _history_lines(report: Report) -> list[Text]:
    return [
        Text(line, style="" if severity is None else _HISTORY_STYLE[severity])
        for line, severity in history_lines(report)
    ]


def _limit_lines(report: Report) -> list[Text]:
    return [Text(f"LIMIT: {printable(f.message)}", style="bold red") for f in report.limit_findings]


def _file_verdict(report: Report, result: FileResult) -> Text:
    """One word (and the reason) per input: error, FAIL, ok or nothing to audit."""
    if result.error is not None:
        return Text(f"error: {printable(result.error)}", style="bold red")
    failing, warnings = file_findings(report, result.path)
    if failing:
        return Text(f"FAIL ({', '.join(failing)})", style="bold red")
    if not result.tensors and result.path not in {h.file for h in report.histories}:
        return Text("nothing to audit", style="yellow")
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


def _scan_summary(report: Report, hidden: int) -> list[Text]:
    lines: list[Text] = []
    if hidden:
        lines.append(Text(f"… {plural(hidden, 'more tensor')} not shown (--all shows every row)"))
    if not report.audited_nothing:  # "0 tensors … health 0.000" would read like a result
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
    lines += _history_lines(report)
    lines += _limit_lines(report)
    for problem in report.errors:
        text = f"input error: {printable(problem.path)}: {printable(problem.message)}"
        lines.append(Text(text, style="bold red"))
    lines.append(Text(verdict_line(report), style=VERDICT_STYLE[exit_code(report)]))
    return lines


def _scan_renderables(report: Report, options: RenderOptions) -> Iterator[RenderableType]:
    rows, hidden_flagged, hidden = _tensor_rows(report, options)
    if rows:
        table, layout = _tensor_table(report, rows, sane_width(options.width))
        yield table
        if (note := dropped_note(layout)) is not None:
            yield note
    if hidden_flagged:
        yield Text(more_flagged(hidden_flagged), style="bold")
    estimates = None if options.quiet else _estimates_table(report, options)
    if estimates is not None:
        yield estimates
    if options.quiet:
        yield from _limit_lines(report)
    elif not report.tensors and report.errors:
        # Nothing was audited: the errors are on stderr; a summary of nothing (a global
        # norm of 0, zero flagged tensors) would only read like a result.
        yield Text(verdict_line(report), style=VERDICT_STYLE[exit_code(report)])
    else:
        if len(report.files) > 1:
            yield _files_table(report, sane_width(options.width))
        yield from _scan_summary(report, hidden)


def render_scan(report: Report, options: RenderOptions) -> Iterator[str]:
    """Flagged tensors first, then the largest norms; per-input totals; the summary."""
    return printed(_scan_renderables(report, options), options)


# ---------------------------------------------------------------------------- compare


def _dual_table(comparison: Comparison, width: int) -> tuple[Table, Layout]:
    dual = comparison.dual
    sides = ((dual.host, "A"), (dual.seed, "B"))
    ab = ab_mode(comparison)

    columns = [
        Column("side", [letter if ab else f"{side.label} ({letter})" for side, letter in sides]),
        # Where each side comes from: the end of the path, within a quarter of the width, so
        # that at 80 columns the per-parameter norm (what compare is about) still fits.
        Column(
            "input",
            [_input_cell(side, max(20, width // 4)) for side, _ in sides],
            priority=45,
        ),
        *(field_column(f, [side for side, _ in sides]) for f in SIDE_FIELDS),
    ]
    return fitted_table(columns, width)


def _input_cell(side: SideStats, cells: int) -> str:
    """The side's file, shortened from the left, and its ``[prefix*]`` kept whole."""
    where = printable(side_input(side))
    if side.prefix is None or len(where) <= cells:
        return shorten_path(where, cells)
    tag = f" [{printable(side.prefix)}*]"
    path = where[: len(where) - len(tag)]
    return shorten_path(path, max(8, cells - len(tag))) + tag


def _ratio_lines(comparison: Comparison, width: int) -> list[Text]:
    dual = comparison.dual
    style = "bold red" if dual.normalized_ratio is None else "bold"
    ab = ab_mode(comparison)
    line = f"{ratio_line(dual, ab)}   (= {short_formula(ab)})"
    return [
        Text(line if len(line) <= width else ratio_line(dual, ab)),
        Text(interpretation(dual, ab, compared(comparison)), style=style),
    ]


def _change_status(change: ParameterChange) -> Text:
    if change.note is not None:
        return Text(change.note, style="yellow")
    if change.flagged:
        return Text("changed", style="bold red")
    return Text("ok", style="green")


def _parameter_table(
    parameters: ParameterComparison, options: RenderOptions
) -> tuple[Table, Layout, int, int]:
    """The shared tensors' rows; also how many flagged rows (past :data:`MAX_FLAGGED_ROWS`)
    and how many unflagged rows (past ``--top``) were left out."""
    # quiet: only the findings, the rows behind the large_change finding
    limit = None if options.show_all else MAX_FLAGGED_ROWS
    shown, notables = ordered_changes(parameters, FLAGGED if options.quiet else NOTABLE, limit)
    shown_rest: list[ParameterChange] = []
    rest = 0
    if not options.quiet:
        shown_rest, rest = ordered_changes(
            parameters, REST, None if options.show_all else options.top
        )
    hidden_notable = notables - len(shown)
    rows = shown + shown_rest
    columns = [
        Column(
            "name",
            [
                Text(printable(c.name), style=ROW_STYLE[Severity.ERROR] if c.flagged else "")
                for c in rows
            ],
            kind="name",
        ),
        field_column(CHANGE_SHAPE, rows),
    ]
    if any(c.dtype_a != c.dtype_b for c in rows):
        dtypes = [c.dtype_a if c.dtype_a == c.dtype_b else f"{c.dtype_a}→{c.dtype_b}" for c in rows]
        columns.append(Column("dtype", dtypes, priority=5))
    columns += [
        *(field_column(f, rows) for f in CHANGE_NUMBERS),
        # "NaN/Inf in A and B" may wrap at its spaces rather than take cells from the name.
        Column("status", [_change_status(c) for c in rows], kind="prose", min_cells=12),
    ]
    table, layout = fitted_table(columns, sane_width(options.width))
    return table, layout, hidden_notable, rest - len(shown_rest)


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
    mismatches = shape_mismatches(parameters)
    for mismatch in mismatches[:_LIST_LIMIT]:
        parts = "; ".join(mismatch_parts(mismatch))
        lines.append(Text(f"mismatch {printable(mismatch.name)}: {parts}", "yellow"))
    if len(mismatches) > _LIST_LIMIT:
        lines.append(Text(f"… and {len(mismatches) - _LIST_LIMIT} more mismatches"))
    if (dtypes := dtype_line(parameters)) is not None:
        lines.append(Text(dtypes))
    lines.append(Text(identity_line(parameters)))
    return lines


def _finding_lines(comparison: Comparison, options: RenderOptions) -> list[Text]:
    severities = (Severity.ERROR, Severity.WARNING) if options.quiet else tuple(Severity)
    limit = None if options.show_all or options.quiet else _FINDING_LIMIT
    tensor_findings, total = merged_tensor_findings(comparison, severities, limit)
    lines = [
        Text(
            f"{f.severity.value}: {printable(f.tensor)} ({sides}): {f.kind.value}: "
            f"{printable(f.message)}",
            style=SEVERITY_STYLE[f.severity],
        )
        for f, sides in tensor_findings
    ]
    if total > len(tensor_findings):
        lines.append(
            Text(f"… {plural(total - len(tensor_findings), 'more tensor finding')} (--all)")
        )
    lines += [
        Text(f"LIMIT: {printable(f.message)}", style="bold red")
        for f in comparison.report.limit_findings
    ]
    lines += [
        Text(
            f"{f.severity.value}: {printable(side_words(comparison, f.message))}",
            style=SEVERITY_STYLE[f.severity],
        )
        for f in comparison.findings
    ]
    return lines


def _compare_summary(comparison: Comparison) -> list[Text]:
    report = comparison.report
    lines = [
        Text(
            f"{compared_line(comparison)} · device {report.device} · "
            f"engine {report.engine} · {report.elapsed_s:.2f} s"
        )
    ]
    for skipped in report.skipped[:_LIST_LIMIT]:
        side = f"{side_name(comparison, skipped.source)} " if skipped.source else ""
        lines.append(
            Text(f"skipped {side}{printable(skipped.name)}: {printable(skipped.reason)}", "dim")
        )
    if len(report.skipped) > _LIST_LIMIT:
        lines.append(Text(f"… and {len(report.skipped) - _LIST_LIMIT} more skipped", "dim"))
    code = comparison_exit_code(comparison)
    lines.append(Text(compare_verdict_line(comparison), style=VERDICT_STYLE[code]))
    return lines


def _compare_quiet(comparison: Comparison, options: RenderOptions) -> list[Table | Text]:
    """Only what is wrong: flagged shared tensors, then every finding; nothing when healthy."""
    out: list[Table | Text] = []
    parameters = comparison.parameters
    if parameters is not None and parameters.flagged:
        table, _, hidden_flagged, _ = _parameter_table(parameters, options)
        out.append(table)
        if hidden_flagged:
            out.append(Text(more_flagged(hidden_flagged, "flagged shared tensor")))
    return out + _finding_lines(comparison, options)


def _compare_renderables(
    comparison: Comparison, options: RenderOptions
) -> Iterator[RenderableType]:
    if options.quiet:
        yield from _compare_quiet(comparison, options)
        return
    dual_table, dual_layout = _dual_table(comparison, sane_width(options.width))
    yield dual_table
    if (note := dropped_note(dual_layout)) is not None:
        yield note
    yield from _ratio_lines(comparison, sane_width(options.width))
    parameters = comparison.parameters
    if parameters is None:
        yield Text("No tensor names shared by A and B: no per-parameter comparison.")
    else:
        k = f"{parameters.max_change:g}"
        yield Text(
            f"Per-parameter comparison, A → B: "
            f"{plural(len(parameters.changes), 'shared tensor')}, "
            f"{len(parameters.flagged)} outside [1/{k}, {k}] (--max-change)",
            style="bold",
        )
        hidden = 0
        if parameters.changes:
            table, layout, hidden_flagged, hidden = _parameter_table(parameters, options)
            yield table
            if (note := dropped_note(layout)) is not None:
                yield note
            if hidden_flagged:
                yield Text(more_flagged(hidden_flagged, "flagged shared tensor"))
        yield from _parameter_lines(parameters, hidden)
    yield from _finding_lines(comparison, options) + _compare_summary(comparison)


def render_compare(comparison: Comparison, options: RenderOptions) -> Iterator[str]:
    """Dual stats, the ratio and what it means, A vs B per parameter, findings, verdict."""
    return printed(_compare_renderables(comparison, options), options)


# ---------------------------------------------------------------------------- trend


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
    layer_ends = [ends(global_norms)]
    flags: list[Text | str] = [""]
    for layer in report.layers:
        severity = finding_severity(report, layer.name)
        style = "" if severity is None else ROW_STYLE[severity]
        names.append(Text(printable(layer.name), style=style))
        sparks.append(Text(sparkline(layer.norms, layer.nonfinite, cells), style=style))
        layer_ends.append(ends(layer.norms))
        flags.append(Text(layer_flags(layer), style=style))
    columns = [
        Column("layer", names, kind="name"),
        Column("norm by step", sparks),
        Column("first", [number(e[0]) for e in layer_ends], "right", priority=10),
        Column("last", [number(e[1]) for e in layer_ends], "right", priority=20),
        Column("max", [number(e[2]) for e in layer_ends], "right", priority=30),
        Column("findings", flags, kind="prose"),
    ]
    what = report.subject.capitalize()
    title = f"{what} norm per layer over {plural(steps, 'step')} ({first} … {last})"
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
            text.append(kind + label, style=SEVERITY_STYLE[finding.severity])
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


def _trend_summary(report: TrendReport, hidden_steps: int) -> list[Text]:
    lines: list[Text] = []
    if hidden_steps:
        lines.append(
            Text(f"… {plural(hidden_steps, 'more step')} not shown (--all shows every step)")
        )
    lines.append(Text(trend_line(report)))
    lines.append(Text(findings_line(report)))
    lines += [_trend_finding(finding) for finding in report.findings]
    verdict = trend_verdict_line(report)
    lines.append(Text(verdict, style=VERDICT_STYLE[trend_exit_code(report)]))
    return lines


def _trend_finding(finding: TrendFinding) -> Text:
    """``spike in encoder.layer.3: norm 12.5 at step 30 is 40× its running median …``."""
    line = Text(f"{finding.kind.value}", style=SEVERITY_STYLE[finding.severity])
    line.append(f" in {layer_label(finding.layer)}: {printable(finding.message)}")
    return line


def _trend_renderables(report: TrendReport, options: RenderOptions) -> Iterator[RenderableType]:
    if options.quiet:
        # Only what is wrong: one line per finding; nothing when healthy.
        yield from (_trend_finding(finding) for finding in report.findings)
        return
    hidden = 0
    if report.layers:
        table, layout = _layers_table(report, options)
        yield table
        if (note := dropped_note(layout)) is not None:
            yield note
    if report.steps:
        table, layout, hidden = _steps_table(report, options)
        yield table
        if (note := dropped_note(layout)) is not None:
            yield note
    lines = _trend_summary(report, hidden)
    if report.errors and not audited(report):
        lines = lines[-1:]  # nothing audited: the errors are on stderr, the verdict says so
    yield from lines


def render_trend(report: TrendReport, options: RenderOptions) -> Iterator[str]:
    """Per-layer sparklines, the global norm per step, the findings and the verdict."""
    return printed(_trend_renderables(report, options), options)


RENDERERS = Renderers(scan=render_scan, compare=render_compare, trend=render_trend)
