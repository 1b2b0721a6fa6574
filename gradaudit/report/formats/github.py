"""``--format github``: GitHub Actions workflow commands, one per finding.

Each failing finding becomes ``::error …::…`` and each warning ``::warning
…::…``, errors first, so they appear as annotations on the run (and on the
dump's file in a pull request when it is committed). Ignored findings are not
annotated. In a comparison, an annotation about one side's tensors points at
that side's file; the comparison's own findings (a ratio outside
``--min-ratio``/``--max-ratio``, large per-parameter changes, mismatches) are
about both files and name the tensors they concern in the message. In a trend,
each finding points at the dump of the step it was seen at.
Tensor names are untrusted: control characters are escaped by
:func:`printable` and the rest by GitHub's own rules (``escape_data`` and
``escape_property`` follow ``@actions/core``), so a name can neither end the
command early nor start a new one. A plain summary line with the verdict ends
the output (``--quiet`` leaves it out).

With ``scan --precision`` each tensor that would not survive the cast (too
many values flush to zero, or any overflows) is already a ``cast`` finding of
the report, so it gets its annotation like any other finding, on its file; a
``::notice`` before the summary line gives the whole run's headroom (the last
row of the table format's headroom table) and how many tensors failed it.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradaudit.policy import Severity
from gradaudit.precision.judging import PrecisionReport
from gradaudit.report.base import MAX_FLAGGED_ROWS, Renderers, RenderOptions, more_flagged
from gradaudit.report.compare_text import (
    ab_mode,
    compared,
    compared_line,
    finding_subjects,
    ratio_sentence,
    side_name,
    side_of,
    side_words,
)
from gradaudit.report.compare_text import verdict_line as compare_verdict_line
from gradaudit.report.precision_table import summary_sentence
from gradaudit.report.text import layer_label, plural, printable
from gradaudit.report.trend_text import audited, trend_line
from gradaudit.report.trend_text import verdict_line as trend_verdict_line
from gradaudit.report.verdict import (
    audited_line,
    nothing_to_audit,
    some_findings,
    thin_readings,
    verdict_line,
)
from gradaudit.results import Finding, InputProblem, Report
from gradaudit.results.comparison import CompareFinding, Comparison
from gradaudit.results.trend import TrendReport

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning"}
#: Tensor names quoted in one annotation before "… and N more".
_NAME_LIMIT = 5


def escape_data(text: str) -> str:
    """Escape a command's message: ``%``, CR and LF."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a property value: the message rules plus ``:`` and ``,``."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(name: str, message: str, *, file: str | None = None, title: str | None = None) -> str:
    """One workflow command line, every part escaped."""
    props = []
    if file is not None:
        props.append(f"file={escape_property(file)}")
    if title is not None:
        props.append(f"title={escape_property(title)}")
    joined = " " + ",".join(props) if props else ""
    return f"::{name}{joined}::{escape_data(message)}"


def _input_error(problem: InputProblem, title: str) -> str:
    path = printable(problem.path)
    return command("error", f"{path}: {printable(problem.message)}", file=path, title=title)


def _ranked(
    lines: list[tuple[bool, str]], options: RenderOptions, title: str, left_out: int = 0
) -> Iterator[str]:
    """Failing lines before warnings, at most :data:`MAX_FLAGGED_ROWS` of them without ``--all``.

    A reader of the raw log sees what failed first. ``left_out`` lines past the cap
    were never made (the caller picked the first of each kind on the columns).
    """
    out = [line for failing, line in lines if failing]
    out += [line for failing, line in lines if not failing]
    shown = len(out) if options.show_all else min(len(out), MAX_FLAGGED_ROWS)
    hidden = len(out) - shown + left_out
    yield from (line + "\n" for line in out[:shown])
    if hidden:
        yield command("notice", more_flagged(hidden, "finding"), title=title) + "\n"


def render_scan(report: Report, options: RenderOptions) -> Iterator[str]:
    """Input errors, exceeded limits, then one annotation per finding; the verdict."""
    title = "gradaudit: input could not be audited"
    for problem in report.errors:
        yield _input_error(problem, title) + "\n"
    if not report.errors and report.audited_nothing:
        yield command("error", nothing_to_audit(report), title="gradaudit: nothing to audit") + "\n"
    for path, line in thin_readings(report).items():
        title = "gradaudit: read on thin evidence"
        yield command("notice", line, file=printable(path), title=title) + "\n"
    for limit in report.limit_findings:
        source = None if limit.source is None else printable(limit.source)
        title = f"gradaudit: {limit.kind.value} limit exceeded"
        yield command("error", printable(limit.message), file=source, title=title) + "\n"
    # Failing findings first, then warnings; built only as far as they are listed.
    listed = None if options.show_all else MAX_FLAGGED_ROWS
    failing, failing_count = some_findings(report, [Severity.ERROR], limit=listed)
    room = None if listed is None else listed - len(failing)
    warnings, warning_count = some_findings(report, [Severity.WARNING], limit=room)
    for finding in failing + warnings:
        name = printable(finding.tensor)
        line = command(
            _COMMAND[finding.severity],
            f"{name}: {printable(finding.message)}",
            file=None if finding.source is None else printable(finding.source),
            title=f"gradaudit: {finding.kind.value} in {name}",
        )
        yield line + "\n"
    hidden = failing_count + warning_count - len(failing) - len(warnings)
    if hidden:
        yield command("notice", more_flagged(hidden, "finding"), title="gradaudit") + "\n"
    if not options.quiet:
        if report.headroom is not None:
            yield _headroom_notice(report.headroom) + "\n"
        yield f"gradaudit: {verdict_line(report)} · {audited_line(report)}\n"


def _headroom_notice(headroom: PrecisionReport) -> str:
    """``--precision``: the whole run's headroom, and how many tensors would not survive."""
    label = headroom.precision.value
    failed = len({f.tensor for f in headroom.findings})
    verdict = (
        f"{plural(failed, 'tensor')} would not survive the cast"
        if failed
        else "every tensor survives the cast"
    )
    return command(
        "notice",
        f"{headroom.total.name}: {summary_sentence(headroom.total)} · {verdict} "
        f"(--max-underflow {headroom.max_underflow:g}, any overflow fails)",
        title=f"gradaudit: headroom in {label}",
    )


# ---------------------------------------------------------------------------- compare


def _file(comparison: Comparison, label: str | None) -> str | None:
    side = side_of(comparison, label)
    return None if side is None or side.path is None else printable(side.path)


def _about(comparison: Comparison, finding: CompareFinding) -> str:
    """The tensors a per-parameter finding is about, appended to its message (at most five)."""
    subjects, total = finding_subjects(comparison, finding.kind, _NAME_LIMIT)
    if not subjects:
        return ""
    more = total - _NAME_LIMIT
    return ": " + "; ".join(subjects) + (f"; … and {more} more" if more > 0 else "")


def render_compare(comparison: Comparison, options: RenderOptions) -> Iterator[str]:
    """One annotation per input problem, exceeded limit and finding; the verdict and ratio."""
    title = "gradaudit compare: input could not be compared"
    lines = [(True, _input_error(problem, title)) for problem in comparison.errors]
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
                    printable(side_words(comparison, finding.message))
                    + _about(comparison, finding),
                    title=f"gradaudit compare: {finding.kind.value}",
                ),
            )
        )
    # Only what can be shown is built: the first of the failing and of the warnings.
    cap = None if options.show_all else MAX_FLAGGED_ROWS
    left_out = 0
    picked: list[Finding] = []
    for severity in (Severity.ERROR, Severity.WARNING):
        found, count = some_findings(comparison.report, [severity], limit=cap)
        picked += found
        left_out += count - len(found)
    for tensor_finding in picked:
        name = printable(tensor_finding.tensor)
        lines.append(
            (
                tensor_finding.failing,
                command(
                    _COMMAND[tensor_finding.severity],
                    f"{name} ({side_name(comparison, tensor_finding.source)}): "
                    f"{printable(tensor_finding.message)}",
                    file=_file(comparison, tensor_finding.source),
                    title=f"gradaudit: {tensor_finding.kind.value} in {name}",
                ),
            )
        )
    yield from _ranked(lines, options, "gradaudit compare", left_out)
    if not options.quiet:
        yield (
            f"gradaudit compare: {compare_verdict_line(comparison)} · "
            f"{ratio_sentence(comparison.dual, ab_mode(comparison), compared(comparison))} · "
            f"{compared_line(comparison)}\n"
        )


# ---------------------------------------------------------------------------- trend


def render_trend(report: TrendReport, options: RenderOptions) -> Iterator[str]:
    """One annotation per unreadable dump and per finding (on the step's dump); the verdict."""
    title = "gradaudit trend: input could not be audited"
    lines = [(True, _input_error(problem, title)) for problem in report.errors]
    if not report.errors and not audited(report):
        message = "nothing to audit: no floating-point tensor in any dump"
        lines.append((True, command("error", message, title="gradaudit trend: nothing to audit")))
    for finding in report.findings:
        layer = layer_label(finding.layer)
        line = command(
            _COMMAND[finding.severity],
            f"{layer}: {printable(finding.message)}",
            file=printable(finding.path),
            title=f"gradaudit trend: {finding.kind.value} in {layer} at step {finding.step}",
        )
        lines.append((finding.failing, line))
    yield from _ranked(lines, options, "gradaudit trend")
    if not options.quiet:
        yield f"gradaudit trend: {trend_verdict_line(report)} · {trend_line(report)}\n"


RENDERERS = Renderers(scan=render_scan, compare=render_compare, trend=render_trend)
