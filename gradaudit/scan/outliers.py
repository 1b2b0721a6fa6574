"""Outliers: tensors whose RMS sits far from the others of their role in their file.

One job apart from :mod:`gradaudit.scan.judge`: a scale-free reference per role and
file (the median of log10 RMS and its spread), and the tensors far from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradaudit.policy import (
    FindingKind,
    Role,
    Thresholds,
)
from gradaudit.results import (
    Finding,
    OutlierReference,
    TensorStats,
)
from gradaudit.results.stats_table import ROLES, StatsTable
from gradaudit.scan.finding_table import flagged_indices
from gradaudit.scan.rules import table_of

#: A role with fewer tensors than this in a file has no outlier reference.
OUTLIER_MIN_TENSORS = 8
#: The shape classes' labels in an :class:`OutlierReference`.
_LABELS = ("all", "1-D", "2-D+")


@dataclass(frozen=True)
class OutlierGroups:
    """The groups :func:`find_outliers` compares within, for one set of eligible tensors.

    Which tensors are eligible depends on their role and shape (the same while a training
    loop's parameters stay the same) and on their RMS being positive (almost always): a
    monitor keeps the groups of its last report and :func:`find_outliers` takes them again
    when the eligible tensors are the same, instead of grouping them again every step.
    """

    #: The tensors whose role and shape make them eligible (a mask over the table).
    candidates: np.ndarray
    #: Of those, the ones with a positive RMS: the groups' input.
    eligible: np.ndarray
    #: Each group of at least :data:`OUTLIER_MIN_TENSORS` tensors (indices, ascending), in
    #: the order their first tensors come.
    members: tuple[np.ndarray, ...]
    #: Each tensor's shape class: 0 all, 1 vectors, 2 matrices and up (:data:`_LABELS`).
    shape_class: np.ndarray


def outlier_groups(
    table: StatsTable, candidates: np.ndarray | None = None, eligible: np.ndarray | None = None
) -> OutlierGroups:
    """The groups of ``table``'s tensors that :func:`find_outliers` compares within: one per
    file, role and shape class, of the eligible tensors (``candidates``: :func:`_candidates`,
    ``eligible``: those with a positive RMS, worked out unless given)."""
    if candidates is None:
        candidates = _candidates(table)
    if eligible is None:
        eligible = candidates & _positive(table)
    roles = table.role_codes
    gradient = roles == ROLES.index(Role.GRADIENT)
    weight = roles == ROLES.index(Role.WEIGHT)
    # The group a tensor is compared within: gradients of vectors (biases, norm scales)
    # and of matrices sit decades apart in healthy models; weights are matrices only.
    shape_class = np.where(gradient, np.where(table.ranks <= 1, 1, 2), np.where(weight, 2, 0))
    indices = np.flatnonzero(eligible)
    keys = (table.source_codes[indices].astype(np.int64) * len(ROLES) + roles[indices]) * 3
    keys += shape_class[indices]
    unique, first, counts = np.unique(keys, return_index=True, return_counts=True)
    members = tuple(
        indices[keys == unique[key_index]]
        for key_index in np.argsort(first, kind="stable").tolist()  # in first-seen order
        if counts[key_index] >= OUTLIER_MIN_TENSORS
    )
    return OutlierGroups(candidates, eligible, members, shape_class)


def _candidates(table: StatsTable) -> np.ndarray:
    """The tensors compared at all, by role and shape: gradients and weight matrices.

    Optimizer state is left out: its moments mirror the gradients, whose health the
    per-parameter estimates already judge, and an outlier there would only repeat it.
    1-D weights (biases, normalisation scales) are not compared either: they start at 0
    and 1 by design, and a bias a few steps from its zero initialisation sat 2+ decades
    below the matrices in every healthy Trainer checkpoint of the corpus (corpus/).
    """
    roles = table.role_codes
    candidates: np.ndarray = (roles == ROLES.index(Role.GRADIENT)) | (
        (roles == ROLES.index(Role.WEIGHT)) & (table.ranks > 1)
    )
    return candidates


def _positive(table: StatsTable) -> np.ndarray:
    """The tensors with a positive RMS (one of 0 or none, nothing finite: other checks)."""
    # NaN (no finite element) compares False; numpy's comparisons set no floating-point
    # flag for it, so no errstate (~1 us on a monitor's every step).
    positive: np.ndarray = table.rms > 0
    return positive


def find_outliers(
    tensors: Sequence[TensorStats],
    thresholds: Thresholds,
    findings_so_far: Sequence[Finding] = (),
    groups: OutlierGroups | None = None,
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

    ``groups``: :func:`outlier_groups` of an earlier table of the same tensors (names,
    shapes, roles, sources: :mod:`gradaudit.scan.layout`), taken when they were formed
    from the same eligible tensors as this table's, else the tensors are grouped again.

    Computed on the columns (:class:`~gradaudit.results.stats_table.StatsTable`): the logs with
    ``math.log10`` and the medians as :func:`statistics.median` takes them (the mean of
    the two middle values), so the numbers are those of a loop over the tensors.
    """
    table = table_of(tensors)
    # The layout's groups are of the same roles and shapes: only the RMS signs may differ.
    candidates = _candidates(table) if groups is None else groups.candidates
    eligible = candidates & _positive(table)
    if groups is None or not _same(groups.eligible, eligible):
        groups = outlier_groups(table, candidates, eligible)
    if not groups.members:
        return (), ()
    magnitude = (FindingKind.EXPLODING, FindingKind.VANISHING, FindingKind.ALL_ZERO)
    # A mask, not a set of indices: with a million flagged tensors (an all-zero dump) a
    # set of Python ints was the scan's peak memory (~70 MB), for no eligible tensor.
    already = np.zeros(len(table), dtype=bool)
    if len(findings_so_far):  # none on a healthy step
        already[flagged_indices(table, findings_so_far, magnitude)] = True
    rms = table.rms
    roles = table.role_codes
    shape_class = groups.shape_class
    findings: list[Finding] = []
    references: list[OutlierReference] = []
    for members in groups.members:
        first_member = int(members[0])
        source = table.sources[table.source_codes[first_member]]
        role = ROLES[roles[first_member]]
        shapes = _LABELS[int(shape_class[first_member])]
        member_rms = rms[members]
        limit = thresholds.outlier_limit(role)
        median, spread, far = _far_from_median(member_rms, limit)
        references.append(
            OutlierReference(role, source, len(members), median, spread, limit, shapes)
        )
        for where, away in far:
            member = int(members[where])
            if already[member]:
                continue
            name = table.names[member]
            direction = "above" if away > 0 else "below"
            message = (
                f"RMS {float(member_rms[where]):.3g} is {abs(away):.1f} decades {direction} the "
                f"median {10**median:.3g} of {len(members)} {role.value} tensors"
                f"{'' if shapes == 'all' else f' ({shapes})'} (limit {limit:.1f})"
            )
            kind = FindingKind.OUTLIER
            findings.append(Finding(kind, thresholds.severity(kind, name), name, message, source))
    return tuple(findings), tuple(references)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two boolean masks, as bytes (a monitor's every step)."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


#: Groups up to this size are judged on Python floats: a few dozen values take longer
#: through numpy's per-call cost than through a list (a monitor's 40 tensors, every step).
_LIST_LIMIT = 256


def _far_from_median(rms: np.ndarray, limit: float) -> tuple[float, float, list[tuple[int, float]]]:
    """``(median, spread, far)`` of a group's log10 RMS: ``far`` holds ``(position,
    distance)`` of each member more than ``limit`` from the median, in order.

    The same IEEE operations on lists of Python floats for a small group as on arrays
    for a large one (``math.log10``, the middle of the sorted values, differences,
    absolute values), so both give the same bits; a group with a non-finite log (an
    RMS that overflowed) takes the arrays, whose sort places NaN as numpy does.
    """
    if len(rms) <= _LIST_LIMIT:
        logs = list(map(math.log10, rms.tolist()))
        if math.isfinite(sum(logs)):  # every log finite (an inf or NaN makes the sum so)
            ordered = sorted(logs)
            median = _list_median(ordered)
            distances = list(map(median.__rsub__, logs))  # x - median, in C
            spread = 1.4826 * _list_median(sorted(map(abs, distances)))
            # Subtracting one value is monotonic: the extremes say whether any is far.
            if ordered[-1] - median <= limit and ordered[0] - median >= -limit:
                return median, spread, []
            far = [(i, d) for i, d in enumerate(distances) if d > limit or d < -limit]
            return median, spread, far
    logs_array = _log10(rms)
    median = _median(logs_array)
    spread = 1.4826 * _median(np.abs(logs_array - median))
    distance = logs_array - median
    where = np.flatnonzero(np.abs(distance) > limit).tolist()
    return median, spread, [(i, float(distance[i])) for i in where]


def _list_median(ordered: list[float]) -> float:
    """:func:`_median` of values already sorted."""
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


#: Values turned into Python floats at once by :func:`_log10`.
_LOG_CHUNK = 1 << 16


def _log10(values: np.ndarray) -> np.ndarray:
    """``math.log10`` of each value (libm's, as a loop over the tensors computes it; numpy's
    own may differ in the last bit), a chunk at a time: a million values as Python floats
    at once were 32 MB, the largest part of a big scan's peak memory."""
    logs = np.empty(len(values), dtype=np.float64)
    for start in range(0, len(values), _LOG_CHUNK):
        chunk = values[start : start + _LOG_CHUNK].tolist()
        logs[start : start + len(chunk)] = np.fromiter(
            map(math.log10, chunk), dtype=np.float64, count=len(chunk)
        )
    return logs


def _median(values: np.ndarray) -> float:
    """:func:`statistics.median` of a float64 array: the middle value, or the mean of two."""
    ordered = np.sort(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2
