"""``--format github``: GitHub Actions workflow commands, one per finding.

Each failing finding becomes ``::error …::…`` and each warning ``::warning
…::…``, so they appear as annotations on the run (and on the dump's file in a
pull request when it is committed). Ignored findings are not annotated.
Tensor names are untrusted: control characters are escaped by
:func:`printable` and the rest by GitHub's own rules (``escape_data`` and
``escape_property`` follow ``@actions/core``), so a name can neither end the
command early nor start a new one. A plain summary line ends the output
(``--quiet`` leaves it out).
"""

from __future__ import annotations

from gradaudit.policy import Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions, more_flagged
from gradaudit.report.text import printable
from gradaudit.report.verdict import audited_line, nothing_to_audit, verdict_line
from gradaudit.results import Report

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning"}


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


def render_github(report: Report, options: RenderOptions) -> str:
    lines = []
    for problem in report.errors:
        path = printable(problem.path)
        lines.append(
            command(
                "error",
                f"{path}: {printable(problem.message)}",
                file=path,
                title="gradaudit: input could not be audited",
            )
        )
    if not report.errors and not report.tensors:
        lines.append(
            command(
                "error",
                nothing_to_audit(report),
                title="gradaudit: nothing to audit",
            )
        )
    for limit in report.limit_findings:
        source = None if limit.source is None else printable(limit.source)
        lines.append(
            command(
                "error",
                printable(limit.message),
                file=source,
                title=f"gradaudit: {limit.kind.value} limit exceeded",
            )
        )
    # Errors before warnings: a reader of the raw log sees what failed first.
    shown = sorted(
        (f for f in report.findings if f.severity is not Severity.IGNORED),
        key=lambda f: not f.failing,
    )
    hidden = 0 if options.show_all else max(0, len(shown) - MAX_FLAGGED_ROWS)
    if hidden:
        shown = shown[:MAX_FLAGGED_ROWS]
    for finding in shown:
        name = printable(finding.tensor)
        lines.append(
            command(
                _COMMAND[finding.severity],
                f"{name}: {finding.message}",
                file=None if finding.source is None else printable(finding.source),
                title=f"gradaudit: {finding.kind.value} in {name}",
            )
        )
    if hidden:
        lines.append(command("notice", more_flagged(hidden, "finding"), title="gradaudit"))
    if not options.quiet:
        lines.append(f"gradaudit: {verdict_line(report)} · {audited_line(report)}")
    return "".join(line + "\n" for line in lines)
