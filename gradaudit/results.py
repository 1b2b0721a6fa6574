"""Frozen result types: what an audit hands back.

Results are plain data so that every output format (table, JSON, ...) is built
from the same object and none of them is second-class. A tensor that was not
audited is a :class:`Skipped` with a reason, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradaudit.policy import FindingKind, LimitKind, Severity, Thresholds

if TYPE_CHECKING:
    from gradaudit.precision import ExponentHistogram


@dataclass(frozen=True, init=False)
class TensorStats:
    """Statistics of one floating-point tensor.

    ``norm`` and ``max_abs`` cover the finite elements only, so one NaN does not
    hide the magnitude of the rest; ``rms`` is ``None`` when no element is finite.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nan: int
    pos_inf: int
    neg_inf: int
    zeros: int
    max_abs: float
    norm: float
    rms: float | None
    source: str | None = None

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        numel: int,
        nan: int,
        pos_inf: int,
        neg_inf: int,
        zeros: int,
        max_abs: float,
        norm: float,
        rms: float | None,
        source: str | None = None,
    ) -> None:
        # One is made per tensor; a frozen dataclass's generated __init__ sets
        # each field through object.__setattr__, 2.4x slower than filling the
        # instance dict at once, which showed with thousands of tiny tensors.
        self.__dict__.update(
            name=name,
            shape=shape,
            dtype=dtype,
            numel=numel,
            nan=nan,
            pos_inf=pos_inf,
            neg_inf=neg_inf,
            zeros=zeros,
            max_abs=max_abs,
            norm=norm,
            rms=rms,
            source=source,
        )

    @property
    def finite(self) -> int:
        return self.numel - self.nan - self.pos_inf - self.neg_inf

    @property
    def nonfinite(self) -> int:
        return self.nan + self.pos_inf + self.neg_inf

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class Finding:
    """One problem with one tensor, already judged by the policy."""

    kind: FindingKind
    severity: Severity
    tensor: str
    message: str
    source: str | None = None

    @property
    def failing(self) -> bool:
        return self.severity is Severity.ERROR

    @property
    def ignored(self) -> bool:
        return self.severity is Severity.IGNORED


@dataclass(frozen=True)
class LimitFinding:
    """A run-level limit that was exceeded (``--max-global-norm``, ``--max-vanishing-fraction``).

    Not a :class:`Finding`: it is about a whole input file (``source``; ``None``
    when the tensors came from memory), not about one tensor, and it carries the
    measured ``value`` against the ``limit``. A limit the user set is a gate, so
    exceeding it always fails the run, whatever ``fail_on`` says.
    """

    kind: LimitKind
    value: float
    limit: float
    message: str
    source: str | None = None

    @property
    def severity(self) -> Severity:
        return Severity.ERROR

    @property
    def failing(self) -> bool:
        return True


@dataclass(frozen=True)
class Skipped:
    """A tensor that was not numerically audited, and why (e.g. an integer dtype)."""

    name: str
    reason: str
    source: str | None = None
    #: True when the tensor holds floating-point or complex values nobody read (a
    #: dtype or layout the engine cannot reduce): a NaN in it would go unseen, so
    #: the policy makes it a ``skipped`` finding. False for what cannot hide a NaN
    #: (integers, a tensor audited under another name, a value that is no tensor).
    unaudited: bool = False


@dataclass(frozen=True)
class InputProblem:
    """An input that could not be audited; the rest of the run still was."""

    path: str
    message: str


@dataclass(frozen=True)
class FileResult:
    """Per-input totals, so a multi-file run reports each file on its own."""

    path: str
    tensors: int
    skipped: int
    elements: int
    global_norm: float | None
    error: str | None = None
    #: Tensors (and other values) left out by ``--include``/``--exclude``: counted, not listed.
    excluded: int = 0


@dataclass(frozen=True)
class Summary:
    """Run-wide totals. ``global_norm`` is over the finite elements of all audited tensors.

    The ``*_tensors`` counts are tensors flagged with a finding that is not
    ignored; ``failing_findings`` includes exceeded limits.
    """

    tensors: int
    skipped: int
    elements: int
    global_norm: float
    nan_tensors: int
    inf_tensors: int
    vanishing_tensors: int
    exploding_tensors: int
    failing_findings: int
    warnings: int
    #: Names left out by ``--include``/``--exclude`` over the whole run.
    excluded: int = 0
    #: Findings on tensors matched by ``--ignore``: not failing, not warnings, still counted.
    ignored_findings: int = 0


@dataclass(frozen=True)
class Report:
    """Everything one audit found. Built once, rendered by any formatter."""

    tensors: tuple[TensorStats, ...]
    findings: tuple[Finding, ...]
    skipped: tuple[Skipped, ...]
    summary: Summary
    device: str
    engine: str
    elapsed_s: float
    files: tuple[FileResult, ...] = ()
    errors: tuple[InputProblem, ...] = ()
    thresholds: Thresholds = field(default_factory=Thresholds)
    #: Run-level limits that were exceeded; every one fails the run.
    limit_findings: tuple[LimitFinding, ...] = ()
    #: Per tensor (same order as ``tensors``), when asked for (``--precision``): exponent
    #: histograms; ``None`` for a tensor whose stats came from another rank.
    histograms: tuple[ExponentHistogram | None, ...] = ()
