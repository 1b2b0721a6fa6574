"""Result types of ``gradaudit trend``: what the series showed, per step and per layer.

Here, not in :mod:`gradaudit.trend.builder` (the algorithm that fills them): the
renderers and the CLI read a :class:`TrendReport` without importing the algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from gradaudit.grouping import GroupBy
from gradaudit.policy import DEFAULT_VANISHING_THRESHOLD, Severity
from gradaudit.precision.headroom import Headroom
from gradaudit.results import InputProblem

#: ``__metadata__`` key of a monitor's dump: the step whose stats showed NaN/Inf, when that
#: is not the step of the gradients the dump holds (``GradientMonitor`` without ``sync``
#: learns of a NaN one call late and dumps the gradients of the call that learned it).
#: Here, below both, because the monitor writes it and the trend reads it.
NONFINITE_STEP_KEY = "nonfinite_step"
#: A layer's norm above this many times its running median is a spike.
DEFAULT_SPIKE_FACTOR = 10.0
#: Earlier steps a layer needs before its norm can be called a spike.
MIN_SPIKE_HISTORY = 3
#: Steps a layer must stay below the vanishing threshold, up to the last, to have collapsed.
MIN_COLLAPSE_STEPS = 2


class TrendKind(str, Enum):
    """What ``trend`` finds. The values are its ``--fail-on`` spellings."""

    NONFINITE = "nonfinite"
    SPIKE = "spike"
    COLLAPSE = "collapse"


DEFAULT_TREND_FAIL_ON: frozenset[TrendKind] = frozenset({TrendKind.NONFINITE, TrendKind.SPIKE})


@dataclass(frozen=True)
class TrendPolicy:
    """What counts as a spike or a collapse, and which findings fail the run."""

    spike_factor: float = DEFAULT_SPIKE_FACTOR
    vanishing: float = DEFAULT_VANISHING_THRESHOLD
    fail_on: frozenset[TrendKind] = DEFAULT_TREND_FAIL_ON

    def __post_init__(self) -> None:
        if not (1.0 < self.spike_factor < math.inf):
            raise ValueError("--spike-factor must be a finite number above 1")
        if not (0.0 <= self.vanishing < math.inf):
            raise ValueError("vanishing threshold must be >= 0 and finite")

    def severity(self, kind: TrendKind) -> Severity:
        return Severity.ERROR if kind in self.fail_on else Severity.WARNING


@dataclass(frozen=True)
class StepResult:
    """Run-wide numbers of one dump."""

    step: int
    path: str
    tensors: int
    #: Norm of the dump's finite elements; ``None`` when it has none (nothing audited, or
    #: every element NaN/Inf): a norm of 0 would claim gradients that were all zero.
    global_norm: float | None
    #: Tensors holding at least one NaN or ±Inf.
    nonfinite_tensors: int
    #: :func:`gradaudit.scan.judge.gradient_health` of the dump, judged by the trend's thresholds.
    gradient_health: float = 1.0
    #: What the dump was read as (:mod:`gradaudit.roles`).
    read_as: str = "gradients"


@dataclass(frozen=True)
class NonFiniteTensor:
    name: str
    layer: str
    nan: int
    pos_inf: int
    neg_inf: int

    def counts(self) -> str:
        parts = [(self.nan, "NaN"), (self.pos_inf, "+Inf"), (self.neg_inf, "-Inf")]
        return ", ".join(f"{n:,} {what}" for n, what in parts if n)


@dataclass(frozen=True)
class Spike:
    step: int
    norm: float
    median: float

    @property
    def ratio(self) -> float:
        return self.norm / self.median


@dataclass(frozen=True)
class LayerTrend:
    """One layer over the series; per-step tuples align with :attr:`TrendReport.steps`."""

    name: str
    #: Norm of the layer's finite elements; ``None`` at steps where it was absent or had
    #: no finite element (all NaN/Inf).
    norms: tuple[float | None, ...]
    max_abs: tuple[float | None, ...]
    #: NaN and ±Inf elements per step (0 where absent).
    nonfinite: tuple[int, ...]
    spikes: tuple[Spike, ...] = ()
    first_nonfinite_step: int | None = None
    collapse_step: int | None = None


@dataclass(frozen=True)
class TrendFinding:
    kind: TrendKind
    severity: Severity
    #: The layer concerned (for nonfinite: the layer of the first tensor).
    layer: str
    step: int
    path: str
    message: str
    #: For nonfinite: every tensor holding NaN/Inf at that step, in model order.
    tensors: tuple[NonFiniteTensor, ...] = ()

    @property
    def failing(self) -> bool:
        return self.severity is Severity.ERROR


@dataclass(frozen=True)
class TrendReport:
    """Everything one trend found. Built once, rendered by any formatter."""

    steps: tuple[StepResult, ...]
    layers: tuple[LayerTrend, ...]
    findings: tuple[TrendFinding, ...]
    errors: tuple[InputProblem, ...]
    policy: TrendPolicy
    #: The grouping actually used (``auto`` resolved on the first audited dump).
    group_by: GroupBy
    device: str = "none"
    engine: str = "eager"  # Engine.EAGER's value: results import no engine module
    elapsed_s: float = 0.0
    #: With ``precision``: the whole dump's headroom in that format, per audited step.
    headroom: tuple[tuple[int, Headroom], ...] = ()

    @property
    def subject(self) -> str:
        """What the norms are of, for titles: ``weight`` when every audited dump was read as
        weights (a series of model checkpoints), else ``gradient``."""
        readings = {s.read_as for s in self.steps if s.tensors}
        return "weight" if readings == {"weights"} else "gradient"
