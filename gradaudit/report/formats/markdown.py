"""``--format markdown``: the verdict, what is wrong, and tables of the flagged rows.

Written for ``$GITHUB_STEP_SUMMARY`` and pull-request comments (GitHub
Flavored Markdown).

* A scan: a verdict heading, what was audited, input problems and exceeded
  limits, a table of flagged tensors, with ``--precision`` the headroom table
  (the table format's rows and numbers, :mod:`gradaudit.report.precision_table`)
  and its findings, the policy.
* A comparison: a verdict heading; the normalized ratio with its
  interpretation; a two-row table of the sides; the findings as a list (input
  problems, exceeded limits, the comparison's own findings and per-tensor
  findings, failing first); the shared tensors that are flagged or could not be
  compared; the names only in A or B and the mismatches; what was compared and
  the policy.
* A trend: a verdict heading, what was audited, the findings (failing first),
  a table of the flagged layers with their sparklines, the policy.

``--quiet`` keeps only the findings and the flagged rows. Tensor names and
paths come from files written by strangers: they are shown in code spans with
``|`` escaped (GFM splits table cells on it even inside code) and control
characters escaped, so a name cannot break the table or inject markup. Tables
and lists are capped at :data:`MAX_FLAGGED_ROWS` rows (a PR comment holds
65,536 characters) unless ``--all`` is given. The numbers a table shares with
``--format table`` come from :mod:`gradaudit.report.columns`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

from gradaudit.errors import ExitCode
from gradaudit.policy import ALWAYS_FAILING, FindingKind, LimitKind, Severity
from gradaudit.precision.judging import PrecisionFinding, PrecisionReport
from gradaudit.report.base import MAX_FLAGGED_ROWS, Renderers, RenderOptions, more_flagged
from gradaudit.report.columns import (
    CHANGE_NUMBERS,
    CHANGE_SHAPE,
    SIDE_FIELDS,
    TENSOR_INF,
    TENSOR_MAX_ABS,
    TENSOR_NAN,
    TENSOR_NORM,
    TENSOR_ZERO,
)
from gradaudit.report.compare_text import (
    FLAGGED,
    NOTABLE,
    ab_mode,
    compared,
    compared_line,
    dtype_line,
    identity_line,
    interpretation,
    merged_tensor_findings,
    mismatch_parts,
    ordered_changes,
    shape_mismatches,
    short_formula,
    side_input,
    side_words,
)
from gradaudit.report.compare_text import verdict_line as compare_verdict_line
from gradaudit.report.precision_table import NUMBERS, cells, range_line, shown_rows
from gradaudit.report.text import number, plural, printable
from gradaudit.report.trend_text import (
    audited,
    ends,
    findings_line,
    layer_flags,
    spark_cells,
    sparkline,
    trend_line,
)
from gradaudit.report.trend_text import verdict_line as trend_verdict_line
from gradaudit.report.verdict import (
    audited_line,
    flagged_tensors,
    history_lines,
    several_files,
    thin_readings,
    unaudited,
    verdict_line,
)
from gradaudit.results import Finding, LimitFinding, Report, TensorStats
from gradaudit.results.comparison import (
    CompareFinding,
    Comparison,
    Mismatch,
    ParameterChange,
    ParameterComparison,
    SideStats,
)
from gradaudit.results.trend import TrendFinding, TrendReport
from gradaudit.results.verdict import comparison_exit_code, exit_code, trend_exit_code

#: The mark before a finding, and before the verdict heading.
MARK = {Severity.ERROR: "❌", Severity.WARNING: "⚠️", Severity.IGNORED: ""}
VERDICT_MARK = {
    ExitCode.OK: "✅",
    ExitCode.FINDINGS: "❌",
    ExitCode.INPUT_ERROR: "❌",
    ExitCode.INTERNAL_ERROR: "❌",
}
_SPECIAL = re.compile(r"([\\`*_\[\]<|~])")
#: The scan's flagged-tensor table: its numbers, in the order ``--format table`` shows them.
TENSOR_FIELDS = (TENSOR_NORM, TENSOR_MAX_ABS, TENSOR_ZERO, TENSOR_NAN, TENSOR_INF)
#: Names listed per "only in A/B" line before "… N more" (the JSON lists them all).
_NAME_LIMIT = 10


def code(text: str) -> str:
    """``text`` as a GFM code span that is safe inside a table cell."""
    # A code span shows backslashes literally, so they stay single; GFM splits cells on
    # every unescaped pipe, even inside code, so each pipe gets one backslash.
    text = printable(text, backslash=False).replace("|", "\\|")
    ticks = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (ticks + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def escape(text: str) -> str:
    """Untrusted free text (an error message) with Markdown punctuation escaped."""
    return _SPECIAL.sub(r"\\\1", printable(text))


def table(headers: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]]) -> list[str]:
    """A GFM table: ``headers`` as (text, ``"left"``/``"right"``), then one line per row."""
    lines = [
        "| " + " | ".join(text.replace("|", "\\|") for text, _ in headers) + " |",
        "|" + "|".join("--:" if justify == "right" else "---" for _, justify in headers) + "|",
    ]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def blocks(*parts: Sequence[str]) -> Iterator[str]:
    """Blocks of lines as the document's text: a blank line between blocks, none left empty."""
    first = True
    for block in parts:
        if not block:
            continue
        yield ("" if first else "\n\n") + "\n".join(block)
        first = False
    if not first:
        yield "\n"


def _kinds(findings: list[Finding]) -> str:
    return ", ".join(f"{MARK[f.severity]} {f.kind.value}" for f in findings)


def _row(stats: TensorStats, findings: list[Finding], several_files: bool) -> list[str]:
    cells = [code(stats.source or "")] if several_files else []
    return [*cells, code(stats.name), _kinds(findings), *(f.text(stats) for f in TENSOR_FIELDS)]


def _tensors(report: Report, options: RenderOptions) -> list[str]:
    shown, flagged = flagged_tensors(report, None if options.show_all else MAX_FLAGGED_ROWS)
    if not flagged:
        return []
    files = several_files(report)
    headers = [("file", "left")] if files else []
    headers += [("tensor", "left"), ("findings", "left")]
    headers += [(f.header, f.justify) for f in TENSOR_FIELDS]
    lines = table(headers, (_row(stats, found, files) for stats, found in shown))
    if len(shown) < flagged:
        lines += ["", more_flagged(flagged - len(shown))]
    return lines


def _limit(finding: LimitFinding) -> str:
    if finding.kind is LimitKind.GLOBAL_NORM:
        text = f"global norm {number(finding.value)} > max-global-norm {number(finding.limit)}"
    else:
        text = f"{finding.value:.1%} of tensors vanish > max-vanishing-fraction {finding.limit:g}"
    where = "" if finding.source is None else f" in {code(finding.source)}"
    return f"- ❌ {text}{where}"


def _problems(report: Report) -> list[str]:
    lines = [f"- ℹ️ {escape(line)}" for line in thin_readings(report).values()]
    lines += [_limit(f) for f in report.limit_findings]
    lines += [
        f"- {'ℹ️' if severity is None else MARK[severity]} {escape(line)}"
        for line, severity in history_lines(report)
    ]
    lines += [f"- ❌ {code(e.path)}: {escape(e.message)}" for e in report.errors]
    lines += [
        f"- {MARK[f.severity]} {code(f.tensor)}: {escape(f.message)}" for f in unaudited(report)
    ]
    return lines


def policy_parts(report: Report) -> list[str]:
    """The policy a report was judged by, piece by piece, for the closing ``Policy:`` line."""
    t = report.thresholds
    # Kinds that fail whatever ``fail_on`` says (``cast``, ``negative``) are named when the
    # report holds one: a policy line that left them out contradicted the verdict beside it.
    failing = t.fail_on | {f.kind for f in report.findings if f.kind in ALWAYS_FAILING}
    parts = [
        f"vanishing < {number(t.vanishing)}",
        f"exploding > {number(t.exploding)}",
        "fail on: " + (", ".join(sorted(k.value for k in failing)) or "none"),
    ]
    if t.max_global_norm is not None:
        parts.append(f"max global norm {number(t.max_global_norm)}")
    if t.max_vanishing_fraction is not None:
        parts.append(f"max vanishing fraction {t.max_vanishing_fraction:g}")
    if t.ignore:
        parts.append("ignore " + ", ".join(code(p) for p in t.ignore))
    s = report.summary
    if s.ignored_findings:
        parts.append(f"{plural(s.ignored_findings, 'finding')} ignored")
    if report.skipped:
        parts.append(f"{plural(len(report.skipped), 'tensor')} skipped")
    return parts


def _headroom(report: Report, options: RenderOptions) -> list[str]:
    """``--precision``: the rows the table format's headroom table shows, the whole run
    last, then the headroom findings; ``--quiet`` keeps the flagged rows and findings."""
    headroom = report.headroom
    if headroom is None or (options.quiet and not headroom.findings):
        return []
    marks = {
        f.tensor: MARK[report.thresholds.severity(FindingKind.CAST, f.tensor)]
        for f in headroom.findings
    }
    rows = shown_rows(headroom, top=0 if options.quiet else options.top, show_all=options.show_all)
    listed = rows if options.show_all else rows[:MAX_FLAGGED_ROWS]
    files = several_files(report)  # the same names in two dumps: say which is which
    headers = [("file", "left")] if files else []
    headers += [("tensor", "left"), *((name, "right") for name in NUMBERS)]
    body = [
        [
            *([code(r.source or "")] if files else []),
            _marked(marks.get(r.name, ""), code(r.name)),
            *cells(r),
        ]
        for r in listed
    ]
    if not options.quiet:
        total = f"**{escape(headroom.total.name)}**"
        body.append([*([""] if files else []), total, *cells(headroom.total)])
    label = headroom.precision.value
    lines = [
        f"**Headroom in {label}**: {escape(range_line(headroom.precision))}; "
        "values = non-zero finite"
    ]
    lines += ["", *table(headers, body)]
    hidden = len(headroom.tensors) - len(listed)
    if hidden and not options.quiet:
        lines += ["", f"… and {plural(hidden, 'more tensor')} (--all lists every one)"]
    findings = headroom.findings if options.show_all else headroom.findings[:MAX_FLAGGED_ROWS]

    def where(finding: PrecisionFinding) -> str:
        return code(finding.tensor) + (f" in {code(finding.source or '')}" if files else "")

    if findings:
        lines.append("")
    lines += [
        "- " + _marked(marks[f.tensor], f"{where(f)}: {f.kind}: {escape(f.message)}")
        for f in findings
    ]
    if len(findings) < len(headroom.findings):
        lines.append(f"- … and {plural(len(headroom.findings) - len(findings), 'more finding')}")
    if not headroom.findings:
        lines += ["", _no_headroom_findings(headroom)]
    return lines


def _marked(mark: str, text: str) -> str:
    """``text`` after its mark; an ignored finding has none."""
    return f"{mark} {text}" if mark else text


def _no_headroom_findings(headroom: PrecisionReport) -> str:
    return (
        f"✅ No tensor loses more than {headroom.max_underflow:g} of its values to underflow "
        f"in {headroom.precision.value}, none overflows."
    )


def render_scan(report: Report, options: RenderOptions) -> Iterator[str]:
    """Verdict, what was audited, problems, the flagged tensors, the headroom, the policy."""
    body = _problems(report)
    tensors = _tensors(report, options)
    headroom = _headroom(report, options)
    if options.quiet:
        return blocks(body, tensors, headroom)
    mark = VERDICT_MARK[exit_code(report)]
    head = [f"### {mark} gradaudit: {verdict_line(report)}", "", audited_line(report)]
    policy = ["Policy: " + " · ".join(policy_parts(report))]
    return blocks(head, body, tensors, headroom, policy)


# ---------------------------------------------------------------------------- compare


def _ratio(comparison: Comparison) -> list[str]:
    dual = comparison.dual
    ratio = dual.normalized_ratio
    ab = ab_mode(comparison)
    if ratio is None:
        note = side_words(comparison, dual.ratio_note or "")
        head = f"**Normalized ratio not computed**: {escape(note)}"
    else:
        said = interpretation(dual, ab, compared(comparison))
        head = f"**Normalized ratio {number(ratio)}**: {escape(said)}"
    if dual.raw_ratio is None:
        return [head]
    return [
        head,
        "",
        f"Raw ratio {'B/A' if ab_mode(comparison) else 'seed/host'} {number(dual.raw_ratio)} · "
        f"normalized = {short_formula(ab_mode(comparison))}, "
        "the ratio of the RMS gradient element",
    ]


def _side_row(side: SideStats, letter: str, ab: bool) -> list[str]:
    cells = [letter if ab else f"{side.label} ({letter})", code(side_input(side))]
    return cells + [f.text(side) for f in SIDE_FIELDS]


def _sides(comparison: Comparison) -> list[str]:
    headers = [("side", "left"), ("input", "left")]
    headers += [(f.header, f.justify) for f in SIDE_FIELDS]
    dual = comparison.dual
    ab = ab_mode(comparison)
    return table(headers, [_side_row(dual.host, "A", ab), _side_row(dual.seed, "B", ab)])


def _comparison_finding(comparison: Comparison, finding: CompareFinding) -> tuple[bool, str]:
    message = side_words(comparison, finding.message)
    return finding.failing, f"- {MARK[finding.severity]} {escape(message)}"


def _compare_findings(comparison: Comparison, options: RenderOptions) -> list[str]:
    """Input problems and limits, then failing findings, then warnings; ignored ones left out."""
    lines = [f"- ❌ {code(e.path)}: {escape(e.message)}" for e in comparison.errors]
    lines += [f"- ❌ {escape(f.message)}" for f in comparison.report.limit_findings]
    ranked = [_comparison_finding(comparison, f) for f in comparison.findings]
    limit = None if options.show_all else MAX_FLAGGED_ROWS
    total = len(lines) + len(ranked)
    for severity in (Severity.ERROR, Severity.WARNING):  # only what can be shown is built
        merged, count = merged_tensor_findings(comparison, (severity,), limit)
        total += count
        lines += [line for failing, line in ranked if failing is (severity is Severity.ERROR)]
        lines += [
            f"- {MARK[f.severity]} {code(f.tensor)} ({sides}): {f.kind.value}: {escape(f.message)}"
            for f, sides in merged
        ]
    shown = lines if options.show_all else lines[:MAX_FLAGGED_ROWS]
    if len(shown) < total:
        shown.append(f"- … and {plural(total - len(shown), 'more finding')} (--all)")
    return shown


def _change_status(change: ParameterChange, fail_on_change: bool) -> str:
    if change.note is not None:
        return escape(change.note)
    return f"{MARK[Severity.ERROR if fail_on_change else Severity.WARNING]} changed"


def _change_rows(comparison: Comparison, options: RenderOptions) -> list[str]:
    """The flagged and not-comparable shared tensors (all of them are in the JSON)."""
    parameters = comparison.parameters
    if parameters is None:
        return []
    wanted = FLAGGED if options.quiet else NOTABLE  # quiet: only findings
    shown, rows = ordered_changes(
        parameters, wanted, None if options.show_all else MAX_FLAGGED_ROWS
    )
    if not rows:
        return []
    fields = (CHANGE_SHAPE, *CHANGE_NUMBERS)
    headers = [("tensor", "left"), *((f.header, f.justify) for f in fields), ("status", "left")]
    fail_on_change = comparison.policy.fail_on_change
    lines = table(
        headers,
        (
            [code(c.name), *(f.text(c) for f in fields), _change_status(c, fail_on_change)]
            for c in shown
        ),
    )
    if len(shown) < rows:
        lines += ["", f"… and {plural(rows - len(shown), 'more flagged tensor')} (--all)"]
    return lines


def _listed(title: str, items: list[str]) -> str:
    """``- Only in A (12): `a`, `b`, … and 2 more``: a bullet listing at most ten items."""
    listed = ", ".join(items[:_NAME_LIMIT])
    more = f", … and {len(items) - _NAME_LIMIT} more" if len(items) > _NAME_LIMIT else ""
    return f"- {title} ({len(items)}): {listed}{more}"


def _mismatch(mismatch: Mismatch) -> str:
    return f"{code(mismatch.name)}: {'; '.join(mismatch_parts(mismatch))}"


def _name_lines(parameters: ParameterComparison) -> list[str]:
    lists = [
        ("Only in A", [code(name) for name in parameters.only_in_a]),
        ("Only in B", [code(name) for name in parameters.only_in_b]),
        ("Shape differs", [_mismatch(m) for m in shape_mismatches(parameters)]),
    ]
    lines = [_listed(title, items) for title, items in lists if items]
    if (dtypes := dtype_line(parameters)) is not None:
        lines.append(f"- {escape(dtypes)}")
    lines.append(f"- {escape(identity_line(parameters))}")
    return lines


def _compare_parameters(comparison: Comparison, options: RenderOptions) -> list[list[str]]:
    parameters = comparison.parameters
    if parameters is None:
        return [["No tensor names shared by A and B: no per-parameter comparison."]]
    k = f"{parameters.max_change:g}"
    head = [
        f"**Per-parameter comparison, A → B**: "
        f"{plural(len(parameters.changes), 'shared tensor')}, "
        f"{len(parameters.flagged)} outside [1/{k}, {k}] (`--max-change`)"
    ]
    return [head, _change_rows(comparison, options), _name_lines(parameters)]


def _compare_policy(comparison: Comparison) -> str:
    parts = policy_parts(comparison.report)
    policy = comparison.policy
    if policy.min_ratio is not None:
        parts.append(f"min ratio {number(policy.min_ratio)}")
    if policy.max_ratio is not None:
        parts.append(f"max ratio {number(policy.max_ratio)}")
    verdict = "fails" if policy.fail_on_change else "warns"
    parts.append(f"max change {policy.max_change:g}× ({verdict})")
    return f"{compared_line(comparison)} · Policy: " + " · ".join(parts)


def render_compare(comparison: Comparison, options: RenderOptions) -> Iterator[str]:
    """Verdict, the ratio, the sides, findings, flagged shared tensors, names, policy."""
    findings = _compare_findings(comparison, options)
    if options.quiet:
        return blocks(findings, _change_rows(comparison, options))
    mark = VERDICT_MARK[comparison_exit_code(comparison)]
    head = [f"### {mark} gradaudit compare: {compare_verdict_line(comparison)}"]
    return blocks(
        head,
        _ratio(comparison),
        _sides(comparison),
        findings,
        *_compare_parameters(comparison, options),
        [_compare_policy(comparison)],
    )


# ---------------------------------------------------------------------------- trend


def _trend_findings(report: TrendReport, options: RenderOptions) -> list[str]:
    """Input problems, then failing findings, then warnings."""
    lines = [f"- ❌ {code(e.path)}: {escape(e.message)}" for e in report.errors]
    if not report.errors and not audited(report):
        lines.append("- ❌ nothing to audit: no floating-point tensor in any dump")
    ordered = sorted(report.findings, key=lambda f: not f.failing)
    shown = ordered if options.show_all else ordered[:MAX_FLAGGED_ROWS]
    lines += [_trend_finding(f) for f in shown]
    if len(shown) < len(ordered):
        lines.append(f"- … and {plural(len(ordered) - len(shown), 'more finding')} (--all)")
    return lines


def _trend_finding(finding: TrendFinding) -> str:
    return (
        f"- {MARK[finding.severity]} **{finding.kind.value}** in {code(finding.layer)}: "
        f"{escape(finding.message)}"
    )


def _trend_layers(report: TrendReport, options: RenderOptions) -> list[str]:
    """The flagged layers: their norm over the steps as a sparkline, first, last, max."""
    flagged = {f.layer for f in report.findings}
    rows = [layer for layer in report.layers if layer.name in flagged]
    if not rows:
        return []
    shown = rows if options.show_all else rows[:MAX_FLAGGED_ROWS]
    cells = spark_cells(len(report.steps), options.width)
    headers = [("layer", "left"), ("norm by step", "left")]
    headers += [("first", "right"), ("last", "right"), ("max", "right"), ("findings", "left")]
    lines = table(
        headers,
        (
            [
                code(layer.name),
                code(sparkline(layer.norms, layer.nonfinite, cells)),
                *(number(v) for v in ends(layer.norms)),
                escape(layer_flags(layer)),
            ]
            for layer in shown
        ),
    )
    if len(shown) < len(rows):
        lines += ["", f"… and {plural(len(rows) - len(shown), 'more flagged layer')} (--all)"]
    return lines


def render_trend(report: TrendReport, options: RenderOptions) -> Iterator[str]:
    """Verdict, what was audited, the findings, the flagged layers, the policy."""
    findings = _trend_findings(report, options)
    layers = _trend_layers(report, options)
    if options.quiet:
        return blocks(findings, layers)
    mark = VERDICT_MARK[trend_exit_code(report)]
    head = [f"### {mark} gradaudit trend: {trend_verdict_line(report)}", "", trend_line(report)]
    return blocks(head, findings, layers, [findings_line(report)])


RENDERERS = Renderers(scan=render_scan, compare=render_compare, trend=render_trend)
