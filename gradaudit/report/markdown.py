"""``--format markdown``: a verdict, a summary line and a table of flagged tensors.

Written for ``$GITHUB_STEP_SUMMARY`` and pull-request comments (GitHub
Flavored Markdown). Tensor names and paths come from files written by
strangers: they are shown in code spans with ``|`` escaped (GFM splits table
cells on it even inside code) and control characters escaped, so a name cannot
break the table or inject markup. The table is capped at
:data:`MAX_FLAGGED_ROWS` rows (a PR comment holds 65,536 characters) unless
``--all`` is given.
"""

from __future__ import annotations

import re

from gradaudit.errors import ExitCode
from gradaudit.policy import LimitKind, Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions, more_flagged
from gradaudit.report.text import count, number, plural, printable
from gradaudit.report.verdict import audited_line, flagged_tensors, unaudited, verdict_line
from gradaudit.results import Finding, LimitFinding, Report, TensorStats
from gradaudit.scan.judge import exit_code

#: Flagged rows shown without ``--all``.

#: The mark before a finding, and before the verdict heading (shared with compare's Markdown).
MARK = {Severity.ERROR: "❌", Severity.WARNING: "⚠️", Severity.IGNORED: ""}
VERDICT_MARK = {ExitCode.OK: "✅", ExitCode.FINDINGS: "❌", ExitCode.INPUT_ERROR: "❌"}
_SPECIAL = re.compile(r"([\\`*_\[\]<|~])")


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


def _kinds(findings: list[Finding]) -> str:
    return ", ".join(f"{MARK[f.severity]} {f.kind.value}" for f in findings)


def _row(stats: TensorStats, findings: list[Finding], several_files: bool) -> str:
    cells = [code(stats.source or "")] if several_files else []
    cells += [
        code(stats.name),
        _kinds(findings),
        number(stats.norm),
        number(stats.max_abs),
        count(stats.nan),
        f"{count(stats.pos_inf)}/{count(stats.neg_inf)}",
        f"{100.0 * stats.zero_fraction:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _table(report: Report, options: RenderOptions) -> list[str]:
    flagged = flagged_tensors(report)
    if not flagged:
        return []
    several_files = len({t.source for t in report.tensors}) > 1
    header = (["file"] if several_files else []) + [
        "tensor",
        "findings",
        "norm",
        "max\\|g\\|",
        "NaN",
        "+Inf/-Inf",
        "zero %",
    ]
    align = (["---"] if several_files else []) + ["---", "---"] + ["--:"] * 5
    shown = flagged if options.show_all else flagged[:MAX_FLAGGED_ROWS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += [_row(stats, found, several_files) for stats, found in shown]
    if len(shown) < len(flagged):
        lines += ["", more_flagged(len(flagged) - len(shown))]
    return lines


def _limit(finding: LimitFinding) -> str:
    if finding.kind is LimitKind.GLOBAL_NORM:
        text = f"global norm {number(finding.value)} > max-global-norm {number(finding.limit)}"
    else:
        text = f"{finding.value:.1%} of tensors vanish > max-vanishing-fraction {finding.limit:g}"
    where = "" if finding.source is None else f" in {code(finding.source)}"
    return f"- ❌ {text}{where}"


def _problems(report: Report) -> list[str]:
    lines = [_limit(f) for f in report.limit_findings]
    lines += [f"- ❌ {code(e.path)}: {escape(e.message)}" for e in report.errors]
    lines += [
        f"- {MARK[f.severity]} {code(f.tensor)}: {escape(f.message)}" for f in unaudited(report)
    ]
    return lines


def policy_parts(report: Report) -> list[str]:
    """The policy a report was judged by, piece by piece, for the closing ``Policy:`` line."""
    t = report.thresholds
    parts = [
        f"vanishing < {number(t.vanishing)}",
        f"exploding > {number(t.exploding)}",
        "fail on: " + (", ".join(sorted(k.value for k in t.fail_on)) or "none"),
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


def render_markdown(report: Report, options: RenderOptions) -> str:
    body = _problems(report)
    table = _table(report, options)
    if options.quiet:
        blocks = [block for block in (body, table) if block]
    else:
        mark = VERDICT_MARK[exit_code(report)]
        head = [f"### {mark} gradaudit: {verdict_line(report)}", "", audited_line(report)]
        policy = ["Policy: " + " · ".join(policy_parts(report))]
        blocks = [block for block in (head, body, table, policy) if block]
    if not blocks:
        return ""
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"
