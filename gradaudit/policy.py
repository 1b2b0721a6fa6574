"""What counts as a problem, and which problems fail a run.

Kept apart from ``scan/judge.py`` (which applies it) so that result types can
record the policy they were judged by without importing any logic. The range
rule of every setting lives here once, as a ``check_*`` function that both
:class:`Thresholds` and the config-file loader call, so a value is judged the
same way whether it came from a flag, ``pyproject.toml`` or library code.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import TypeVar

#: A tensor whose finite L2 norm is below this is reported as vanishing.
DEFAULT_VANISHING_THRESHOLD = 1e-7
#: A tensor whose finite L2 norm is above this is reported as exploding.
DEFAULT_EXPLODING_THRESHOLD = 100.0


class FindingKind(str, Enum):
    """What is wrong with a tensor. The values are the ``--fail-on`` spellings."""

    NAN = "nan"
    INF = "inf"
    EXPLODING = "exploding"
    VANISHING = "vanishing"
    #: Floating-point data that could not be audited (a dtype or layout the engine
    #: cannot reduce): a warning by default, so the verdict says what it did not see.
    SKIPPED = "skipped"
    #: A tensor's RMS sits many decades away from the other tensors of its role in its file.
    OUTLIER = "outlier"
    #: Negative values in an optimizer's second moment (a sum of squares): corruption.
    NEGATIVE = "negative"
    #: Values a narrower dtype cannot hold (``--cast-check``).
    CAST = "cast"
    #: A weight tensor that is entirely zero (for gradients that is ``vanishing``).
    ALL_ZERO = "all-zero"


class Role(str, Enum):
    """What a tensor is, which decides what is checked in it (see ``docs/roles.md``)."""

    GRADIENT = "gradient"
    WEIGHT = "weight"
    #: An optimizer's first moment or momentum (``exp_avg``, ``momentum_buffer``).
    OPTIMIZER_MOMENT = "optimizer_moment"
    #: An optimizer's second moment (``exp_avg_sq``, ``square_avg``, Adagrad's ``sum``).
    OPTIMIZER_SECOND_MOMENT = "optimizer_second_moment"
    #: Module state that is not trained (BatchNorm running statistics, RoPE tables).
    BUFFER = "buffer"
    UNKNOWN = "unknown"


class InputKind(str, Enum):
    """``--kind``: what the files hold, or ``auto`` to decide per file from the evidence."""

    AUTO = "auto"
    GRADIENTS = "gradients"
    WEIGHTS = "weights"


#: ``--cast-check`` targets: dtypes a tensor may be cast to for serving or training (the
#: ``--precision`` formats of :mod:`gradaudit.precision`, spelled the same).
CAST_TARGETS = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")

#: A tensor whose log10 RMS lies more than this many decades from the median of its group
#: (role, and for gradients 1-D or not) in its file is an outlier. Chosen per role from
#: measurements on healthy models and on the same models with one layer scaled by 1e3 or
#: 1e-4 (see ``docs/roles.md``); ``Thresholds.outlier_decades`` overrides both.
DEFAULT_OUTLIER_DECADES: dict[Role, float] = {Role.WEIGHT: 2.0, Role.GRADIENT: 2.5}


class LimitKind(str, Enum):
    """A run-level limit (``--max-…``): about a whole file, not about one tensor."""

    GLOBAL_NORM = "global-norm"
    VANISHING_FRACTION = "vanishing-fraction"


class Severity(str, Enum):
    """What a finding does to the run.

    ``error`` fails it, ``warning`` is only reported, ``ignored`` is a finding
    on a tensor matched by ``--ignore``: kept (with its stats) so nothing is
    hidden, counted in the summary, and never failing or warning.
    """

    ERROR = "error"
    WARNING = "warning"
    IGNORED = "ignored"


#: Vanishing is a warning by default: attention key biases get near-zero
#: gradients by design, and failing on them would make the tool useless.
DEFAULT_FAIL_ON: frozenset[FindingKind] = frozenset(
    {FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING}
)

#: Kinds that fail whatever ``fail_on`` says (only ``--ignore`` silences them): a negative
#: second moment is corruption, and ``--cast-check`` is itself the gate the user asked
#: for. Outliers and all-zero weights are often legitimate, so they follow ``fail_on``
#: (and warn by default).
ALWAYS_FAILING: frozenset[FindingKind] = frozenset({FindingKind.NEGATIVE, FindingKind.CAST})

#: ``--fail-on`` words that stand for several kinds.
FAIL_ON_ALIASES: dict[str, frozenset[FindingKind]] = {
    "nonfinite": frozenset({FindingKind.NAN, FindingKind.INF}),
    "all": frozenset(FindingKind),
}
FAIL_ON_WORDS = (*(k.value for k in FindingKind), *FAIL_ON_ALIASES, "none")


class PolicyError(ValueError):
    """A setting with a value the policy cannot use; ``key`` is its flag spelling."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


def check_vanishing_threshold(value: float) -> float:
    if not value >= 0.0:
        raise PolicyError("vanishing-threshold", f"must be >= 0 (got {value!r})")
    return float(value)


def check_exploding_threshold(value: float) -> float:
    if not value > 0.0:
        raise PolicyError("exploding-threshold", f"must be > 0 (got {value!r})")
    return float(value)


def check_max_global_norm(value: float) -> float:
    if not value > 0.0:
        raise PolicyError("max-global-norm", f"must be > 0 (got {value!r})")
    return float(value)


def check_max_vanishing_fraction(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise PolicyError("max-vanishing-fraction", f"must be between 0 and 1 (got {value!r})")
    return float(value)


def check_kind(value: str | InputKind) -> InputKind:
    try:
        return InputKind(str(value.value if isinstance(value, InputKind) else value).lower())
    except ValueError:
        choices = ", ".join(k.value for k in InputKind)
        raise PolicyError("kind", f"unknown kind {value!r} (choose from {choices})") from None


def check_cast_target(value: str) -> str:
    text = value.strip().lower()
    if text not in CAST_TARGETS:
        raise PolicyError(
            "cast-check", f"unknown dtype {value!r} (choose from {', '.join(CAST_TARGETS)})"
        )
    return text


def check_ignore_pattern(pattern: str) -> str:
    if not pattern.strip():
        raise PolicyError("ignore", "a pattern cannot be empty")
    return pattern


@dataclass(frozen=True)
class Thresholds:
    """The whole policy: magnitude thresholds, what fails the run, limits, ignores.

    * ``fail_on``: finding kinds whose findings are errors; the others warn.
    * ``max_global_norm``: a file whose global norm exceeds it fails the run.
    * ``max_vanishing_fraction``: a file in which more than this fraction of
      the (not ignored) tensors vanish fails the run. When set, it replaces the
      per-tensor verdict on vanishing: vanishing findings are warnings even if
      ``fail_on`` names them, because one dead layer is often legitimate.
    * ``ignore``: glob patterns (``fnmatch``, case-sensitive, ``*`` crosses
      dots) on tensor names whose findings are :attr:`Severity.IGNORED`.
    * ``kind``: what the inputs hold (``--kind``); ``auto`` decides each tensor's
      :class:`Role` from the evidence (:mod:`gradaudit.roles`), which decides its checks.
    * ``cast_check``: a narrower dtype weights are checked against (``--cast-check``).
    * ``outlier_decades``: overrides the per-role outlier limits.
    """

    vanishing: float = DEFAULT_VANISHING_THRESHOLD
    exploding: float = DEFAULT_EXPLODING_THRESHOLD
    fail_on: frozenset[FindingKind] = DEFAULT_FAIL_ON
    max_global_norm: float | None = None
    max_vanishing_fraction: float | None = None
    ignore: tuple[str, ...] = ()
    #: What the inputs hold (``--kind``); ``auto`` decides per file and per tensor.
    kind: InputKind = InputKind.AUTO
    #: ``--cast-check``: the narrower dtype weights are checked against, if any.
    cast_check: str | None = None
    #: Decades from the median log10 RMS of a role beyond which a tensor is an outlier;
    #: ``None``: the measured default of each role (:data:`DEFAULT_OUTLIER_DECADES`).
    outlier_decades: float | None = None

    def __post_init__(self) -> None:
        check_vanishing_threshold(self.vanishing)
        check_exploding_threshold(self.exploding)
        if self.vanishing >= self.exploding:
            raise PolicyError(
                "vanishing-threshold",
                f"must be below the exploding threshold ({self.vanishing:g} >= {self.exploding:g})",
            )
        if self.max_global_norm is not None:
            check_max_global_norm(self.max_global_norm)
        if self.max_vanishing_fraction is not None:
            check_max_vanishing_fraction(self.max_vanishing_fraction)
        for pattern in self.ignore:
            check_ignore_pattern(pattern)
        object.__setattr__(self, "kind", check_kind(self.kind))
        if self.cast_check is not None:
            object.__setattr__(self, "cast_check", check_cast_target(self.cast_check))
        if self.outlier_decades is not None and not self.outlier_decades > 0:
            raise PolicyError("outlier-decades", f"must be > 0 (got {self.outlier_decades!r})")

    def severity(self, kind: FindingKind, tensor: str | None = None) -> Severity:
        """The severity of a ``kind`` finding on ``tensor`` under this policy."""
        if tensor is not None and self.ignored_by(tensor) is not None:
            return Severity.IGNORED
        if kind in ALWAYS_FAILING:
            return Severity.ERROR
        if kind is FindingKind.VANISHING and self.max_vanishing_fraction is not None:
            return Severity.WARNING
        return Severity.ERROR if kind in self.fail_on else Severity.WARNING

    def outlier_limit(self, role: Role) -> float:
        """Decades from the median beyond which a tensor of ``role`` is an outlier."""
        if self.outlier_decades is not None:
            return self.outlier_decades
        return DEFAULT_OUTLIER_DECADES.get(role, DEFAULT_OUTLIER_DECADES[Role.GRADIENT])

    def ignored_by(self, tensor: str) -> str | None:
        """The first ``ignore`` pattern that matches ``tensor``, if any."""
        for pattern in self.ignore:
            if fnmatch.fnmatchcase(tensor, pattern):
                return pattern
        return None


def parse_fail_on(spec: str | Iterable[str]) -> frozenset[FindingKind]:
    """Parse ``nan,inf,exploding`` (or a list of words) / ``nonfinite`` / ``all`` / ``none``."""
    pieces = [spec] if isinstance(spec, str) else list(spec)
    words = [w.strip().lower() for piece in pieces for w in piece.split(",") if w.strip()]
    if not words:
        raise PolicyError("fail-on", f"needs at least one of: {', '.join(FAIL_ON_WORDS)}")
    kinds: set[FindingKind] = set()
    for word in words:
        if word == "none":
            continue
        if word in FAIL_ON_ALIASES:
            kinds.update(FAIL_ON_ALIASES[word])
            continue
        try:
            kinds.add(FindingKind(word))
        except ValueError:
            raise PolicyError(
                "fail-on", f"unknown kind {word!r} (choose from {', '.join(FAIL_ON_WORDS)})"
            ) from None
    if "none" in words and kinds:
        raise PolicyError("fail-on", "none cannot be combined with other kinds")
    return frozenset(kinds)


def fraction_exceeds(count: int, total: int, limit: float) -> bool:
    """``count / total > limit`` for the decimal the user wrote, without rounding.

    ``0.57 * 100`` is ``56.99999999999999`` in floating point, which would make
    57 of 100 "more than 0.57"; the shortest decimal of ``limit`` is exact.
    """
    return total > 0 and Fraction(count, total) > Fraction(repr(limit))


KindT = TypeVar("KindT", bound=Enum)


def parse_kinds(spec: str, kinds: type[KindT]) -> frozenset[KindT]:
    """Parse a ``--fail-on`` list (``a,b`` / ``all`` / ``none``) of the values of ``kinds``.

    For commands with their own kinds of finding (``trend``); ``scan``'s
    :func:`parse_fail_on` adds aliases (``nonfinite``) and config-aware errors.
    """
    values = [str(k.value) for k in kinds]
    words = [w.strip().lower() for w in spec.split(",") if w.strip()]
    if not words:
        raise ValueError(f"--fail-on needs at least one of: {', '.join([*values, 'all', 'none'])}")
    chosen: set[KindT] = set()
    for word in words:
        if word == "none":
            continue
        if word == "all":
            chosen.update(kinds)
            continue
        try:
            chosen.add(kinds(word))
        except ValueError:
            allowed = ", ".join([*values, "all", "none"])
            raise ValueError(f"unknown --fail-on kind {word!r} (choose from {allowed})") from None
    if "none" in words and chosen:
        raise ValueError("--fail-on none cannot be combined with other kinds")
    return frozenset(chosen)
