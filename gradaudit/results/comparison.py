"""Frozen result types of ``gradaudit compare``: host vs seed, and A vs B per parameter.

Beside the audit results, in their own module: these types build on them
(a :class:`Comparison` holds the :class:`~gradaudit.results.Report` of both sides)
but nothing in a scan needs them, so the dependency runs one way only. The logic
that fills them lives in ``comparison/api.py``; this module is data plus the small
arithmetic that defines the ratios, so that the formula exists exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

from gradaudit.policy import PolicyError, Severity
from gradaudit.results import Finding, InputProblem, Report

#: The two sides of every comparison, also the ``source`` label of their tensors.
HOST = "host"
SEED = "seed"

#: ``--max-change``: a shared parameter is flagged when its norm ratio B/A leaves ``[1/k, k]``.
DEFAULT_MAX_CHANGE = 10.0


def scaled_ratio(numerator: float, denominator: float, factor: float = 1.0) -> float:
    """``numerator / denominator * factor`` for positive finite inputs, without spurious overflow.

    Norms of float64 gradients may lie anywhere in float64's range, so the plain
    quotient can overflow (or the product can) even when the result is
    representable. Mantissas and exponents are divided separately; the result
    is ``inf`` only when the true value exceeds float64's range and ``0.0`` only
    when it is below it.
    """
    num_mantissa, num_exponent = math.frexp(numerator)
    den_mantissa, den_exponent = math.frexp(denominator)
    try:
        return math.ldexp(num_mantissa / den_mantissa * factor, num_exponent - den_exponent)
    except OverflowError:
        return math.inf


def check_min_ratio(value: float) -> float:
    if not value >= 0.0:
        raise PolicyError("min-ratio", f"must be >= 0 (got {value!r})")
    return float(value)


def check_max_ratio(value: float) -> float:
    if not value > 0.0:
        raise PolicyError("max-ratio", f"must be > 0 (got {value!r})")
    return float(value)


def check_max_change(value: float) -> float:
    if not value >= 1.0:
        raise PolicyError("max-change", f"must be >= 1, the band is [1/k, k] (got {value!r})")
    return float(value)


@dataclass(frozen=True)
class ComparePolicy:
    """What a comparison gates on, recorded in its result like :class:`Thresholds` in a report.

    ``min_ratio`` / ``max_ratio`` bound the *normalized* ratio (``None``: no bound);
    ``max_change`` is the ``k`` of the per-parameter band ``[1/k, k]``;
    ``fail_on_change`` makes parameters outside that band fail the run instead of warn.
    A bad value raises :class:`~gradaudit.policy.PolicyError` (a ``ValueError``) naming
    the setting, judged by the same ``check_*`` rules as the config file's keys.
    """

    min_ratio: float | None = None
    max_ratio: float | None = None
    max_change: float = DEFAULT_MAX_CHANGE
    fail_on_change: bool = False

    def __post_init__(self) -> None:
        if self.min_ratio is not None:
            check_min_ratio(self.min_ratio)
        if self.max_ratio is not None:
            check_max_ratio(self.max_ratio)
        if (
            self.min_ratio is not None
            and self.max_ratio is not None
            and self.min_ratio > self.max_ratio
        ):
            raise PolicyError(
                "min-ratio",
                f"must not exceed max-ratio ({self.min_ratio:g} > {self.max_ratio:g})",
            )
        check_max_change(self.max_change)

    @property
    def gated(self) -> bool:
        return self.min_ratio is not None or self.max_ratio is not None


@dataclass(frozen=True)
class SideStats:
    """One side of a comparison, from the single read of both sides.

    ``params`` counts the elements of the audited floating-point tensors; ``norm``
    is the overflow-safe L2 norm of their finite elements; ``nan`` / ``inf`` count
    elements, the ``*_tensors`` fields count tensors with that finding.
    """

    label: str
    path: str | None
    prefix: str | None
    tensors: int
    skipped: int
    params: int
    norm: float
    nan: int
    inf: int
    nan_tensors: int
    inf_tensors: int
    vanishing_tensors: int
    exploding_tensors: int

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf

    @property
    def norm_per_sqrt_param(self) -> float | None:
        """``norm / sqrt(params)``: the RMS gradient element; what the normalized ratio compares."""
        return self.norm / math.sqrt(self.params) if self.params else None


@dataclass(frozen=True)
class DualGradientStats:
    """Host and seed gradient intensity, comparable across modules of different sizes.

    Every ratio is ``None`` when it is not defined: a side without audited
    elements, NaN/Inf on either side (the norms would cover only the finite
    part), or both norms zero (0/0). A zero host norm gives ``inf``; a zero seed
    norm gives ``0.0``. :attr:`ratio_note` says which case applies.
    """

    host: SideStats
    seed: SideStats

    @property
    def host_norm(self) -> float:
        return self.host.norm

    @property
    def seed_norm(self) -> float:
        return self.seed.norm

    @property
    def host_params(self) -> int:
        return self.host.params

    @property
    def seed_params(self) -> int:
        return self.seed.params

    @property
    def ratio_note(self) -> str | None:
        """Why the ratio is undefined or degenerate, or ``None`` for an ordinary ratio."""
        for side in (self.host, self.seed):
            if not side.params:
                return f"the {side.label} side has no audited gradient element"
        bad = [side.label for side in (self.host, self.seed) if side.nonfinite]
        if bad:
            return f"NaN/Inf on the {' and '.join(bad)} side"
        if self.host_norm == 0.0 and self.seed_norm == 0.0:
            return "both gradient norms are 0"
        if self.host_norm == 0.0:
            return "the host gradient norm is 0"
        if self.seed_norm == 0.0:
            return "the seed gradient norm is 0: the seed receives no gradient"
        return None

    def _ratio(self, factor: float) -> float | None:
        if not self.host_params or not self.seed_params:
            return None
        if self.host.nonfinite or self.seed.nonfinite:
            return None
        if self.host_norm == 0.0:
            return None if self.seed_norm == 0.0 else math.inf
        if self.seed_norm == 0.0:
            return 0.0
        return scaled_ratio(self.seed_norm, self.host_norm, factor)

    @property
    def raw_ratio(self) -> float | None:
        """``seed_norm / host_norm``: not comparable across modules of different sizes."""
        return self._ratio(1.0)

    @property
    def normalized_ratio(self) -> float | None:
        """``(seed_norm / host_norm) * sqrt(host_params / seed_params)``.

        For n i.i.d. gradient elements with variance sigma**2 the expected L2
        norm is sigma * sqrt(n), so a raw norm grows with module size. Dividing
        each norm by the square root of its element count cancels that: the
        result is the ratio of the RMS gradient element, seed over host, and is
        1.0 when both sides learn equally hard per parameter, whatever their sizes.
        """
        if not self.host_params or not self.seed_params:
            return None
        return self._ratio(math.sqrt(self.host_params / self.seed_params))


@dataclass(frozen=True)
class ParameterChange:
    """One tensor name on both sides with equal shapes: its norm in A and in B.

    ``ratio`` is ``norm_b / norm_a``: ``inf`` when only A's norm is 0, ``None``
    when both are 0 or either tensor holds NaN/Inf (``note`` says which).
    """

    name: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    norm_a: float
    norm_b: float
    ratio: float | None
    flagged: bool
    note: str | None = None

    @property
    def relative_change(self) -> float | None:
        """``(norm_b - norm_a) / norm_a``, i.e. ``ratio - 1``."""
        return None if self.ratio is None else self.ratio - 1.0


@dataclass(frozen=True)
class Mismatch:
    """A name on both sides whose shape or dtype differs; never broadcast, only listed."""

    name: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str

    @property
    def shape_differs(self) -> bool:
        return self.shape_a != self.shape_b

    @property
    def dtype_differs(self) -> bool:
        return self.dtype_a != self.dtype_b


@runtime_checkable
class FlaggedView(Protocol):
    """Changes that pick their flagged ones on their columns
    (:class:`~gradaudit.results.change_table.ChangeTable`): a protocol, so this module
    needs no numpy and no import of the table that imports it."""

    def flagged_view(self) -> Sequence[ParameterChange]: ...


@dataclass(frozen=True)
class ParameterComparison:
    """A vs B for the tensor names the sides share (after their prefixes are removed).

    ``changes`` holds every shared name with equal shapes (a dtype difference
    alone still compares: a norm does not depend on the storage dtype, and the
    difference is also listed in ``mismatches``). Names with different shapes
    are only in ``mismatches``. Only audited (floating-point) tensors take part.

    ``changes`` is a sequence: a comparison's own is a
    :class:`~gradaudit.results.change_table.ChangeTable`, which builds each
    :class:`ParameterChange` when it is asked for (a million shared names cost no
    object each); a tuple works as well.
    """

    max_change: float
    changes: Sequence[ParameterChange]
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    mismatches: tuple[Mismatch, ...]
    #: The first shared name (in A's order) whose stats are not bit-identical on both
    #: sides, or whose shape or dtype differs; ``None`` when none is
    #: (:func:`~gradaudit.results.replicas.first_divergence`, the judge of DDP replicas).
    first_difference: str | None = None
    #: How many shared names differ so.
    differing: int = 0

    @property
    def identical(self) -> bool:
        """Both sides hold the same names, and every one's stats (counts, peak, norm), shape
        and dtype are bit-identical: what two DDP ranks' dumps of one step must show."""
        return self.first_difference is None and not self.only_in_a and not self.only_in_b

    @property
    def flagged(self) -> Sequence[ParameterChange]:
        """The flagged changes, in order (picked on the columns of a comparison's own)."""
        if isinstance(self.changes, FlaggedView):
            return self.changes.flagged_view()
        return tuple(change for change in self.changes if change.flagged)


class CompareFindingKind(str, Enum):
    """Comparison-level findings; per-tensor NaN/Inf/... findings stay :class:`Finding`."""

    ZERO_HOST_NORM = "zero_host_norm"
    ZERO_SEED_NORM = "zero_seed_norm"
    ZERO_NORMS = "zero_norms"
    RATIO_NOT_COMPUTED = "ratio_not_computed"
    RATIO_BELOW_MIN = "ratio_below_min"
    RATIO_ABOVE_MAX = "ratio_above_max"
    LARGE_CHANGE = "large_change"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class CompareFinding:
    """One problem with the comparison as a whole."""

    kind: CompareFindingKind
    severity: Severity
    message: str

    @property
    def failing(self) -> bool:
        return self.severity is Severity.ERROR


@dataclass(frozen=True)
class Comparison:
    """Everything one comparison found. Built once, rendered by any comparison formatter.

    ``report`` is the audit of both sides from the one device->host read: each
    tensor's ``source`` (and each finding's, and each skipped tensor's) is the
    side label ``"host"`` or ``"seed"``, its ``files`` has one entry per side
    under that label, and its ``errors`` name the real input paths.
    """

    dual: DualGradientStats
    parameters: ParameterComparison | None
    findings: tuple[CompareFinding, ...]
    report: Report
    policy: ComparePolicy = field(default_factory=ComparePolicy)

    @property
    def tensor_findings(self) -> Sequence[Finding]:
        return self.report.findings

    @property
    def errors(self) -> tuple[InputProblem, ...]:
        return self.report.errors
