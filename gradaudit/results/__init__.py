"""Frozen result types: what an audit hands back.

Results are plain data so that every output format (table, JSON, ...) is built
from the same object and none of them is second-class. A tensor that was not
audited is a :class:`Skipped` with a reason, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradaudit.policy import FindingKind, LimitKind, Role, Severity, Thresholds

if TYPE_CHECKING:
    from gradaudit.precision.formats import ExponentHistogram
    from gradaudit.precision.judging import PrecisionReport


@dataclass(frozen=True, init=False)
class TensorStats:
    """Statistics of one floating-point tensor.

    ``norm`` and ``max_abs`` cover the finite elements only, so one NaN does not
    hide the magnitude of the rest; ``rms`` is ``None`` when no element is finite.
    ``role`` is what the tensor was read as (it decides the checks) and
    ``role_evidence`` why (see :mod:`gradaudit.roles`); ``role_thin`` when a default or a
    guess from the values decided it: then no check that depends on the role fails the
    tensor by itself (:func:`gradaudit.scan.rules.thin_reading_holds`).
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
    role: Role = Role.GRADIENT
    role_evidence: str = ""
    role_thin: bool = False

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
        role: Role = Role.GRADIENT,
        role_evidence: str = "",
        role_thin: bool = False,
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
            role=role,
            role_evidence=role_evidence,
            role_thin=role_thin,
        )

    @property
    def finite(self) -> int:
        return self.numel - self.nan - self.pos_inf - self.neg_inf

    @property
    def nonfinite(self) -> int:
        return self.nan + self.pos_inf + self.neg_inf

    @property
    def unmeasured(self) -> bool:
        """Elements but none finite (all NaN/Inf): ``norm`` and ``max_abs`` are 0 by their
        definition over finite elements, and must never be shown as a number, which would
        read as a dead layer."""
        return self.numel > 0 and self.finite == 0

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem with one tensor, already judged by the policy.

    Slotted: a dump of a million all-zero tensors has a million findings, and an
    instance dict each doubled their size.
    """

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
class GradientEstimate:
    """A parameter's recent gradient size, read from an optimizer state tensor.

    ``rms_norm`` estimates the root of the mean squared gradient norm over the recent
    steps (from a second moment: ``sqrt(sum(v) / (1 - beta**step))``); ``mean_norm``
    the norm of the mean gradient (from a first moment). ``basis`` names the state
    tensor and the formula; ``bias_corrected`` is False when the state had no step.
    Only ``rms_norm`` is judged vanishing/exploding (a mean of noisy gradients can be
    near zero in a healthy run).
    """

    parameter: str
    tensor: str
    source: str | None
    basis: str
    rms_norm: float | None = None
    mean_norm: float | None = None
    step: float | None = None
    bias_corrected: bool = False


@dataclass(frozen=True)
class OutlierReference:
    """What the outlier check compared against: one role of one file.

    ``median`` and ``spread`` are of log10 RMS (``spread`` is the MAD scaled to a
    standard deviation); ``limit`` is the distance in decades beyond which a tensor is
    an outlier, ``tensors`` how many tensors the reference was taken from.
    """

    role: Role
    source: str | None
    tensors: int
    median: float
    spread: float
    limit: float
    #: Which tensors of the role: ``all``, or for gradients ``1-D`` / ``2-D+``.
    shapes: str = "all"


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
    """An input that could not be audited; the rest of the run still was.

    ``internal`` marks a defect in gradaudit met while auditing this input (exit code 4),
    not a problem of the file (exit code 3); ``traceback`` keeps where it happened, for
    ``--debug`` and for a bug report. Neither is part of the problem's identity.
    """

    path: str
    message: str
    internal: bool = False
    traceback: str = field(default="", compare=False, repr=False)


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
    #: What the file was read as (``gradients``, ``weights``, ``training checkpoint`` …).
    read_as: str = "gradients"
    #: Why; says so when the evidence is thin.
    read_as_evidence: str = ""
    #: True when nothing in the file said what it holds and a default or a guess decided.
    evidence_thin: bool = False


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
    outlier_tensors: int = 0
    #: One number in [0, 1]: see :func:`gradaudit.scan.judge.gradient_health`.
    gradient_health: float = 1.0


#: Findings on a logged history are named ``log_history.<key>``, one per logged quantity.
HISTORY_NAME = "log_history"
HISTORY_KEYS = ("loss", "grad_norm")


@dataclass(frozen=True)
class LoggedHistory:
    """A training run's own log, judged beside the tensors (``trainer_state.json``).

    ``file`` is the input it came with; ``rows`` how many logged steps were judged;
    ``note`` one line on what was logged last. Its findings are named
    ``log_history.loss`` / ``log_history.grad_norm`` and carry the step.
    """

    file: str
    rows: int
    note: str


@dataclass(frozen=True)
class Report:
    """Everything one audit found. Built once, rendered by any formatter."""

    #: One per audited tensor, in collection order. An audit gives a
    #: :class:`~gradaudit.results.stats_table.StatsTable` (columns that make each TensorStats
    #: when it is asked for: a million tensors hold no object each); any sequence does.
    tensors: Sequence[TensorStats]
    #: In tensor order, then the findings on tensors that were not audited. An audit
    #: gives a :class:`~gradaudit.scan.finding_table.FindingTable` (columns over ``tensors``
    #: that make each Finding when it is asked for); any sequence does.
    findings: Sequence[Finding]
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
    #: Per-parameter gradient estimates read from optimizer state.
    estimates: tuple[GradientEstimate, ...] = ()
    #: The references the outlier check compared each role against.
    outlier_references: tuple[OutlierReference, ...] = ()
    #: Per tensor (same order as ``tensors``), when asked for (``--precision``): exponent
    #: histograms; ``None`` for a tensor whose stats came from another rank.
    histograms: tuple[ExponentHistogram | None, ...] = ()
    #: The trainers' logged histories that were judged (``trainer_state.json``), one per
    #: input that has one; their findings are in ``findings`` (``log_history.<key>``).
    histories: tuple[LoggedHistory, ...] = ()
    #: ``--precision``: the headroom of every tensor, layer and the whole input in one
    #: target format, judged from ``histograms``; its findings are in ``findings`` too.
    headroom: PrecisionReport | None = None

    @property
    def audited_nothing(self) -> bool:
        """Whether neither a tensor nor a logged training history was judged."""
        return self.summary.tensors == 0 and not self.histories
