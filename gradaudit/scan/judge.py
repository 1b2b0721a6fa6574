"""Host side, pure Python: stats + policy -> findings, and report -> exit code.

What :meth:`~gradaudit.scan.pending.PendingStats.materialize` does after the one
host read is here: each tensor's role (:func:`with_roles`), the gradient
estimates from optimizer state, the findings, their order and the summary. No
torch, no files, no terminal: plain numbers and a policy in, results out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

from gradaudit.errors import ExitCode
from gradaudit.policy import FindingKind, LimitKind, Role, Severity, Thresholds, fraction_exceeds
from gradaudit.results import (
    FileResult,
    Finding,
    GradientEstimate,
    LimitFinding,
    OutlierReference,
    Report,
    Skipped,
    Summary,
    TensorStats,
)
from gradaudit.roles import (
    FileEvidence,
    TensorHint,
    decide,
    describe_file,
    estimate_value,
    file_evidence_text,
    stats_evidence,
)

_OPTIMIZER_STATE = (Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT)


def evaluate(stats: TensorStats, thresholds: Thresholds) -> tuple[Finding, ...]:
    """The findings for one tensor, in a fixed order (NaN, Inf, exploding, vanishing).

    What is checked depends on the tensor's role (``docs/roles.md``):

    * ``gradient``: NaN, Inf, and the norm thresholds. Magnitude checks use the
      norm of the finite elements and are skipped for a tensor with no finite
      element (its NaN/Inf findings already say everything) and for an empty
      tensor (there is nothing to vanish). An all-zero tensor has norm 0 and is
      vanishing.
    * ``weight``: NaN, Inf, an all-zero tensor (a warning by default), and
      ``--cast-check``. No norm thresholds: a norm of 190 is a healthy embedding.
    * optimizer state, buffers, unknown: NaN and Inf only (the optimizer state's
      gradient estimates and negative second moments are judged by
      :func:`evaluate_optimizer_state`).

    A tensor matched by an ``ignore`` pattern still gets its findings, with
    severity ``ignored``, so reports can count and show them.
    """
    found: list[tuple[FindingKind, str]] = []
    where = ""
    if stats.role in _OPTIMIZER_STATE and stats.nonfinite:
        where = " of optimizer state: resuming from this checkpoint would spread it"
    if stats.nan:
        found.append((FindingKind.NAN, f"{stats.nan} NaN of {stats.numel} elements{where}"))
    if stats.pos_inf or stats.neg_inf:
        found.append(
            (
                FindingKind.INF,
                f"{stats.pos_inf} +Inf and {stats.neg_inf} -Inf of {stats.numel} elements{where}",
            )
        )
    if stats.role is Role.WEIGHT:
        found.extend(_weight_checks(stats, thresholds))
    elif stats.role is Role.GRADIENT and stats.finite:
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


def cast_limits(target: str) -> tuple[float, float]:
    """``(overflow_from, flush_from)`` for a ``--cast-check`` target, as ``--precision`` uses.

    A finite value with ``|x| >= overflow_from`` leaves the target's range (Inf, or
    saturated to ±448 by ``fp8_e4m3fn``); a nonzero value with ``|x| < flush_from``
    becomes zero. One table of rounding boundaries serves both checks
    (:data:`gradaudit.precision.FORMATS`).
    """
    from gradaudit.precision import FORMATS, Precision

    spec = FORMATS[Precision(target)]
    return spec.overflow_from, spec.flush_from


def _weight_checks(stats: TensorStats, thresholds: Thresholds) -> list[tuple[FindingKind, str]]:
    found: list[tuple[FindingKind, str]] = []
    if stats.numel and stats.zeros == stats.numel:
        found.append((FindingKind.ALL_ZERO, f"all {stats.numel} elements are zero"))
    target = thresholds.cast_check
    if target is not None and stats.finite:
        overflow, underflow = cast_limits(target)
        if stats.max_abs >= overflow:
            found.append(
                (
                    FindingKind.CAST,
                    f"max |x| {stats.max_abs:.4g} does not fit {target} "
                    f"(values from {overflow:.4g} up overflow)",
                )
            )
        elif 0 < stats.max_abs < underflow:
            found.append(
                (
                    FindingKind.CAST,
                    f"every nonzero value flushes to zero in {target} "
                    f"(max |x| {stats.max_abs:.3g} < {underflow:.3g})",
                )
            )
    return found


def evaluate_optimizer_state(
    estimates: Sequence[GradientEstimate],
    negatives: Sequence[tuple[TensorStats, float]],
    thresholds: Thresholds,
) -> tuple[Finding, ...]:
    """Findings read from optimizer state: negative second moments, and gradient health.

    A second moment is a running sum or average of squares, so a negative value is
    corruption. A gradient's RMS norm estimated from a second moment is judged by the
    same vanishing/exploding thresholds as a gradient in a dump; the finding sits on
    the state tensor (whose name carries the parameter's) and its message names the
    parameter.
    """
    out: list[Finding] = []
    for stats, lowest in negatives:
        message = f"negative values (down to {lowest:.3g}) in a second moment (of squares)"
        kind = FindingKind.NEGATIVE
        out.append(
            Finding(kind, thresholds.severity(kind, stats.name), stats.name, message, stats.source)
        )
    for estimate in estimates:
        value = estimate.rms_norm
        if value is None or not math.isfinite(value):
            continue
        what = f"{estimate.parameter}: estimated gradient RMS norm {value:.3g} ({estimate.basis})"
        if value > thresholds.exploding:
            kind, message = FindingKind.EXPLODING, f"{what} > {thresholds.exploding:.3g}"
        elif value < thresholds.vanishing:
            kind, message = FindingKind.VANISHING, f"{what} < {thresholds.vanishing:.3g}"
        else:
            continue
        out.append(
            Finding(
                kind,
                thresholds.severity(kind, estimate.tensor),
                estimate.tensor,
                message,
                estimate.source,
            )
        )
    return tuple(out)


#: A role with fewer tensors than this in a file has no outlier reference.
OUTLIER_MIN_TENSORS = 8
#: Optimizer state is left out: its moments mirror the gradients, whose health the
#: per-parameter estimates already judge, and an outlier there would only repeat it.
_OUTLIER_ROLES = (Role.GRADIENT, Role.WEIGHT)


def find_outliers(
    tensors: Sequence[TensorStats],
    thresholds: Thresholds,
    findings_so_far: Sequence[Finding] = (),
) -> tuple[tuple[Finding, ...], tuple[OutlierReference, ...]]:
    """Tensors whose RMS sits far from the others of their role in their file.

    Scale-free: on log10 RMS, the reference is the median (robust to the outliers it
    looks for); the spread shown with it is the median absolute deviation times 1.4826
    (a standard deviation for normal data). A tensor is an outlier when it lies more
    than ``outlier_decades`` from the median. The limit is fixed rather than a multiple
    of the spread: a healthy model's roles mix tensor kinds (LayerNorm scales near 1,
    matrices near 0.02), so its spread is wide, and a multiple of it would hide a layer
    scaled by 1e3. Left out: tensors with no finite element or an RMS of 0 (other checks
    cover them), roles with fewer than 8 tensors in a file, and tensors that already
    have a magnitude finding in ``findings_so_far`` (exploding, vanishing, all-zero):
    the outlier check is for what an absolute threshold cannot see.
    """
    magnitude = (FindingKind.EXPLODING, FindingKind.VANISHING, FindingKind.ALL_ZERO)
    already = {(f.source, f.tensor) for f in findings_so_far if f.kind in magnitude}
    groups: dict[tuple[str | None, Role, str], list[TensorStats]] = {}
    for stats in tensors:
        if stats.role in _OUTLIER_ROLES and stats.rms is not None and stats.rms > 0:
            groups.setdefault((stats.source, stats.role, _shape_class(stats)), []).append(stats)
    findings: list[Finding] = []
    references: list[OutlierReference] = []
    for (source, role, shapes), members in groups.items():
        if len(members) < OUTLIER_MIN_TENSORS:
            continue
        logs = [math.log10(t.rms) for t in members if t.rms is not None]
        median = statistics.median(logs)
        spread = 1.4826 * statistics.median(abs(x - median) for x in logs)
        limit = thresholds.outlier_limit(role)
        references.append(
            OutlierReference(role, source, len(members), median, spread, limit, shapes)
        )
        for stats, x in zip(members, logs, strict=True):
            distance = x - median
            if abs(distance) <= limit:
                continue
            direction = "above" if distance > 0 else "below"
            message = (
                f"RMS {stats.rms:.3g} is {abs(distance):.1f} decades {direction} the median "
                f"{10**median:.3g} of {len(members)} {role.value} tensors"
                f"{'' if shapes == 'all' else f' ({shapes})'} (limit {limit:.1f})"
            )
            kind = FindingKind.OUTLIER
            if (source, stats.name) in already:
                continue
            findings.append(
                Finding(kind, thresholds.severity(kind, stats.name), stats.name, message, source)
            )
    return tuple(findings), tuple(references)


def _shape_class(stats: TensorStats) -> str:
    """The group a tensor is compared within: gradients of vectors (biases, norm scales)
    and of matrices sit decades apart in healthy models, weights do not (measured)."""
    if stats.role is not Role.GRADIENT:
        return "all"
    return "1-D" if len(stats.shape) <= 1 else "2-D+"


def gradient_health(tensors: Sequence[TensorStats], findings: Sequence[Finding]) -> float:
    """One number in [0, 1] for dashboards and gates: 1 is a clean audit.

    ``health = clean / N * finite / N * (1/2 if any element is NaN or Inf else 1)``,
    where ``N`` is the number of audited elements, ``clean`` the elements in tensors
    without a failing or warning finding (ignored findings do not count against it)
    and ``finite`` the finite elements. A single NaN halves the score however small
    its tensor, so a non-finite value is never lost in the rounding of a large model.
    Nothing audited scores 0: no evidence of health.
    """
    total = sum(t.numel for t in tensors)
    if total == 0:
        return 0.0
    flagged = {(f.source, f.tensor) for f in findings if f.severity is not Severity.IGNORED}
    clean = sum(t.numel for t in tensors if (t.source, t.name) not in flagged)
    nonfinite = sum(t.nonfinite for t in tensors)
    score = (clean / total) * ((total - nonfinite) / total) * (0.5 if nonfinite else 1.0)
    return min(1.0, max(0.0, score))


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


def with_roles(
    tensors: list[TensorStats],
    hints: list[TensorHint | None],
    thresholds: Thresholds,
    file_evidence: Mapping[str, FileEvidence],
) -> tuple[tuple[TensorStats, ...], dict[str | None, tuple[str, str, bool]]]:
    """Each tensor with its role decided (:func:`gradaudit.roles.decide`), per file.

    ``file_evidence`` is what each file's metadata says it holds (see
    :meth:`~gradaudit.scan.pending.PendingStats.read_hints`).

    Returns the tensors and, per source, ``(read as, evidence, thin)``.
    """
    by_source: dict[str | None, list[int]] = {}
    for index, stats in enumerate(tensors):
        by_source.setdefault(stats.source, []).append(index)
    out = list(tensors)
    readings: dict[str | None, tuple[str, str, bool]] = {}
    for source, indices in by_source.items():
        if source is None:
            file_role = FileEvidence(Role.GRADIENT, "tensors from memory: gradients")
        else:
            file_role = file_evidence.get(source) or stats_evidence([tensors[i] for i in indices])
        roles, evidences = [], []
        for i in indices:
            stats = tensors[i]
            role, evidence = decide(stats.name, hints[i], thresholds.kind, file_role)
            roles.append(role)
            evidences.append(evidence)
            out[i] = _with_role(stats, role, evidence)
        thin = file_role.thin and any(e == file_role.evidence for e in evidences)
        readings[source] = (
            describe_file(roles, file_role, evidences),
            file_evidence_text(roles, evidences, file_role),
            thin,
        )
    return tuple(out), readings


def _with_role(stats: TensorStats, role: Role, evidence: str) -> TensorStats:
    """``stats`` with its role; built without ``dataclasses.replace``, which re-validates."""
    copy = object.__new__(TensorStats)
    copy.__dict__.update(stats.__dict__, role=role, role_evidence=evidence)
    return copy


def in_tensor_order(
    tensors: Sequence[TensorStats], findings: Sequence[Finding]
) -> tuple[Finding, ...]:
    """Findings grouped tensor by tensor, in the tensors' order (each tensor's own order kept)."""
    order = {(t.source, t.name): i for i, t in enumerate(tensors)}
    return tuple(sorted(findings, key=lambda f: order.get((f.source, f.tensor), len(order))))


def gradient_estimates(
    tensors: Sequence[TensorStats],
    hints: Sequence[TensorHint | None],
    derived: Mapping[tuple[str | None, str | None, str], TensorStats],
) -> tuple[tuple[GradientEstimate, ...], list[tuple[TensorStats, float]]]:
    """Per-parameter gradient estimates from optimizer state, and negative second moments.

    One estimate per parameter and file: the RMS norm from its second moment, the mean
    norm from its first moment (see :func:`gradaudit.roles.estimate_value`).
    """
    merged: dict[tuple[str | None, str], GradientEstimate] = {}
    negatives: list[tuple[TensorStats, float]] = []
    for stats, hint in zip(tensors, hints, strict=True):
        if stats.role not in (Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT):
            continue
        lowest = derived.get((stats.source, stats.name, "neg"))
        if lowest is not None and lowest.finite and lowest.max_abs > 0:
            negatives.append((stats, -lowest.max_abs))
        total = derived.get((stats.source, stats.name, "sum"))
        if hint is None or hint.basis is None:
            continue
        basis = hint.basis
        step_row = derived.get((stats.source, stats.name, "step"))
        step = basis.step if step_row is None else step_row.max_abs
        rms, mean, corrected = estimate_value(
            basis, stats.norm, total.max_abs if total is not None and total.finite else None, step
        )
        if rms is None and mean is None:
            continue
        key = stats.name.split(" (", 1)[0].rsplit(".", 1)[0]
        parameter = hint.param or key
        what = stats.name.split(" (", 1)[0].rsplit(".", 1)[-1]
        label = f"from {what}"
        if corrected and step:
            label += f", bias-corrected at step {step:g}"
        previous = merged.get((stats.source, parameter))
        if previous is None:
            previous = GradientEstimate(parameter, stats.name, stats.source, label)
        if rms is not None:
            previous = dataclasses.replace(
                previous,
                tensor=stats.name,
                basis=label,
                rms_norm=rms,
                step=step,
                bias_corrected=corrected,
            )
        else:
            previous = dataclasses.replace(previous, mean_norm=mean)
            if previous.rms_norm is None:
                previous = dataclasses.replace(
                    previous, tensor=stats.name, basis=label, step=step, bias_corrected=corrected
                )
        merged[(stats.source, parameter)] = previous
    return tuple(merged.values()), negatives


def summarize(
    tensors: Sequence[TensorStats],
    findings: Sequence[Finding],
    limit_findings: Sequence[LimitFinding],
    skipped: int,
    global_norm: float,
    excluded: int = 0,
) -> Summary:
    def flagged(kind: FindingKind) -> int:
        return len({(f.source, f.tensor) for f in findings if f.kind is kind and not f.ignored})

    return Summary(
        tensors=len(tensors),
        skipped=skipped,
        elements=sum(t.numel for t in tensors),
        global_norm=global_norm,
        nan_tensors=flagged(FindingKind.NAN),
        inf_tensors=flagged(FindingKind.INF),
        vanishing_tensors=flagged(FindingKind.VANISHING),
        exploding_tensors=flagged(FindingKind.EXPLODING),
        outlier_tensors=flagged(FindingKind.OUTLIER),
        gradient_health=gradient_health(tensors, findings),
        failing_findings=sum(1 for f in findings if f.failing) + len(limit_findings),
        warnings=sum(1 for f in findings if f.severity is Severity.WARNING),
        ignored_findings=sum(1 for f in findings if f.ignored),
        excluded=excluded,
    )
