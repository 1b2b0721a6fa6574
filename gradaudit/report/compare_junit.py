"""``gradaudit compare --format junit``: the comparison as JUnit XML test results.

Three ``<testsuite>`` elements, built with the scan's JUnit helpers:

* ``comparison``: one test case per comparison check. ``normalized-ratio``
  fails on a ratio outside ``--min-ratio``/``--max-ratio`` (or not computable
  under them) and always reports the ratio in ``<system-out>``;
  ``parameter-change`` fails on flagged shared tensors under
  ``--fail-on-change`` (else lists them as warnings); ``shapes-and-dtypes``
  lists mismatches. The last two are ``<skipped>`` when the sides share no
  tensor name.
* ``host: …`` and ``seed: …``: the per-tensor checks of each side, exactly as
  a scan reports one input file (``nan``, ``inf``, ``exploding``,
  ``vanishing``, and the limits that are set). A side that could not be read,
  or holds nothing to compare, is one test case ``read`` with an ``<error>``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from gradaudit._compat import assert_never
from gradaudit.compare.model import CompareFindingKind, Comparison, SideStats
from gradaudit.policy import Severity
from gradaudit.report.base import RenderOptions
from gradaudit.report.compare_text import (
    ab_mode,
    finding_subjects,
    ratio_sentence,
    side_input,
)
from gradaudit.report.junit import Case, add_suite, check_cases, finish
from gradaudit.report.text import number, plural, printable

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
        ratio_sentence(dual, ab_mode(comparison)) + raw
    )  # always: the ratio
    if comparison.parameters is None:
        cases["parameter-change"].skipped = NO_SHARED_NAMES
        cases["shapes-and-dtypes"].skipped = NO_SHARED_NAMES
    for finding in comparison.findings:
        text = "\n".join([finding.message, *finding_subjects(comparison, finding.kind)])
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


def render_comparison_junit(comparison: Comparison, options: RenderOptions) -> str:
    root = ET.Element(
        "testsuites", name="gradaudit compare", time=f"{comparison.report.elapsed_s:.3f}"
    )
    add_suite(root, COMPARISON_SUITE, _comparison_cases(comparison))
    for side in (comparison.dual.host, comparison.dual.seed):
        name = f"{side.label}: {printable(side_input(side))}"
        add_suite(root, name, _side_cases(comparison, side))
    return finish(root)
