"""Sentences and orderings shared by the comparison renderers, so table and JSON agree."""

from __future__ import annotations

import math

from gradaudit.comparison import Comparison, DualGradientStats, ParameterChange, SideStats

#: How the normalized ratio is defined, written into the JSON next to it.
FORMULA = "(seed_norm / host_norm) * sqrt(host_params / seed_params)"
#: The same, short enough for the table's ratio line.
SHORT_FORMULA = "raw × √(host_params / seed_params)"


def interpretation(dual: DualGradientStats) -> str:
    """One plain sentence on what the normalized ratio says."""
    ratio = dual.normalized_ratio
    if ratio is None:
        return f"ratio not computed: {dual.ratio_note}"
    if math.isinf(ratio):
        return "host gradients are zero: the seed's are infinitely more intense per parameter"
    if ratio == 0.0:
        return "seed gradients are zero: the seed receives no gradient"
    text = f"seed gradients are {ratio:.3g}× as intense per parameter as the host's"
    if ratio < 1.0:
        text += f" ({1.0 / ratio:.3g}× weaker)"
    return text


def side_input(side: SideStats) -> str:
    """Where a side's tensors come from: the file and the prefix, if any."""
    where = side.path if side.path is not None else "(in memory)"
    return f"{where} [{side.prefix}*]" if side.prefix else where


def change_order(change: ParameterChange) -> tuple[int, float]:
    """Flagged first, then not comparable, then the rest; each by how far B/A is from 1."""
    if change.ratio is None:
        return (1, 0.0)
    distance = math.inf if change.ratio in (0.0, math.inf) else abs(math.log(change.ratio))
    return (0 if change.flagged else 2, -distance)


def failing_kinds(comparison: Comparison) -> list[str]:
    """The kinds of every failing finding, tensor-level and comparison-level, sorted."""
    kinds = {f.kind.value for f in comparison.tensor_findings if f.failing}
    kinds |= {f.kind.value for f in comparison.findings if f.failing}
    return sorted(kinds)
