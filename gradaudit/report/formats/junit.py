"""``--format junit``: JUnit XML test results, rendered natively by GitLab, Jenkins and most CIs.

A scan: one ``<testsuite>`` per input file and one ``<testcase>`` per check in it:
``nan``, ``inf``, ``exploding``, ``vanishing``, plus ``global-norm`` and
``vanishing-fraction`` when those limits are set. A check fails (``<failure>``)
when it has a failing finding in that file; its warnings and ignored findings
are listed in ``<system-out>`` of a passing test case. A file that could not
be audited is one test case ``read`` with an ``<error>``. With ``scan
--precision`` the ``cast`` check is in every file's suite: it fails on the
file's tensors that would not survive the cast (their headroom findings are
``cast`` findings of the report, one failing line each), and its
``<system-out>`` gives the file's headroom in one line (its row of
:attr:`PrecisionReport.files`), so a passing cast is a passing test with its
numbers, not a missing one. Built with
``xml.etree`` (which escapes markup); names go through :func:`printable` first,
because XML 1.0 cannot carry control characters at all.

A comparison: three ``<testsuite>`` elements.

* ``comparison``: one test case per comparison check. ``normalized-ratio``
  fails on a ratio outside ``--min-ratio``/``--max-ratio`` (or not computable
  under them) and always reports the ratio in ``<system-out>``;
  ``parameter-change`` fails on flagged shared tensors under
  ``--fail-on-change`` (else lists them as warnings); ``shapes-and-dtypes``
  lists mismatches. The last two are ``<skipped>`` when the sides share no
  tensor name.
* ``host: …`` and ``seed: …``: the per-tensor checks of each side, exactly as
  a scan reports one input file. A side that could not be read, or holds
  nothing to compare, is one test case ``read`` with an ``<error>``.

A trend: one ``<testsuite>`` ``trend`` with a test case per check
(``nonfinite``, ``spike``, ``collapse``), failing on its failing findings and
listing its warnings in ``<system-out>``; a dump that could not be audited is
a test case ``read`` with an ``<error>`` in a suite named after its file.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field

from gradaudit._compat import assert_never
from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, LimitKind, Severity
from gradaudit.precision.judging import PrecisionReport
from gradaudit.report.base import MAX_FLAGGED_ROWS, Renderers, RenderOptions, more_flagged
from gradaudit.report.compare_text import (
    ab_mode,
    compared,
    finding_subjects,
    ratio_sentence,
    side_input,
)
from gradaudit.report.precision_table import summary_sentence
from gradaudit.report.text import layer_label, number, plural, printable
from gradaudit.report.trend_text import audited
from gradaudit.report.verdict import kinds_in_file, nothing_to_audit, some_findings, thin_readings
from gradaudit.results import Finding, LimitFinding, Report
from gradaudit.results.comparison import CompareFindingKind, Comparison, SideStats
from gradaudit.results.trend import TrendKind, TrendReport
from gradaudit.results.verdict import exit_code

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
    #: Failures and notes counted but not listed (a case lists at most
    #: :data:`MAX_FLAGGED_ROWS` of each, so a million findings build no line each).
    unlisted_failures: int = 0
    unlisted_notes: int = 0
    error: str | None = None
    skipped: str | None = None
    #: A first line for ``<system-out>``, not one of the notes (the cast check's headroom).
    summary: str | None = None


def _finding_line(finding: Finding) -> str:
    return f"{printable(finding.tensor)}: {printable(finding.message)}"


def _note(report: Report, finding: Finding) -> str:
    if finding.severity is Severity.WARNING:
        return "warning: " + _finding_line(finding)
    pattern = report.thresholds.ignored_by(finding.tensor)
    return f"ignored ({printable(pattern or '')}): " + _finding_line(finding)


def check_cases(report: Report, source: str | None) -> list[Case]:
    """The per-tensor checks (and set limits) of one input of ``report`` as test cases."""
    # The four gradient checks always run; the role checks appear when they applied.
    kinds = [FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING, FindingKind.VANISHING]
    if report.thresholds.cast_check is not None or report.headroom is not None:
        kinds.append(FindingKind.CAST)
    kinds += kinds_in_file(report, source)
    checks = {kind: Case(kind.value) for kind in dict.fromkeys(kinds)}
    for finding_kind, case in checks.items():
        failing, count = some_findings(
            report,
            [Severity.ERROR],
            kind=finding_kind,
            in_file=True,
            source=source,
            limit=MAX_FLAGGED_ROWS,
        )
        case.failures = [_finding_line(finding) for finding in failing]
        case.unlisted_failures = count - len(failing)
        others, count = some_findings(
            report,
            [Severity.WARNING, Severity.IGNORED],
            kind=finding_kind,
            in_file=True,
            source=source,
            limit=MAX_FLAGGED_ROWS,
        )
        case.notes = [_note(report, finding) for finding in others]
        case.unlisted_notes = count - len(others)
        if finding_kind is FindingKind.CAST and report.headroom is not None:
            case.summary = _headroom_line(report.headroom, source)
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


def _headroom_line(headroom: PrecisionReport, source: str | None) -> str:
    """``--precision``: the headroom of the file's tensors together, as one line."""
    row = next((r for r in headroom.files if r.source == source), None)
    what = "no tensor measured" if row is None else summary_sentence(row)
    return f"{headroom.precision.value} headroom of this file: {what}"


def add_suite(
    parent: ET.Element, name: str, cases: list[Case], properties: dict[str, str] | None = None
) -> None:
    """Append a ``<testsuite>`` of ``cases`` to ``parent``, with its counts (and
    ``<properties>``: how the file was read, where that rests on thin evidence)."""
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
    if properties:
        listed = ET.SubElement(suite, "properties")
        for key, value in properties.items():
            ET.SubElement(listed, "property", name=key, value=value)
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
                message=(
                    f"{case.name}: "
                    f"{plural(len(case.failures) + case.unlisted_failures, 'failing finding')}"
                ),
            )
            failure.text = "\n".join(_capped(case.failures, case.unlisted_failures))
        out = [] if case.summary is None else [case.summary]
        if case.notes:
            out += _capped(case.notes, case.unlisted_notes)
        if out:
            ET.SubElement(element, "system-out").text = "\n".join(out)


def _capped(lines: list[str], unlisted: int) -> list[str]:
    """At most :data:`MAX_FLAGGED_ROWS` lines of one case, then how many more there are.

    The counts (``failures``, the failure message) stay exact; only the listing is cut.
    """
    hidden = unlisted + max(0, len(lines) - MAX_FLAGGED_ROWS)
    if not hidden:
        return lines
    return [*lines[:MAX_FLAGGED_ROWS], more_flagged(hidden, "finding")]


def render_scan(report: Report, options: RenderOptions) -> Iterator[str]:
    """One suite per input file, one case per check; an unreadable file is one ``read`` error."""
    root = ET.Element("testsuites", name="gradaudit", time=f"{report.elapsed_s:.3f}")
    errors = {problem.path: problem.message for problem in report.errors}
    thin = thin_readings(report)
    sources: list[str | None] = [f.path for f in report.files] or ([None] if report.tensors else [])
    for source in sources:
        name = IN_MEMORY_SUITE if source is None else printable(source)
        if source is not None and source in errors:
            cases = [Case("read", error=printable(errors[source]))]
        else:
            cases = check_cases(report, source)
        reading = None if source is None else thin.get(source)
        add_suite(root, name, cases, None if reading is None else {"gradaudit.read_as": reading})
    if exit_code(report) is ExitCode.INPUT_ERROR and not report.errors:
        message = nothing_to_audit(report)
        add_suite(root, IN_MEMORY_SUITE, [Case("audit", error=message)])
    yield finish(root)


def finish(root: ET.Element) -> str:
    """The document: the root's totals summed from its suites, indented, with its declaration."""
    suites = list(root)
    for attribute in ("tests", "failures", "errors"):
        root.set(attribute, str(sum(int(s.get(attribute, "0")) for s in suites)))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


# ---------------------------------------------------------------------------- compare


COMPARISON_SUITE = "comparison"
#: The comparison suite's test cases, in order.
CHECKS = ("normalized-ratio", "parameter-change", "shapes-and-dtypes")
NO_SHARED_NAMES = "no tensor names shared by A and B"


def check_name(kind: CompareFindingKind) -> str:
    """The test case a comparison finding belongs to."""
    if kind in (
        CompareFindingKind.ZERO_HOST_NORM,
        CompareFindingKind.ZERO_SEED_NORM,
        CompareFindingKind.ZERO_NORMS,
        CompareFindingKind.RATIO_NOT_COMPUTED,
        CompareFindingKind.RATIO_BELOW_MIN,
        CompareFindingKind.RATIO_ABOVE_MAX,
    ):
        return "normalized-ratio"
    if kind is CompareFindingKind.LARGE_CHANGE:
        return "parameter-change"
    if kind is CompareFindingKind.MISMATCH:
        return "shapes-and-dtypes"
    assert_never(kind)


def _comparison_cases(comparison: Comparison) -> list[Case]:
    if comparison.errors:
        what = plural(len(comparison.errors), "input problem")
        return [Case("compare", error=f"nothing is compared: {what}")]
    cases = {name: Case(name) for name in CHECKS}
    dual = comparison.dual
    raw = "" if dual.raw_ratio is None else f" (raw ratio seed/host {number(dual.raw_ratio)})"
    cases["normalized-ratio"].notes.append(
        ratio_sentence(dual, ab_mode(comparison), compared(comparison)) + raw
    )  # always: the ratio
    if comparison.parameters is None:
        cases["parameter-change"].skipped = NO_SHARED_NAMES
        cases["shapes-and-dtypes"].skipped = NO_SHARED_NAMES
    for finding in comparison.findings:
        # The tensors a finding is about, listed as a scan's case lists its findings:
        # at most MAX_FLAGGED_ROWS, then how many more (a million changed tensors would
        # otherwise be a million lines held in one element).
        subjects, total = finding_subjects(comparison, finding.kind, MAX_FLAGGED_ROWS)
        more = [more_flagged(total - len(subjects), "tensor")] if total > len(subjects) else []
        text = "\n".join([printable(finding.message), *subjects, *more])
        case = cases[check_name(finding.kind)]
        if finding.severity is Severity.ERROR:
            case.failures.append(text)
        else:
            case.notes.append(f"warning: {text}")
    return list(cases.values())


def _side_cases(comparison: Comparison, side: SideStats) -> list[Case]:
    problems = [printable(e.message) for e in comparison.errors if e.path == side.path]
    if problems and not side.params:
        return [Case("read", error="; ".join(problems))]
    return check_cases(comparison.report, side.label)


def render_compare(comparison: Comparison, options: RenderOptions) -> Iterator[str]:
    """The comparison's own checks, then each side's per-tensor checks as a scan's."""
    root = ET.Element(
        "testsuites", name="gradaudit compare", time=f"{comparison.report.elapsed_s:.3f}"
    )
    add_suite(root, COMPARISON_SUITE, _comparison_cases(comparison))
    for side in (comparison.dual.host, comparison.dual.seed):
        name = f"{side.label}: {printable(side_input(side))}"
        add_suite(root, name, _side_cases(comparison, side))
    yield finish(root)


# ---------------------------------------------------------------------------- trend


TREND_SUITE = "trend"


def _trend_cases(report: TrendReport) -> list[Case]:
    if not audited(report):
        what = (
            plural(len(report.errors), "input") + " could not be audited"
            if report.errors
            else "no floating-point tensor in any dump"
        )
        return [Case("audit", error=f"nothing to audit: {what}")]
    cases = {kind: Case(kind.value) for kind in TrendKind}
    for finding in report.findings:
        line = f"{layer_label(finding.layer)}: {printable(finding.message)}"
        if finding.failing:
            cases[finding.kind].failures.append(line)
        else:
            cases[finding.kind].notes.append(f"warning: {line}")
    return list(cases.values())


def render_trend(report: TrendReport, options: RenderOptions) -> Iterator[str]:
    """One case per trend check; one ``read`` error per dump that could not be audited."""
    root = ET.Element("testsuites", name="gradaudit trend", time=f"{report.elapsed_s:.3f}")
    add_suite(root, TREND_SUITE, _trend_cases(report))
    for problem in report.errors:
        path = printable(problem.path)
        add_suite(root, path, [Case("read", error=printable(problem.message))])
    yield finish(root)


RENDERERS = Renderers(scan=render_scan, compare=render_compare, trend=render_trend)
