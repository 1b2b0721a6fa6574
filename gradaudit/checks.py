"""Host side, pure Python: stats + policy -> findings, and report -> exit code."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, LimitKind, Thresholds, fraction_exceeds
from gradaudit.results import FileResult, Finding, LimitFinding, Report, Skipped, TensorStats


def evaluate(stats: TensorStats, thresholds: Thresholds) -> tuple[Finding, ...]:
    """The findings for one tensor, in a fixed order (NaN, Inf, exploding, vanishing).

    Magnitude checks use the norm of the finite elements and are skipped for a
    tensor with no finite element (its NaN/Inf findings already say everything)
    and for an empty tensor (there is nothing to vanish). An all-zero tensor
    has norm 0 and is vanishing. A tensor matched by an ``ignore`` pattern
    still gets its findings, with severity ``ignored``, so reports can count
    and show them.
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
    if not found:  # the common case, kept cheap: it runs once per tensor
        return ()
    return tuple(
        Finding(kind, thresholds.severity(kind, stats.name), stats.name, message, stats.source)
        for kind, message in found
    )


def evaluate_all(tensors: Iterable[TensorStats], thresholds: Thresholds) -> tuple[Finding, ...]:
    return tuple(finding for stats in tensors for finding in evaluate(stats, thresholds))


def evaluate_skipped(skipped: Iterable[Skipped], thresholds: Thresholds) -> tuple[Finding, ...]:
    """A ``skipped`` finding for each tensor whose values could hide a NaN but were not read.

    A warning by default and an error with ``--fail-on skipped``: either way an
    audit that could not see everything does not say a plain "OK".
    """
    kind = FindingKind.SKIPPED
    return tuple(
        Finding(
            kind,
            thresholds.severity(kind, s.name),
            s.name,
            s.reason,  # every such reason says "not audited"
            s.source,
        )
        for s in skipped
        if s.unaudited
    )


def evaluate_limits(
    tensors: Sequence[TensorStats],
    findings: Sequence[Finding],
    files: Sequence[FileResult],
    global_norm: float,
    thresholds: Thresholds,
) -> tuple[LimitFinding, ...]:
    """The run-level limits that were exceeded, per input file.

    A limit is judged per file because a file is one gradient dump (one step);
    tensors audited from memory (no file results) are judged as one whole.
    The global norm covers every tensor, ignored ones included: ``--ignore``
    silences findings on tensors, it does not edit the gradient. The vanishing
    fraction is over the tensors that are not ignored.
    """
    if thresholds.max_global_norm is None and thresholds.max_vanishing_fraction is None:
        return ()
    groups: list[tuple[str | None, float | None]] = (
        [(f.path, f.global_norm) for f in files if f.tensors]
        if files
        else ([(None, global_norm)] if tensors else [])
    )
    vanishing = {
        (f.source, f.tensor) for f in findings if f.kind is FindingKind.VANISHING and not f.ignored
    }
    out: list[LimitFinding] = []
    for source, norm in groups:
        where = "" if source is None else f" in {source}"
        limit = thresholds.max_global_norm
        if limit is not None and norm is not None and not norm <= limit:
            out.append(
                LimitFinding(
                    LimitKind.GLOBAL_NORM,
                    norm,
                    limit,
                    f"global norm {norm:.3g}{where} > max-global-norm {limit:.3g}",
                    source,
                )
            )
        fraction = thresholds.max_vanishing_fraction
        if fraction is not None:
            judged = [
                t
                for t in tensors
                if (not files or t.source == source) and thresholds.ignored_by(t.name) is None
            ]
            dead = sum(1 for t in judged if (t.source, t.name) in vanishing)
            if fraction_exceeds(dead, len(judged), fraction):
                out.append(
                    LimitFinding(
                        LimitKind.VANISHING_FRACTION,
                        dead / len(judged),
                        fraction,
                        f"{dead} of {len(judged)} tensors vanish{where} "
                        f"({dead / len(judged):.1%} > max-vanishing-fraction {fraction:g})",
                        source,
                    )
                )
    return tuple(out)


def exit_code(report: Report) -> ExitCode:
    """The exit policy, in order of precedence.

    1. An input could not be audited, or nothing at all was audited -> INPUT_ERROR.
       Errors beat findings: an incomplete audit never passes.
    2. A finding the policy fails on, or an exceeded limit -> FINDINGS.
    3. Otherwise OK (warnings and ignored findings do not fail).

    USAGE_ERROR and INTERNAL_ERROR never reach a report: they are raised.
    """
    if report.errors or report.summary.tensors == 0:
        return ExitCode.INPUT_ERROR
    if report.limit_findings or any(finding.failing for finding in report.findings):
        return ExitCode.FINDINGS
    return ExitCode.OK
