"""``--format junit``: a JUnit XML report, rendered natively by GitLab, Jenkins and most CIs.

One ``<testsuite>`` per input file and one ``<testcase>`` per check in it:
``nan``, ``inf``, ``exploding``, ``vanishing``, plus ``global-norm`` and
``vanishing-fraction`` when those limits are set. A check fails (``<failure>``)
when it has a failing finding in that file; its warnings and ignored findings
are listed in ``<system-out>`` of a passing test case. A file that could not
be audited is one test case ``read`` with an ``<error>``. Built with
``xml.etree`` (which escapes markup); names go through :func:`printable` first,
because XML 1.0 cannot carry control characters at all.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, LimitKind, Severity
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions, more_flagged
from gradaudit.report.text import plural, printable
from gradaudit.report.verdict import nothing_to_audit
from gradaudit.results import Finding, LimitFinding, Report
from gradaudit.scan.judge import exit_code

#: Suite name for tensors audited from memory (no input file).
IN_MEMORY_SUITE = "gradaudit"


@dataclass
class Case:
    """One test case being assembled: failing lines, and lines for ``<system-out>``.

    ``error`` makes it an ``<error>`` (the check could not run), ``skipped`` a
    ``<skipped>`` (the check does not apply), each with its reason.
    """

    name: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None


def _finding_line(finding: Finding) -> str:
    return f"{printable(finding.tensor)}: {finding.message}"


def check_cases(report: Report, source: str | None) -> list[Case]:
    """The per-tensor checks (and set limits) of one input of ``report`` as test cases."""
    # The four gradient checks always run; the role checks appear when they applied.
    kinds = [FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING, FindingKind.VANISHING]
    if report.thresholds.cast_check is not None:
        kinds.append(FindingKind.CAST)
    kinds += [f.kind for f in report.findings if f.source == source]
    checks = {kind: Case(kind.value) for kind in dict.fromkeys(kinds)}
    for finding in report.findings:
        if finding.source != source:
            continue
        case = checks.setdefault(finding.kind, Case(finding.kind.value))
        if finding.severity is Severity.ERROR:
            case.failures.append(_finding_line(finding))
        elif finding.severity is Severity.WARNING:
            case.notes.append("warning: " + _finding_line(finding))
        else:
            pattern = report.thresholds.ignored_by(finding.tensor)
            case.notes.append(f"ignored ({printable(pattern or '')}): " + _finding_line(finding))
    cases = list(checks.values())
    limits: dict[LimitKind, float | None] = {
        LimitKind.GLOBAL_NORM: report.thresholds.max_global_norm,
        LimitKind.VANISHING_FRACTION: report.thresholds.max_vanishing_fraction,
    }
    for kind, limit in limits.items():
        if limit is None:
            continue
        case = Case(kind.value)
        exceeded: list[LimitFinding] = [
            f for f in report.limit_findings if f.kind is kind and f.source == source
        ]
        case.failures += [printable(f.message) for f in exceeded]
        cases.append(case)
    return cases


def add_suite(parent: ET.Element, name: str, cases: list[Case]) -> None:
    """Append a ``<testsuite>`` of ``cases`` to ``parent``, with its counts."""
    failures = sum(1 for c in cases if c.failures)
    errors = sum(1 for c in cases if c.error is not None)
    skipped = sum(1 for c in cases if c.skipped is not None)
    suite = ET.SubElement(
        parent,
        "testsuite",
        name=name,
        tests=str(len(cases)),
        failures=str(failures),
        errors=str(errors),
        skipped=str(skipped),
    )
    for case in cases:
        element = ET.SubElement(suite, "testcase", classname=name, name=case.name)
        if case.error is not None:
            ET.SubElement(
                element, "error", type="input-error", message=case.error
            ).text = case.error
        if case.skipped is not None:
            ET.SubElement(element, "skipped", message=case.skipped)
        if case.failures:
            failure = ET.SubElement(
                element,
                "failure",
                type=case.name,
                message=f"{case.name}: {plural(len(case.failures), 'failing finding')}",
            )
            failure.text = "\n".join(_capped(case.failures))
        if case.notes:
            ET.SubElement(element, "system-out").text = "\n".join(_capped(case.notes))


def _capped(lines: list[str]) -> list[str]:
    """At most :data:`MAX_FLAGGED_ROWS` lines of one case, then how many more there are.

    The counts (``failures``, the failure message) stay exact; only the listing is cut.
    """
    if len(lines) <= MAX_FLAGGED_ROWS:
        return lines
    return [*lines[:MAX_FLAGGED_ROWS], more_flagged(len(lines) - MAX_FLAGGED_ROWS, "finding")]


def render_junit(report: Report, options: RenderOptions) -> str:
    root = ET.Element("testsuites", name="gradaudit", time=f"{report.elapsed_s:.3f}")
    errors = {problem.path: problem.message for problem in report.errors}
    sources: list[str | None] = [f.path for f in report.files] or ([None] if report.tensors else [])
    for source in sources:
        name = IN_MEMORY_SUITE if source is None else printable(source)
        if source is not None and source in errors:
            cases = [Case("read", error=printable(errors[source]))]
        else:
            cases = check_cases(report, source)
        add_suite(root, name, cases)
    if exit_code(report) is ExitCode.INPUT_ERROR and not report.errors:
        message = nothing_to_audit(report)
        add_suite(root, IN_MEMORY_SUITE, [Case("audit", error=message)])
    return finish(root)


def finish(root: ET.Element) -> str:
    """The document: the root's totals summed from its suites, indented, with its declaration."""
    suites = list(root)
    for attribute in ("tests", "failures", "errors"):
        root.set(attribute, str(sum(int(s.get(attribute, "0")) for s in suites)))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
