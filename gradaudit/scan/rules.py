"""The per-tensor rule: one tensor's stats and the thresholds in, its findings out.

:func:`evaluate` is the one rule for what a finding on a tensor is and what it says;
:func:`judged_candidates` picks, on the columns, the tensors it may flag. Apart from
:mod:`gradaudit.scan.judge` (roles, outliers, estimates, the summary) so that the
:class:`~gradaudit.scan.finding_table.FindingTable`, which runs the rule to build each
finding when it is asked for, and the judge that builds the table import in one direction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

from gradaudit.policy import FindingKind, Role, Severity, Thresholds
from gradaudit.precision.formats import FORMATS, Precision
from gradaudit.results import Finding, TensorStats
from gradaudit.results.stats_table import StatsTable

#: The optimizer state roles: a NaN there spreads on resume.
OPTIMIZER_STATE = (Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT)

#: A weight matrix (2-D and up) whose RMS times sqrt(fan-in) is above this has left any
#: initialisation scale behind: initialisers aim at about 1 (Kaiming, Xavier: RMS about
#: 1/sqrt(fan-in)), embeddings at up to sqrt(width) (~100). Measured on the corpus
#: (corpus/): healthy weights at most 73 (a CREPE convolution), every weight of a run
#: diverged by its learning rate at least 4e4.
DIVERGED_MATRIX_SCALE = 1e4
#: A normalisation layer's scale (LayerNorm, BatchNorm, RMSNorm weight) with an RMS above
#: this: they start at 1 and stay near it (corpus: at most 1.3 healthy, at least 1e4 in a
#: diverged run).
DIVERGED_NORM_SCALE = 100.0
_NORM_COMPONENT = re.compile(r"(?:.*norm.*|(?:ln|bn)(?:_?\w*)?|.*_(?:ln|bn)\d*)")
_SCALE_NAMES = frozenset({"weight", "scale", "gamma", "g"})


def is_norm_scale(name: str) -> bool:
    """Whether ``name`` is a normalisation layer's scale: ``…LayerNorm.weight``,
    ``ln_f.weight``, ``bn1.weight``, ``conv1_BN.weight``, ``norm.scale``."""
    parts = re.split(r"[./]", name.lower())
    return (
        len(parts) >= 2
        and parts[-1] in _SCALE_NAMES
        and any(_NORM_COMPONENT.fullmatch(part) for part in parts[:-1])
    )


def fan_in(shape: Sequence[int]) -> int:
    """Inputs per output of a weight (``(out, in, *kernel)``, as torch stores them)."""
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


def diverged_weight(stats: TensorStats) -> str | None:
    """Why a weight's scale says its run diverged, or None (see the two limits above)."""
    rms = stats.rms
    if rms is None or not stats.finite:
        return None
    if len(stats.shape) >= 2:
        scale = rms * math.sqrt(fan_in(stats.shape))
        if scale > DIVERGED_MATRIX_SCALE:
            return (
                f"RMS {rms:.3g} x sqrt(fan-in {fan_in(stats.shape)}) = {scale:.3g} > "
                f"{DIVERGED_MATRIX_SCALE:.0e}: far above any initialisation; the run diverged"
            )
    elif len(stats.shape) == 1 and rms > DIVERGED_NORM_SCALE and is_norm_scale(stats.name):
        return (
            f"normalisation scale RMS {rms:.3g} > {DIVERGED_NORM_SCALE:g} (they start at 1 "
            "and stay near it): the run diverged"
        )
    return None


def diverged_weight_mask(table: StatsTable, rows: np.ndarray) -> np.ndarray:
    """:func:`diverged_weight` on the columns for ``rows`` (weights, finite): a mask."""
    ranks = table.ranks[rows]
    rms = np.nan_to_num(table.rms[rows], nan=0.0)
    numel = table.numel[rows].astype(np.float64)
    first = np.ones(len(rows), dtype=np.float64)
    matrix = ranks >= 2
    first[matrix] = table.dims[table.starts[rows][matrix]]
    with np.errstate(divide="ignore", invalid="ignore"):
        fan = np.where(matrix & (first > 0), numel / np.maximum(first, 1), 1.0)
    mask: np.ndarray = matrix & (rms * np.sqrt(fan) > DIVERGED_MATRIX_SCALE)
    vectors = np.flatnonzero((ranks == 1) & (rms > DIVERGED_NORM_SCALE))
    for where in vectors.tolist():  # a handful at most: the names are read for these only
        mask[where] = is_norm_scale(table.names[int(rows[where])])
    return mask


#: The checks that depend on what a tensor is: on a role read from thin evidence (a
#: default or a guess from the values), one of these fails the tensor only when the
#: other reading would fail it too (:func:`thin_reading_holds`).
ROLE_DEPENDENT = frozenset({FindingKind.EXPLODING, FindingKind.VANISHING, FindingKind.ALL_ZERO})

#: Appended to a finding that a thin reading made a warning.
THIN_NOTE = {
    Role.GRADIENT: "; a warning: read as a gradient on thin evidence (--kind gradients gates it)",
    Role.WEIGHT: "; a warning: read as a weight on thin evidence (--kind weights gates it)",
}


def thin_reading_holds(kind: FindingKind, stats: TensorStats, thresholds: Thresholds) -> bool:
    """Whether a ``kind`` finding on a tensor read thinly would also fail under the other
    reading (gradient <-> weight), so that it may fail the file by itself.

    Nothing in a flat file without metadata says whether a norm of 111 is an exploding
    gradient or a healthy convolution (a published VAD model's STFT basis): what fails
    under one reading and passes under the other is a warning. A gradient large enough
    to be a diverged weight (:func:`diverged_weight`) fails either way, as does a diverged
    weight above the exploding threshold, and an all-zero matrix where both an all-zero
    weight and a vanishing gradient fail.
    """
    if kind is FindingKind.EXPLODING:
        if stats.role is Role.GRADIENT:
            return diverged_weight(stats) is not None
        return stats.norm > thresholds.exploding
    zero_matrix = stats.numel > 0 and stats.zeros == stats.numel and len(stats.shape) >= 2
    if kind is FindingKind.VANISHING:
        return zero_matrix and thresholds.severity(FindingKind.ALL_ZERO) is Severity.ERROR
    if kind is FindingKind.ALL_ZERO:
        return thresholds.severity(FindingKind.VANISHING) is Severity.ERROR
    return True


def thin_demoted(
    table: StatsTable, rows: np.ndarray, kinds: np.ndarray, thresholds: Thresholds
) -> np.ndarray:
    """:func:`thin_reading_holds` on the columns: a mask over the findings ``(rows[i],
    kinds[i])`` (kind codes into ``tuple(FindingKind)``) that a thin reading makes
    warnings: thin, role-dependent, and not failing under the other reading."""
    every = tuple(FindingKind)
    thin = table.thin_mask()[rows]
    at_rows = table.numel[rows]
    zero_matrix = (at_rows > 0) & (table.zeros[rows] == at_rows) & (table.ranks[rows] >= 2)
    exploding = thin & (kinds == every.index(FindingKind.EXPLODING))
    holds = np.ones(len(rows), dtype=bool)
    if exploding.any():
        at = rows[exploding]
        holds[exploding] = np.where(
            table.role_mask(Role.GRADIENT)[at],
            _diverged_any_role(table, at),
            table.norm[at] > thresholds.exploding,
        )
    vanishing = thin & (kinds == every.index(FindingKind.VANISHING))
    zero_fails = thresholds.severity(FindingKind.ALL_ZERO) is Severity.ERROR
    holds[vanishing] = zero_matrix[vanishing] & zero_fails
    all_zero = thin & (kinds == every.index(FindingKind.ALL_ZERO))
    holds[all_zero] = thresholds.severity(FindingKind.VANISHING) is Severity.ERROR
    demoted: np.ndarray = (exploding | vanishing | all_zero) & ~holds
    return demoted


def _diverged_any_role(table: StatsTable, rows: np.ndarray) -> np.ndarray:
    """:func:`diverged_weight` for ``rows`` whatever their role (finite ones only)."""
    mask = np.zeros(len(rows), dtype=bool)
    finite = table.finite[rows] > 0
    mask[finite] = diverged_weight_mask(table, rows[finite])
    return mask


def table_of(tensors: Iterable[TensorStats]) -> StatsTable:
    """``tensors`` as a :class:`~gradaudit.results.stats_table.StatsTable` (itself if one)."""
    if isinstance(tensors, StatsTable):  # before the ABC check below, ~10x its cost
        return tensors
    return StatsTable.from_stats(tensors if isinstance(tensors, Sequence) else list(tensors))


def tensor_indices(table: StatsTable, keys: Iterable[tuple[str | None, str]]) -> np.ndarray:
    """Indices (ascending) of the tensors named by ``(source, name)`` pairs.

    One pass over the names in C (a set lookup each) instead of a dict of every
    tensor: a million tensors with a handful of findings build nothing per tensor.
    """
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
    * ``weight``: NaN, Inf, an all-zero matrix (a warning by default; a 1-D weight at zero
      is an initialisation), a scale far above any initialisation (:func:`diverged_weight`), and
      ``--cast-check``. No norm thresholds: a norm of 190 is a healthy embedding.
    * optimizer state, buffers, unknown: NaN and Inf only (the optimizer state's
      gradient estimates and negative second moments are judged by
      :func:`evaluate_optimizer_state`).

    A tensor matched by an ``ignore`` pattern still gets its findings, with
    severity ``ignored``, so reports can count and show them.
    """
    found: list[tuple[FindingKind, str]] = []
    where = ""
    if stats.role in OPTIMIZER_STATE and stats.nonfinite:
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
    out = []
    for kind, message in found:
        severity = thresholds.severity(kind, stats.name)
        if (
            stats.role_thin
            and severity is Severity.ERROR
            and kind in ROLE_DEPENDENT
            and not thin_reading_holds(kind, stats, thresholds)
        ):
            severity, message = Severity.WARNING, message + THIN_NOTE[stats.role]
        out.append(Finding(kind, severity, stats.name, message, stats.source))
    return tuple(out)


def judged_candidates(table: StatsTable, thresholds: Thresholds) -> np.ndarray:
    """Indices of the tensors :func:`evaluate` may flag (every one it flags is among them)."""
    finite = table.finite > 0
    norm = table.norm
    gradient = table.role_mask(Role.GRADIENT) & finite
    gradient &= (norm > thresholds.exploding) | (norm < thresholds.vanishing)
    weight = table.role_mask(Role.WEIGHT)
    if thresholds.cast_check is None and weight.any():  # a monitor's gradients: no weight
        all_zero = (table.numel > 0) & (table.zeros == table.numel) & (table.ranks >= 2)
        large = weight & finite & ~all_zero
        large[np.flatnonzero(large)] = diverged_weight_mask(table, np.flatnonzero(large))
        weight &= all_zero | large
    mask = (table.nonfinite > 0) | gradient | weight
    indices: np.ndarray = mask.nonzero()[0]  # a 1-D mask: flatnonzero without its ravel
    return indices


def cast_limits(target: str) -> tuple[float, float]:
    """``(overflow_from, flush_from)`` for a ``--cast-check`` target, as ``--precision`` uses.

    A finite value with ``|x| >= overflow_from`` leaves the target's range (Inf, or
    saturated to ±448 by ``fp8_e4m3fn``); a nonzero value with ``|x| < flush_from``
    becomes zero. One table of rounding boundaries serves both checks
    (:data:`gradaudit.precision.FORMATS`).
    """
    spec = FORMATS[Precision(target)]
    return spec.overflow_from, spec.flush_from


def _weight_checks(stats: TensorStats, thresholds: Thresholds) -> list[tuple[FindingKind, str]]:
    found: list[tuple[FindingKind, str]] = []
    if stats.numel and stats.zeros == stats.numel and len(stats.shape) >= 2:
        found.append((FindingKind.ALL_ZERO, f"all {stats.numel} elements are zero"))
    else:
        diverged = diverged_weight(stats)
        if diverged is not None:
            found.append((FindingKind.EXPLODING, diverged))
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
