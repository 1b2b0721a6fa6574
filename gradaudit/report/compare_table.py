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

from gradaudit.compare.checks import comparison_exit_code
from gradaudit.compare.model import Comparison, ParameterChange, ParameterComparison, SideStats
from gradaudit.errors import ExitCode
from gradaudit.policy import Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions, more_flagged
from gradaudit.report.compare_text import (
    ab_mode,
    change_order,
    change_text,
    compared_line,
    dtype_line,
    interpretation,
    merged_tensor_findings,
    mismatch_parts,
    notable,
    ratio_line,
    shape_mismatches,
    shape_text,
    short_formula,
    side_input,
    side_name,
    side_words,
    verdict_line,
)
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

_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.IGNORED: "dim"}
_VERDICT_STYLE = {
    ExitCode.OK: "bold green",
    ExitCode.FINDINGS: "bold red",
    ExitCode.INPUT_ERROR: "bold red",
}
#: Names listed per "only in A/B" or mismatch line, and findings listed, before "… N more".
_LIST_LIMIT = 10
_FINDING_LIMIT = 20


def _dual_table(comparison: Comparison, width: int) -> tuple[Table, Layout]:
    dual = comparison.dual
    sides = ((dual.host, "A"), (dual.seed, "B"))
    ab = ab_mode(comparison)

    def bad(side: SideStats, value: int) -> Text:
        return Text(count(value), style="red" if side.nonfinite and value else "")

    columns = [
        Column("side", [letter if ab else f"{side.label} ({letter})" for side, letter in sides]),
        # Where each side comes from: the end of the path, within a quarter of the width, so
        # that at 80 columns the per-parameter norm (what compare is about) still fits.
        Column(
            "input",
            [_input_cell(side, max(20, width // 4)) for side, _ in sides],
            priority=45,
        ),
        Column("tensors", [count(side.tensors) for side, _ in sides], "right", priority=20),
        Column("params", [count(side.params) for side, _ in sides], "right", priority=30),
        Column("norm", [number(side.norm) for side, _ in sides], "right"),
        Column(
            "norm/√params", [number(s.norm_per_sqrt_param) for s, _ in sides], "right", priority=40
        ),
        Column("NaN", [bad(side, side.nan) for side, _ in sides], "right", priority=60),
        Column("±Inf", [bad(side, side.inf) for side, _ in sides], "right", priority=50),
        Column("vanishing", [count(s.vanishing_tensors) for s, _ in sides], "right", priority=10),
        Column("exploding", [count(s.exploding_tensors) for s, _ in sides], "right", priority=15),
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
        Text(interpretation(dual, ab), style=style),
    ]


def _status(change: ParameterChange) -> Text:
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
    ordered = sorted(parameters.changes, key=change_order)
    if options.quiet:  # only the findings: the rows behind the large_change finding
        shown = [c for c in ordered if c.flagged]
        rest: list[ParameterChange] = []
    else:
        shown = [c for c in ordered if notable(c)]
        rest = [c for c in ordered if not notable(c)]
    shown_rest = rest if options.show_all else rest[: options.top]
    hidden_notable = 0 if options.show_all else max(0, len(shown) - MAX_FLAGGED_ROWS)
    if hidden_notable:
        shown = shown[:MAX_FLAGGED_ROWS]
    rows = shown + shown_rest
    columns = [
        Column(
            "name",
            [Text(printable(c.name), style="red" if c.flagged else "") for c in rows],
            kind="name",
        ),
        Column("shape", [shape_text(c.shape) for c in rows], priority=10),
    ]
    if any(c.dtype_a != c.dtype_b for c in rows):
        dtypes = [c.dtype_a if c.dtype_a == c.dtype_b else f"{c.dtype_a}→{c.dtype_b}" for c in rows]
        columns.append(Column("dtype", dtypes, priority=5))
    columns += [
        Column("norm A", [number(c.norm_a) for c in rows], "right", priority=20),
        Column("norm B", [number(c.norm_b) for c in rows], "right", priority=30),
        Column("B/A", [number(c.ratio) for c in rows], "right"),
        Column("change", [change_text(c) for c in rows], "right", priority=40),
        # "NaN/Inf in A and B" may wrap at its spaces rather than take cells from the name.
        Column("status", [_status(c) for c in rows], kind="prose", min_cells=12),
    ]
    table, layout = fitted_table(columns, sane_width(options.width))
    return table, layout, hidden_notable, len(rest) - len(shown_rest)


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
    return lines


def _finding_lines(comparison: Comparison, options: RenderOptions) -> list[Text]:
    tensor_findings = merged_tensor_findings(comparison)
    if options.quiet:
        tensor_findings = [(f, sides) for f, sides in tensor_findings if not f.ignored]
    limit = len(tensor_findings) if options.show_all or options.quiet else _FINDING_LIMIT
    lines = [
        Text(
            f"{f.severity.value}: {printable(f.tensor)} ({sides}): {f.kind.value}: {f.message}",
            style=_SEVERITY_STYLE[f.severity],
        )
        for f, sides in tensor_findings[:limit]
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
        Text(
            f"{f.severity.value}: {side_words(comparison, f.message)}",
            style=_SEVERITY_STYLE[f.severity],
        )
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
        side = f"{side_name(comparison, skipped.source)} " if skipped.source else ""
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
        table, _, hidden_flagged, _ = _parameter_table(parameters, options)
        out.append(table)
        if hidden_flagged:
            out.append(Text(more_flagged(hidden_flagged, "flagged shared tensor")))
    return out + _finding_lines(comparison, options)


def render_comparison_table(comparison: Comparison, options: RenderOptions) -> str:
    buffer = io.StringIO()
    console = string_console(buffer, options)
    if options.quiet:
        for renderable in _quiet(comparison, options):
            console.print(renderable)
        return buffer.getvalue()
    dual_table, dual_layout = _dual_table(comparison, sane_width(options.width))
    console.print(dual_table)
    if (note := dropped_note(dual_layout)) is not None:
        console.print(note)
    for line in _ratio_lines(comparison, sane_width(options.width)):
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
            table, layout, hidden_flagged, hidden = _parameter_table(parameters, options)
            console.print(table)
            if (note := dropped_note(layout)) is not None:
                console.print(note)
            if hidden_flagged:
                console.print(Text(more_flagged(hidden_flagged, "flagged shared tensor")))
        for line in _parameter_lines(parameters, hidden):
            console.print(line)
    for line in _finding_lines(comparison, options) + _summary_lines(comparison):
        console.print(line)
    return buffer.getvalue()
