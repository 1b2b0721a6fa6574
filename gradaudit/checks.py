"""Host side, pure Python: stats + policy -> findings, and report -> exit code."""

from __future__ import annotations

from collections.abc import Iterable

from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, Thresholds
from gradaudit.results import Finding, Report, TensorStats


def evaluate(stats: TensorStats, thresholds: Thresholds) -> tuple[Finding, ...]:
    """The findings for one tensor, in a fixed order (NaN, Inf, exploding, vanishing).

    Magnitude checks use the norm of the finite elements and are skipped for a
    tensor with no finite element (its NaN/Inf findings already say everything)
    and for an empty tensor (there is nothing to vanish). An all-zero tensor
    has norm 0 and is vanishing.
    """
    found: list[tuple[FindingKind, str]] = []
    if stats.nan:
        found.append((FindingKind.NAN, f"{stats.nan} NaN of {stats.numel} elements"))
    if stats.pos_inf or stats.neg_inf:
        found.append(
            (
                FindingKind.INF,
                f"{stats.pos_inf} +Inf and {stats.neg_inf} -Inf of {stats.numel} elements",
            )
        )
    if stats.finite:
        if stats.norm > thresholds.exploding:
            found.append(
                (
                    FindingKind.EXPLODING,
                    f"norm {stats.norm:.3g} > exploding threshold {thresholds.exploding:.3g}",
                )
            )
        elif stats.norm < thresholds.vanishing:
            found.append(
                (
                    FindingKind.VANISHING,
                    f"norm {stats.norm:.3g} < vanishing threshold {thresholds.vanishing:.3g}",
                )
            )
    return tuple(
        Finding(kind, thresholds.severity(kind), stats.name, message, stats.source)
        for kind, message in found
    )


def evaluate_all(tensors: Iterable[TensorStats], thresholds: Thresholds) -> tuple[Finding, ...]:
    return tuple(finding for stats in tensors for finding in evaluate(stats, thresholds))


def exit_code(report: Report) -> ExitCode:
    """The exit policy, in order of precedence.

    1. An input could not be audited, or nothing at all was audited -> INPUT_ERROR.
       Errors beat findings: an incomplete audit never passes.
    2. A finding the policy fails on -> FINDINGS.
    3. Otherwise OK.

    USAGE_ERROR and INTERNAL_ERROR never reach a report: they are raised.
    """
    if report.errors or report.summary.tensors == 0:
        return ExitCode.INPUT_ERROR
    if any(finding.failing for finding in report.findings):
        return ExitCode.FINDINGS
    return ExitCode.OK
