"""``gradaudit compare --format github``: GitHub Actions workflow commands, one per finding.

As for a scan (``github.py``, whose escaping this reuses): each failing finding
is an ``::error`` annotation and each warning a ``::warning``, errors first;
ignored findings are not annotated. An annotation about one side's tensors
points at that side's file; the comparison's own findings (a ratio outside
``--min-ratio``/``--max-ratio``, large per-parameter changes, mismatches) are
about both files and name the tensors they concern in the message. One plain
line with the verdict and the normalized ratio ends the output (``--quiet``
leaves it out).
"""

from __future__ import annotations

from gradaudit.compare.model import CompareFinding, Comparison
from gradaudit.policy import Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions, more_flagged
from gradaudit.report.compare_text import (
    ab_mode,
    compared_line,
    finding_subjects,
    ratio_sentence,
    side_name,
    side_of,
    side_words,
    verdict_line,
)
from gradaudit.report.github import command
from gradaudit.report.text import printable

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning"}
#: Tensor names quoted in one annotation before "… and N more".
_NAME_LIMIT = 5


def _file(comparison: Comparison, label: str | None) -> str | None:
    side = side_of(comparison, label)
    return None if side is None or side.path is None else printable(side.path)


def _about(comparison: Comparison, finding: CompareFinding) -> str:
    """The tensors a per-parameter finding is about, appended to its message (at most five)."""
    subjects = finding_subjects(comparison, finding.kind)
    if not subjects:
        return ""
    more = len(subjects) - _NAME_LIMIT
    return ": " + "; ".join(subjects[:_NAME_LIMIT]) + (f"; … and {more} more" if more > 0 else "")


def render_comparison_github(comparison: Comparison, options: RenderOptions) -> str:
    lines: list[tuple[bool, str]] = []
    for problem in comparison.errors:
        path = printable(problem.path)
        lines.append(
            (
                True,
                command(
                    "error",
                    f"{path}: {printable(problem.message)}",
                    file=path,
                    title="gradaudit compare: input could not be compared",
                ),
            )
        )
    for limit in comparison.report.limit_findings:
        lines.append(
            (
                True,
                command(
                    "error",
                    printable(limit.message),
                    file=_file(comparison, limit.source),
                    title=f"gradaudit: {limit.kind.value} limit exceeded ({limit.source})",
                ),
            )
        )
    for finding in comparison.findings:
        lines.append(
            (
                finding.failing,
                command(
                    _COMMAND[finding.severity],
                    side_words(comparison, finding.message) + _about(comparison, finding),
                    title=f"gradaudit compare: {finding.kind.value}",
                ),
            )
        )
    for tensor_finding in comparison.tensor_findings:
        if tensor_finding.ignored:
            continue
        name = printable(tensor_finding.tensor)
        lines.append(
            (
                tensor_finding.failing,
                command(
                    _COMMAND[tensor_finding.severity],
                    f"{name} ({side_name(comparison, tensor_finding.source)}): "
                    f"{tensor_finding.message}",
                    file=_file(comparison, tensor_finding.source),
                    title=f"gradaudit: {tensor_finding.kind.value} in {name}",
                ),
            )
        )
    # Errors before warnings: a reader of the raw log sees what failed first.
    out = [line for failing, line in lines if failing] + [
        line for failing, line in lines if not failing
    ]
    hidden = 0 if options.show_all else max(0, len(out) - MAX_FLAGGED_ROWS)
    if hidden:
        out = out[:MAX_FLAGGED_ROWS]
        out.append(command("notice", more_flagged(hidden, "finding"), title="gradaudit compare"))
    if not options.quiet:
        out.append(
            f"gradaudit compare: {verdict_line(comparison)} · "
            f"{ratio_sentence(comparison.dual, ab_mode(comparison))} · {compared_line(comparison)}"
        )
    return "".join(line + "\n" for line in out)
