"""What counts as a problem, and which problems fail a run.

Kept apart from ``checks.py`` (which applies it) so that result types can
record the policy they were judged by without importing any logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
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


class Severity(str, Enum):
    """Whether a finding fails the run (``error``) or is only reported (``warning``)."""

    ERROR = "error"
    WARNING = "warning"


#: Vanishing is a warning by default: attention key biases get near-zero
#: gradients by design, and failing on them would make the tool useless.
DEFAULT_FAIL_ON: frozenset[FindingKind] = frozenset(
    {FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING}
)


@dataclass(frozen=True)
class Thresholds:
    """Magnitude thresholds, and the finding kinds that fail the run."""

    vanishing: float = DEFAULT_VANISHING_THRESHOLD
    exploding: float = DEFAULT_EXPLODING_THRESHOLD
    fail_on: frozenset[FindingKind] = DEFAULT_FAIL_ON

    def __post_init__(self) -> None:
        if not (self.vanishing >= 0.0):
            raise ValueError("vanishing threshold must be >= 0")
        if not (self.exploding > 0.0):
            raise ValueError("exploding threshold must be > 0")
        if self.vanishing >= self.exploding:
            raise ValueError("vanishing threshold must be below the exploding threshold")

    def severity(self, kind: FindingKind) -> Severity:
        return Severity.ERROR if kind in self.fail_on else Severity.WARNING


KindT = TypeVar("KindT", bound=Enum)


def parse_kinds(spec: str, kinds: type[KindT]) -> frozenset[KindT]:
    """Parse a ``--fail-on`` list (``a,b`` / ``all`` / ``none``) of the values of ``kinds``.

    Shared by every command that has its own kinds of finding (``scan``, ``trend``).
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


def parse_fail_on(spec: str) -> frozenset[FindingKind]:
    """Parse ``nan,inf,exploding`` / ``none`` / ``all`` into a set of kinds."""
    return parse_kinds(spec, FindingKind)
