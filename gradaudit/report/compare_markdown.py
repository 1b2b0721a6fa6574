"""``gradaudit compare --format markdown``: the verdict, the ratio, and what is wrong.

For ``$GITHUB_STEP_SUMMARY`` and pull-request comments, like the scan's
Markdown: a verdict heading; the normalized ratio with its interpretation; a
two-row table of the sides; the findings as a list (input problems, exceeded
limits, the comparison's own findings and per-tensor findings, failing first);
the shared tensors that are flagged or could not be compared; the names only in
A or B and the mismatches; what was compared and the policy. ``--quiet`` keeps
the findings and the flagged rows only. Names and paths are code spans made by
:func:`~gradaudit.report.markdown.code`, so no name can break a table or inject
markup; lists are cut at :data:`~gradaudit.report.base.MAX_FLAGGED_ROWS`
unless ``--all`` is given.
"""

from __future__ import annotations

from gradaudit.compare.checks import comparison_exit_code
from gradaudit.compare.model import (
    CompareFinding,
    Comparison,
    Mismatch,
    ParameterChange,
    ParameterComparison,
    SideStats,
)
from gradaudit.policy import Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions
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
    shape_mismatches,
    shape_text,
    short_formula,
    side_input,
    side_words,
    verdict_line,
)
from gradaudit.report.markdown import (
    MARK,
    VERDICT_MARK,
    code,
    escape,
    policy_parts,
)
from gradaudit.report.text import count, number, plural

#: Names listed per "only in A/B" line before "… N more" (the JSON lists them all).
_NAME_LIMIT = 10


def _ratio(comparison: Comparison) -> list[str]:
    dual = comparison.dual
    ratio = dual.normalized_ratio
    ab = ab_mode(comparison)
    if ratio is None:
        note = side_words(comparison, dual.ratio_note or "")
        head = f"**Normalized ratio not computed**: {escape(note)}"
    else:
        head = f"**Normalized ratio {number(ratio)}**: {escape(interpretation(dual, ab))}"
    if dual.raw_ratio is None:
        return [head]
    return [
        head,
        "",
        f"Raw ratio {'B/A' if ab_mode(comparison) else 'seed/host'} {number(dual.raw_ratio)} · "
        f"normalized = {short_formula(ab_mode(comparison))}, "
        "the ratio of the RMS gradient element",
    ]


def _side_row(side: SideStats, letter: str, ab: bool) -> str:
    cells = [
        letter if ab else f"{side.label} ({letter})",
        code(side_input(side)),
        count(side.tensors),
        count(side.params),
        number(side.norm),
        number(side.norm_per_sqrt_param),
        count(side.nan),
        count(side.inf),
        count(side.vanishing_tensors),
        count(side.exploding_tensors),
    ]
    return "| " + " | ".join(cells) + " |"


def _sides(comparison: Comparison) -> list[str]:
    header = ["side", "input", "tensors", "params", "norm", "norm/√params", "NaN", "±Inf"]
    header += ["vanishing", "exploding"]
    dual = comparison.dual
    return [
        "| " + " | ".join(header) + " |",
        "|---|---|" + "--:|" * (len(header) - 2),
        _side_row(dual.host, "A", ab_mode(comparison)),
        _side_row(dual.seed, "B", ab_mode(comparison)),
    ]


def _comparison_finding(comparison: Comparison, finding: CompareFinding) -> tuple[bool, str]:
    message = side_words(comparison, finding.message)
    return finding.failing, f"- {MARK[finding.severity]} {escape(message)}"


def _findings(comparison: Comparison, options: RenderOptions) -> list[str]:
    """Input problems and limits, then failing findings, then warnings; ignored ones left out."""
    lines = [f"- ❌ {code(e.path)}: {escape(e.message)}" for e in comparison.errors]
    lines += [f"- ❌ {escape(f.message)}" for f in comparison.report.limit_findings]
    ranked = [_comparison_finding(comparison, f) for f in comparison.findings]
    ranked += [
        (
            f.failing,
            f"- {MARK[f.severity]} {code(f.tensor)} ({sides}): {f.kind.value}: {escape(f.message)}",
        )
        for f, sides in merged_tensor_findings(comparison)
        if f.severity is not Severity.IGNORED
    ]
    lines += [line for failing, line in ranked if failing]
    lines += [line for failing, line in ranked if not failing]
    shown = lines if options.show_all else lines[:MAX_FLAGGED_ROWS]
    if len(shown) < len(lines):
        shown.append(f"- … and {plural(len(lines) - len(shown), 'more finding')} (--all)")
    return shown


def _status(change: ParameterChange, fail_on_change: bool) -> str:
    if change.note is not None:
        return escape(change.note)
    return f"{MARK[Severity.ERROR if fail_on_change else Severity.WARNING]} changed"


def _change_rows(comparison: Comparison, options: RenderOptions) -> list[str]:
    """The flagged and not-comparable shared tensors (all of them are in the JSON)."""
    parameters = comparison.parameters
    if parameters is None:
        return []
    wanted = (lambda c: c.flagged) if options.quiet else notable  # quiet: only findings
    rows = sorted((c for c in parameters.changes if wanted(c)), key=change_order)
    if not rows:
        return []
    shown = rows if options.show_all else rows[:MAX_FLAGGED_ROWS]
    lines = [
        "| tensor | shape | norm A | norm B | B/A | change | status |",
        "|---|---|--:|--:|--:|--:|---|",
    ]
    for change in shown:
        cells = [
            code(change.name),
            shape_text(change.shape),
            number(change.norm_a),
            number(change.norm_b),
            number(change.ratio),
            change_text(change),
            _status(change, comparison.policy.fail_on_change),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if len(shown) < len(rows):
        lines += ["", f"… and {plural(len(rows) - len(shown), 'more flagged tensor')} (--all)"]
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
    return lines


def _parameters(comparison: Comparison, options: RenderOptions) -> list[list[str]]:
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


def _policy(comparison: Comparison) -> str:
    parts = policy_parts(comparison.report)
    policy = comparison.policy
    if policy.min_ratio is not None:
        parts.append(f"min ratio {number(policy.min_ratio)}")
    if policy.max_ratio is not None:
        parts.append(f"max ratio {number(policy.max_ratio)}")
    verdict = "fails" if policy.fail_on_change else "warns"
    parts.append(f"max change {policy.max_change:g}× ({verdict})")
    return f"{compared_line(comparison)} · Policy: " + " · ".join(parts)


def render_comparison_markdown(comparison: Comparison, options: RenderOptions) -> str:
    findings = _findings(comparison, options)
    if options.quiet:
        blocks = [findings, _change_rows(comparison, options)]
    else:
        mark = VERDICT_MARK[comparison_exit_code(comparison)]
        head = [f"### {mark} gradaudit compare: {verdict_line(comparison)}"]
        blocks = [head, _ratio(comparison), _sides(comparison), findings]
        blocks += _parameters(comparison, options)
        blocks.append([_policy(comparison)])
    text = "\n\n".join("\n".join(block) for block in blocks if block)
    return text + "\n" if text else ""
