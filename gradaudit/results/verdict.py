"""The one place a result becomes an exit code: a scan's :class:`Report` (its findings
include ``--precision``'s headroom findings), a :class:`Comparison`, a :class:`TrendReport`.

The renderers print the verdict these functions decide (``OK`` / ``FAIL`` /
``INCOMPLETE``) and the CLI exits with it; neither decides one itself. Pure Python:
the CLI imports this module at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from gradaudit.errors import ExitCode
from gradaudit.policy import Severity
from gradaudit.results import Finding, Report
from gradaudit.results.comparison import Comparison
from gradaudit.results.trend import TrendReport

__all__ = ["comparison_exit_code", "exit_code", "trend_exit_code"]


@runtime_checkable
class SeverityColumns(Protocol):
    """Findings held as columns (:class:`~gradaudit.scan.finding_table.FindingTable`):
    their severities are read on the column, with no :class:`Finding` built. A protocol,
    so this module imports neither numpy nor the scan stage."""

    def severity_is(self, severity: Severity) -> Any: ...


def exit_code(report: Report) -> ExitCode:
    """The exit policy, in order of precedence.

    1. A defect in gradaudit met while auditing an input (an :class:`InputProblem` with
       ``internal``) -> INTERNAL_ERROR: the other inputs are reported, but a bug beats
       every verdict, as it would have had it ended the run.
    2. An input could not be audited, or nothing at all was audited (no tensor and no
       logged training history) -> INPUT_ERROR.
       Errors beat findings: an incomplete audit never passes.
    3. A finding the policy fails on, or an exceeded limit -> FINDINGS.
    4. Otherwise OK (warnings and ignored findings do not fail).

    USAGE_ERROR never reaches a report, nor does a defect outside any one input's audit:
    they are raised.
    """
    if any(problem.internal for problem in report.errors):
        return ExitCode.INTERNAL_ERROR
    if report.errors or report.audited_nothing:
        return ExitCode.INPUT_ERROR
    if report.limit_findings or _any_failing(report.findings):
        return ExitCode.FINDINGS
    return ExitCode.OK


def _any_failing(findings: Sequence[Finding]) -> bool:
    """Whether a finding fails the run (on the severity column of a FindingTable)."""
    if isinstance(findings, SeverityColumns):
        return bool(findings.severity_is(Severity.ERROR).any())
    return any(finding.failing for finding in findings)


def comparison_exit_code(comparison: Comparison) -> ExitCode:
    """The exit policy of a comparison, with the precedence of :func:`exit_code`.

    1. An input could not be read, or a side has nothing to compare -> INPUT_ERROR.
    2. A failing per-tensor finding (``--fail-on``) or a failing comparison finding
       (a ratio outside ``--min-ratio``/``--max-ratio`` or not computable under them,
       a large change with ``--fail-on-change``) -> FINDINGS.
    3. Otherwise OK.
    """
    code = exit_code(comparison.report)
    if code is not ExitCode.OK:
        return code
    if any(finding.failing for finding in comparison.findings):
        return ExitCode.FINDINGS
    return ExitCode.OK


def trend_exit_code(report: TrendReport) -> ExitCode:
    """The same precedence as ``scan``: errors, then failing findings, then OK.

    A dump that could not be audited, or a series with no audited tensor at all,
    is INPUT_ERROR: a trend with holes never passes.
    """
    if any(problem.internal for problem in report.errors):
        return ExitCode.INTERNAL_ERROR
    if report.errors or not any(step.tensors for step in report.steps):
        return ExitCode.INPUT_ERROR
    if any(finding.failing for finding in report.findings):
        return ExitCode.FINDINGS
    return ExitCode.OK
