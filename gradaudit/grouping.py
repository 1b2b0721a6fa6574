"""Parameters into layers: grouping by module path, model order, and how norms combine.

A 300-tensor model does not fit on a screen one tensor per row, and people read
gradient flow per block anyway. This module is pure host-side Python (no torch):
the scan chart, the plots and ``gradaudit trend`` all group the same way.

Grouping (``--group-by``)
-------------------------
* ``module``: a parameter belongs to the module that owns it, i.e. its name
  without the last component (``layers.0.q.weight`` -> ``layers.0.q``).
* ``depth N``: the first N components of the name, never deeper than its module
  (``layers.0.q.weight`` at depth 2 -> ``layers.0``).
* ``none``: one row per tensor.
* ``auto`` (the default): ``module`` when that gives at most
  :data:`AUTO_MAX_ROWS` rows, else the deepest ``depth N`` that does.

A name without a dot is its own group in every mode.

Model order
-----------
Rows follow the module tree: siblings keep the order in which they first appear
in the input, except that numbered siblings (``ModuleList`` indices) sort by
number. Safetensors files written by ``save_file`` store names alphabetically,
where ``layers.10`` sorts before ``layers.2``; a state dict keeps the model's
own order. Both come out in model order (an alphabetical file cannot say that
``embed`` runs before ``head``, so it keeps its alphabetical order there).

How a group's statistics combine
--------------------------------
A group's norm is the L2 norm over the finite elements of all its tensors:
``math.hypot`` of the member norms, which is the same quantity as the engine's
merge rule, overflow-safe (hypot scales by the largest input) and correctly
rounded to float64 precision. ``max_abs`` is the largest member ``max_abs``;
counts add.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from gradaudit.policy import FindingKind, Severity
from gradaudit.results import Finding, TensorStats

#: ``--group-by auto`` picks the finest grouping with at most this many rows per file.
AUTO_MAX_ROWS = 40


class GroupMode(str, Enum):
    AUTO = "auto"
    MODULE = "module"
    DEPTH = "depth"
    NONE = "none"


@dataclass(frozen=True)
class GroupBy:
    """A ``--group-by`` value; ``depth`` is only meaningful for :attr:`GroupMode.DEPTH`."""

    mode: GroupMode = GroupMode.AUTO
    depth: int = 0
    #: True when this spec was chosen by ``auto`` (shown as "(auto)" in titles).
    chosen: bool = False

    def __post_init__(self) -> None:
        if self.mode is GroupMode.DEPTH and self.depth < 1:
            raise ValueError("depth must be >= 1")

    def __str__(self) -> str:
        text = f"depth {self.depth}" if self.mode is GroupMode.DEPTH else self.mode.value
        return f"{text} (auto)" if self.chosen else text

    def key(self, name: str) -> str:
        """The group ``name`` belongs to. ``auto`` must be resolved first."""
        if self.mode is GroupMode.AUTO:
            raise ValueError("resolve --group-by auto before grouping")
        if self.mode is GroupMode.NONE:
            return name
        parts = name.split(".")
        if len(parts) == 1:
            return name
        keep = len(parts) - 1
        if self.mode is GroupMode.DEPTH:
            keep = min(self.depth, keep)
        return ".".join(parts[:keep])


_DEPTH = re.compile(r"depth\s*[ =:]?\s*(\d+)")


def parse_group_by(spec: str) -> GroupBy:
    """Parse ``auto``, ``module``, ``none`` or ``depth N`` (also ``depth=N``, ``depth:N``)."""
    text = spec.strip().lower()
    if text in {m.value for m in GroupMode if m is not GroupMode.DEPTH}:
        return GroupBy(GroupMode(text))
    match = _DEPTH.fullmatch(text)
    if match and int(match.group(1)) >= 1:
        return GroupBy(GroupMode.DEPTH, int(match.group(1)))
    raise ValueError(
        f"--group-by: expected auto, module, none or 'depth N' with N >= 1, got {spec!r}"
    )


def resolve(spec: GroupBy, names: Iterable[str], max_rows: int = AUTO_MAX_ROWS) -> GroupBy:
    """Turn ``auto`` into a concrete grouping for these names; other specs pass through."""
    if spec.mode is not GroupMode.AUTO:
        return spec
    unique = list(dict.fromkeys(names))
    module = GroupBy(GroupMode.MODULE, chosen=True)
    if len({module.key(n) for n in unique}) <= max_rows:
        return module
    deepest = max((n.count(".") for n in unique), default=1)
    for depth in range(deepest - 1, 0, -1):
        candidate = GroupBy(GroupMode.DEPTH, depth, chosen=True)
        if len({candidate.key(n) for n in unique}) <= max_rows:
            return candidate
    return GroupBy(GroupMode.DEPTH, 1, chosen=True)


def _is_index(part: str) -> bool:
    return part.isascii() and part.isdigit()


def model_order(names: Iterable[str]) -> list[str]:
    """The distinct ``names`` in module-tree order (see the module docstring).

    Each name sorts by, per component, the rank of its first appearance among
    its siblings; numbered siblings share one rank (that of the first of them)
    and sort by number within it. A parent sorts before its children.
    """
    unique = list(dict.fromkeys(names))
    # Per parent path: sibling -> rank; ``None`` stands for all numbered siblings.
    ranks: dict[tuple[str, ...], dict[str | None, int]] = {}
    keys: dict[str, tuple[tuple[int, int], ...]] = {}
    for name in unique:
        parts = name.split(".")
        key = []
        for depth, part in enumerate(parts):
            siblings = ranks.setdefault(tuple(parts[:depth]), {})
            slot = None if _is_index(part) else part
            rank = siblings.setdefault(slot, len(siblings))
            key.append((rank, -1 if slot is not None else int(part)))
        keys[name] = tuple(key)
    return sorted(unique, key=lambda n: keys[n])


def combine_norms(norms: Iterable[float]) -> float:
    """The L2 norm of a union of tensors from their norms: overflow-safe ``hypot``."""
    return math.hypot(*norms)


@dataclass(frozen=True)
class Layer:
    """One row of a gradient-flow chart: a group of tensors from one file."""

    name: str
    source: str | None
    tensors: int
    numel: int
    norm: float
    max_abs: float
    nan: int
    pos_inf: int
    neg_inf: int
    #: The members' findings, in member order.
    findings: tuple[Finding, ...] = ()

    @property
    def nonfinite(self) -> int:
        return self.nan + self.pos_inf + self.neg_inf

    @property
    def severity(self) -> Severity | None:
        """The worst severity among the members' findings; ``None`` when none was flagged."""
        if any(f.failing for f in self.findings):
            return Severity.ERROR
        return Severity.WARNING if self.findings else None

    def kind_counts(self) -> list[tuple[FindingKind, int]]:
        """How many members have each kind of finding, in the policy's kind order."""
        counts: dict[FindingKind, set[str]] = {}
        for finding in self.findings:
            counts.setdefault(finding.kind, set()).add(finding.tensor)
        return [(kind, len(counts[kind])) for kind in FindingKind if kind in counts]


def group_layers(
    tensors: Sequence[TensorStats], findings: Sequence[Finding], spec: GroupBy
) -> tuple[Layer, ...]:
    """Group one report's tensors into layers: per file (in input order), in model order.

    ``spec`` must be concrete (see :func:`resolve`); resolving it once over every
    name keeps the rows of several files comparable.
    """
    by_tensor: dict[tuple[str | None, str], list[Finding]] = {}
    for finding in findings:
        by_tensor.setdefault((finding.source, finding.tensor), []).append(finding)
    by_source: dict[str | None, dict[str, list[TensorStats]]] = {}
    for stats in tensors:
        groups = by_source.setdefault(stats.source, {})
        groups.setdefault(spec.key(stats.name), []).append(stats)
    layers: list[Layer] = []
    for source, groups in by_source.items():
        for key in model_order(groups):
            group = groups[key]
            layers.append(
                Layer(
                    name=key,
                    source=source,
                    tensors=len(group),
                    numel=sum(t.numel for t in group),
                    norm=combine_norms(t.norm for t in group),
                    max_abs=max(t.max_abs for t in group),
                    nan=sum(t.nan for t in group),
                    pos_inf=sum(t.pos_inf for t in group),
                    neg_inf=sum(t.neg_inf for t in group),
                    findings=tuple(f for t in group for f in by_tensor.get((source, t.name), [])),
                )
            )
    return tuple(layers)
