"""Host side, pure Python: stats + policy -> findings, and report -> exit code.

What :meth:`~gradaudit.scan.pending.PendingStats.materialize` does after the one
host read is here: each tensor's role (:func:`with_roles`), the gradient
estimates from optimizer state, the findings, their order and the summary. No
torch, no files, no terminal: plain numbers and a policy in, results out.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from gradaudit.errors import ExitCode
from gradaudit.policy import (
    FindingKind,
    InputKind,
    LimitKind,
    Role,
    Severity,
    Thresholds,
    fraction_exceeds,
)
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
    name_templates,
    name_word_mask,
    stats_evidence,
)

if TYPE_CHECKING:
    import numpy as np

    from gradaudit.finding_table import FindingTable
    from gradaudit.stats_table import StatsTable

_OPTIMIZER_STATE = (Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT)


def _columns(tensors: Iterable[TensorStats]) -> StatsTable:
    """``tensors`` as a :class:`~gradaudit.stats_table.StatsTable` (itself when it is one).

    numpy is imported here, not with the module: the CLI's start-up path imports
    this module for :func:`exit_code` and must stay free of torch and numpy.
    """
    from gradaudit.stats_table import StatsTable

    return StatsTable.from_stats(tensors if isinstance(tensors, Sequence) else list(tensors))


def _column_findings(table: StatsTable, findings: Sequence[Finding]) -> FindingTable | None:
    """``findings`` when they are a :class:`~gradaudit.finding_table.FindingTable` over
    ``table`` (their counts and sets are then read on the columns), else ``None``."""
    from gradaudit.finding_table import FindingTable

    if isinstance(findings, FindingTable) and findings.table is table:
        return findings
    return None


def flagged_indices(
    table: StatsTable,
    findings: Sequence[Finding],
    kinds: Iterable[FindingKind] | None = None,
    *,
    ignored: bool = True,
) -> np.ndarray:
    """Indices (ascending) of the tensors with a finding of ``kinds`` (any kind: ``None``);
    ``ignored=False`` leaves out the ignored findings."""
    import numpy as np

    wanted = None if kinds is None else tuple(kinds)
    columns = _column_findings(table, findings)
    if columns is not None:
        mask = np.ones(len(columns), dtype=bool) if wanted is None else columns.kind_is(*wanted)
        if not ignored:
            mask &= ~columns.severity_is(Severity.IGNORED)
        return columns.tensors_where(mask)
    keys = {
        (f.source, f.tensor)
        for f in findings
        if (wanted is None or f.kind in wanted) and (ignored or not f.ignored)
    }
    return tensor_indices(table, keys)


def tensor_indices(table: StatsTable, keys: Iterable[tuple[str | None, str]]) -> np.ndarray:
    """Indices (ascending) of the tensors named by ``(source, name)`` pairs.

    One pass over the names in C (a set lookup each) instead of a dict of every
    tensor: a million tensors with a handful of findings build nothing per tensor.
    """
    import numpy as np

    wanted = set(keys)
    if not wanted:
        return np.zeros(0, dtype=np.int64)
    names = {name for _, name in wanted}
    hits = np.fromiter(map(names.__contains__, table.names), dtype=bool, count=len(table))
    candidates = np.flatnonzero(hits)
    sources, codes = table.sources, table.source_codes
    keep = [
        index
        for index in candidates.tolist()
        if (sources[codes[index]], table.names[index]) in wanted
    ]
    return np.array(keep, dtype=np.int64)


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


def evaluate_all(tensors: Iterable[TensorStats], thresholds: Thresholds) -> FindingTable:
    """:func:`evaluate` for every tensor, in tensor order, as a
    :class:`~gradaudit.finding_table.FindingTable`.

    Which tensors have findings, and of which kinds, is decided on the columns at
    once (the same comparisons as :func:`evaluate`); each finding is built by
    :func:`evaluate` when it is asked for: a million flagged tiny tensors hold no
    object each.
    """
    from gradaudit.finding_table import FindingTable

    return FindingTable.judge(_columns(tensors), thresholds)


def judged_candidates(table: StatsTable, thresholds: Thresholds) -> np.ndarray:
    """Indices of the tensors :func:`evaluate` may flag (every one it flags is among them)."""
    import numpy as np

    finite = table.finite > 0
    norm = table.norm
    gradient = table.role_mask(Role.GRADIENT) & finite
    gradient &= (norm > thresholds.exploding) | (norm < thresholds.vanishing)
    weight = table.role_mask(Role.WEIGHT)
    if thresholds.cast_check is None:
        weight &= (table.numel > 0) & (table.zeros == table.numel)
    mask = (table.nonfinite > 0) | gradient | weight
    return np.flatnonzero(mask)


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

    Computed on the columns (:class:`~gradaudit.stats_table.StatsTable`): the logs with
    ``math.log10`` and the medians as :func:`statistics.median` takes them (the mean of
    the two middle values), so the numbers are those of a loop over the tensors.
    """
    import numpy as np

    from gradaudit.stats_table import ROLES

    table = _columns(tensors)
    magnitude = (FindingKind.EXPLODING, FindingKind.VANISHING, FindingKind.ALL_ZERO)
    # A mask, not a set of indices: with a million flagged tensors (an all-zero dump) a
    # set of Python ints was the scan's peak memory (~70 MB), for no eligible tensor.
    already = np.zeros(len(table), dtype=bool)
    already[flagged_indices(table, findings_so_far, magnitude)] = True
    rms = table.rms
    with np.errstate(invalid="ignore"):
        eligible = rms > 0  # NaN (no finite element) compares False
    roles = table.role_codes
    eligible &= np.isin(roles, [ROLES.index(role) for role in _OUTLIER_ROLES])
    # The group a tensor is compared within: gradients of vectors (biases, norm scales)
    # and of matrices sit decades apart in healthy models, weights do not (measured).
    gradient = roles == ROLES.index(Role.GRADIENT)
    shape_class = np.where(gradient, np.where(table.ranks <= 1, 1, 2), 0)
    indices = np.flatnonzero(eligible)
    keys = (table.source_codes[indices].astype(np.int64) * len(ROLES) + roles[indices]) * 3
    keys += shape_class[indices]
    unique, first, counts = np.unique(keys, return_index=True, return_counts=True)
    labels = ("all", "1-D", "2-D+")
    findings: list[Finding] = []
    references: list[OutlierReference] = []
    for key_index in np.argsort(first, kind="stable").tolist():  # groups in first-seen order
        if counts[key_index] < OUTLIER_MIN_TENSORS:
            continue
        members = indices[keys == unique[key_index]]
        first_member = int(members[0])
        source = table.sources[table.source_codes[first_member]]
        role = ROLES[roles[first_member]]
        shapes = labels[int(shape_class[first_member])]
        member_rms = rms[members]
        logs = _log10(member_rms)
        median = _median(logs)
        spread = 1.4826 * _median(np.abs(logs - median))
        limit = thresholds.outlier_limit(role)
        references.append(
            OutlierReference(role, source, len(members), median, spread, limit, shapes)
        )
        distance = logs - median
        for where in np.flatnonzero(np.abs(distance) > limit).tolist():
            member = int(members[where])
            if already[member]:
                continue
            name = table.names[member]
            away = float(distance[where])
            direction = "above" if away > 0 else "below"
            message = (
                f"RMS {float(member_rms[where]):.3g} is {abs(away):.1f} decades {direction} the "
                f"median {10**median:.3g} of {len(members)} {role.value} tensors"
                f"{'' if shapes == 'all' else f' ({shapes})'} (limit {limit:.1f})"
            )
            kind = FindingKind.OUTLIER
            findings.append(Finding(kind, thresholds.severity(kind, name), name, message, source))
    return tuple(findings), tuple(references)


#: Values turned into Python floats at once by :func:`_log10`.
_LOG_CHUNK = 1 << 16


def _log10(values: np.ndarray) -> np.ndarray:
    """``math.log10`` of each value (libm's, as a loop over the tensors computes it; numpy's
    own may differ in the last bit), a chunk at a time: a million values as Python floats
    at once were 32 MB, the largest part of a big scan's peak memory."""
    import numpy as np

    logs = np.empty(len(values), dtype=np.float64)
    for start in range(0, len(values), _LOG_CHUNK):
        chunk = values[start : start + _LOG_CHUNK].tolist()
        logs[start : start + len(chunk)] = np.fromiter(
            map(math.log10, chunk), dtype=np.float64, count=len(chunk)
        )
    return logs


def _median(values: np.ndarray) -> float:
    """:func:`statistics.median` of a float64 array: the middle value, or the mean of two."""
    import numpy as np

    ordered = np.sort(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2


def gradient_health(tensors: Sequence[TensorStats], findings: Sequence[Finding]) -> float:
    """One number in [0, 1] for dashboards and gates: 1 is a clean audit.

    ``health = clean / N * finite / N * (1/2 if any element is NaN or Inf else 1)``,
    where ``N`` is the number of audited elements, ``clean`` the elements in tensors
    without a failing or warning finding (ignored findings do not count against it)
    and ``finite`` the finite elements. A single NaN halves the score however small
    its tensor, so a non-finite value is never lost in the rounding of a large model.
    Nothing audited scores 0: no evidence of health.
    """
    table = _columns(tensors)
    total = int(table.numel.sum())
    if total == 0:
        return 0.0
    flagged = flagged_indices(table, findings, ignored=False)
    clean = total - int(table.numel[flagged].sum())
    nonfinite = int(table.nonfinite.sum())
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
    table = _columns(tensors)
    vanishing = flagged_indices(table, findings, (FindingKind.VANISHING,), ignored=False)
    dead_indices = set(vanishing.tolist())
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
            judged: Sequence[int] = (
                table.source_indices(source).tolist() if files else range(len(table))
            )
            if thresholds.ignore:
                names = table.names
                judged = [i for i in judged if thresholds.ignored_by(names[i]) is None]
            dead = len(dead_indices.intersection(judged))
            count = len(judged)
            if fraction_exceeds(dead, count, fraction):
                out.append(
                    LimitFinding(
                        LimitKind.VANISHING_FRACTION,
                        dead / count,
                        fraction,
                        f"{dead} of {count} tensors vanish{where} "
                        f"({dead / count:.1%} > max-vanishing-fraction {fraction:g})",
                        source,
                    )
                )
    return tuple(out)


def exit_code(report: Report) -> ExitCode:
    """The exit policy, in order of precedence.

    1. An input could not be audited, or nothing at all was audited (no tensor and no
       logged training history) -> INPUT_ERROR.
       Errors beat findings: an incomplete audit never passes.
    2. A finding the policy fails on, or an exceeded limit -> FINDINGS.
    3. Otherwise OK (warnings and ignored findings do not fail).

    USAGE_ERROR and INTERNAL_ERROR never reach a report: they are raised.
    """
    if report.errors or report.audited_nothing:
        return ExitCode.INPUT_ERROR
    if report.limit_findings or _any_failing(report.findings):
        return ExitCode.FINDINGS
    return ExitCode.OK


def _any_failing(findings: Sequence[Finding]) -> bool:
    """Whether a finding fails the run (on the severity column of a FindingTable)."""
    if type(findings).__name__ == "FindingTable":  # numpy is not imported here for a tuple
        from gradaudit.finding_table import FindingTable

        if isinstance(findings, FindingTable):
            return bool(findings.severity_is(Severity.ERROR).any())
    return any(finding.failing for finding in findings)


def with_roles(
    table: StatsTable,
    hints: Sequence[TensorHint | None],
    thresholds: Thresholds,
    file_evidence: Mapping[str, FileEvidence],
) -> dict[str | None, tuple[str, str, bool]]:
    """Each tensor's role decided (:func:`gradaudit.roles.decide`), set on ``table``'s columns.

    ``file_evidence`` is what each file's metadata says it holds (see
    :meth:`~gradaudit.scan.pending.PendingStats.read_hints`).

    Returns, per source, ``(read as, evidence, thin)`` for the file's summary. Only
    tensors with a hint are decided one by one, and those with a name
    :func:`role_from_name` may read once per name template
    (:func:`~gradaudit.roles.name_templates`); every other tensor of a file takes the
    file's role (or ``--kind``), which is what :func:`decide` gives it, so a million
    plainly named tensors cost a few string searches
    (:func:`~gradaudit.roles.name_word_mask`).
    """
    import numpy as np

    from gradaudit.stats_table import ROLES, coded

    kind = thresholds.kind
    names = table.names
    count = len(names)
    special = name_word_mask(names)
    hinted = np.zeros(count, dtype=bool)
    if hints.count(None) != len(hints):  # C speed: most collections hold no hint
        hinted = np.fromiter((hint is not None for hint in hints), dtype=bool, count=count)
    role_codes = np.zeros(count, dtype=np.int8)
    evidence_codes = np.zeros(count, dtype=np.int32)
    evidences: dict[str, int] = {"": 0}

    def code_of(evidence: str) -> int:
        return evidences.setdefault(evidence, len(evidences))

    optimizer = [ROLES.index(role) for role in _OPTIMIZER_STATE]
    readings: dict[str | None, tuple[str, str, bool]] = {}
    for source_code, source in enumerate(table.sources):
        indices = np.flatnonzero(table.source_codes == source_code)
        if not len(indices):
            continue
        if source is None:
            file_role = FileEvidence(Role.GRADIENT, "tensors from memory: gradients")
        else:
            file_role = file_evidence.get(source) or stats_evidence(
                table, None if len(indices) == count else indices
            )
        if kind is InputKind.GRADIENTS:
            default = Role.GRADIENT, "--kind gradients"
        elif kind is InputKind.WEIGHTS:
            default = Role.WEIGHT, "--kind weights"
        else:
            default = file_role.role, file_role.evidence
        role_codes[indices] = ROLES.index(default[0])
        evidence_codes[indices] = code_of(default[1])
        # Plainly named tensors keep the default; those a name may decide are decided
        # once per name template (``params.0.grad``), hinted ones one by one.
        by_name = indices[special[indices] & ~hinted[indices]]
        if len(by_name):
            # (All of them: the indices are sorted, so they are 0 … count - 1.)
            read = names if len(by_name) == count else [names[i] for i in by_name.tolist()]
            keys, which = coded(name_templates(read), np.int64)
            decided = [decide(template, None, kind, file_role) for template in keys]
            role_codes[by_name] = np.array([ROLES.index(role) for role, _ in decided], np.int8)[
                which
            ]
            evidence_codes[by_name] = np.array([code_of(e) for _, e in decided], np.int32)[which]
        for index in indices[hinted[indices]].tolist():
            role, evidence = decide(names[index], hints[index], kind, file_role)
            role_codes[index] = ROLES.index(role)
            evidence_codes[index] = code_of(evidence)
        roles, their_evidences = role_codes[indices], evidence_codes[indices]
        role_counts = Counter(
            {ROLES[c]: n for c, n in enumerate(np.bincount(roles, minlength=len(ROLES))) if n}
        )
        rest = their_evidences[~np.isin(roles, optimizer)]
        unique, first, counts = np.unique(rest, return_index=True, return_counts=True)
        by_text = list(evidences)
        rest_counts = Counter(
            {by_text[unique[k]]: int(counts[k]) for k in np.argsort(first, kind="stable")}
        )
        thin = file_role.thin and bool(
            (their_evidences == evidences.get(file_role.evidence, -1)).any()
        )
        readings[source] = (
            describe_file(role_counts, file_role),
            file_evidence_text(rest_counts, len(rest) < len(indices), file_role),
            thin,
        )
    table.with_roles(role_codes, evidence_codes, tuple(evidences))
    return readings


def in_tensor_order(
    table: StatsTable, findings: Sequence[Finding]
) -> FindingTable | tuple[Finding, ...]:
    """Findings grouped tensor by tensor, in the tensors' order (each tensor's own order kept).

    Only the flagged tensors are looked up (:func:`tensor_indices`); a
    :class:`~gradaudit.finding_table.FindingTable` is sorted on its columns.
    """
    columns = _column_findings(table, findings)
    if columns is not None:
        return columns.in_tensor_order()
    keys = {(f.source, f.tensor) for f in findings}
    found = tensor_indices(table, keys).tolist()
    sources, codes, names = table.sources, table.source_codes, table.names
    order = {(sources[codes[i]], names[i]): i for i in found}
    return tuple(sorted(findings, key=lambda f: order.get((f.source, f.tensor), len(table))))


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
    tensors: StatsTable,
    findings: Sequence[Finding],
    limit_findings: Sequence[LimitFinding],
    skipped: int,
    global_norm: float,
    excluded: int = 0,
) -> Summary:
    columns = _column_findings(tensors, findings)
    severities: Counter[Severity] = Counter()
    if columns is not None:  # a million flagged tensors: counted on the columns
        import numpy as np

        from gradaudit.finding_table import SEVERITIES

        counts = np.bincount(columns.severities, minlength=len(SEVERITIES)).tolist()
        severities.update(dict(zip(SEVERITIES, counts, strict=True)))

        def count(kind: FindingKind) -> int:
            on_table = len(flagged_indices(tensors, columns, (kind,), ignored=False))
            mask = columns.kind_is(kind) & ~columns.severity_is(Severity.IGNORED)
            elsewhere = {(f.source, f.tensor) for f in columns.select(mask & (columns.rows < 0))}
            return on_table + len(elsewhere)

    else:
        # One pass over the findings.
        flagged: dict[FindingKind, set[tuple[str | None, str]]] = {}
        for finding in findings:
            severities[finding.severity] += 1
            if finding.severity is not Severity.IGNORED:
                flagged.setdefault(finding.kind, set()).add((finding.source, finding.tensor))

        def count(kind: FindingKind) -> int:
            return len(flagged.get(kind, ()))

    return Summary(
        tensors=len(tensors),
        skipped=skipped,
        elements=int(tensors.numel.sum()),
        global_norm=global_norm,
        nan_tensors=count(FindingKind.NAN),
        inf_tensors=count(FindingKind.INF),
        vanishing_tensors=count(FindingKind.VANISHING),
        exploding_tensors=count(FindingKind.EXPLODING),
        outlier_tensors=count(FindingKind.OUTLIER),
        gradient_health=gradient_health(tensors, findings),
        failing_findings=severities[Severity.ERROR] + len(limit_findings),
        warnings=severities[Severity.WARNING],
        ignored_findings=severities[Severity.IGNORED],
        excluded=excluded,
    )
