"""Per-parameter gradient estimates from optimizer state (apart from the judge).

An Adam ``exp_avg_sq`` (and its kin) says how large the gradients were; the formulas are
:func:`gradaudit.roles.estimate_value`'s, this module merges them per parameter and file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gradaudit.policy import (
    Role,
)
from gradaudit.results import (
    GradientEstimate,
    TensorStats,
)
from gradaudit.results.roles import TensorHint
from gradaudit.roles import (
    estimate_value,
)


def gradient_estimates(
    tensors: Sequence[TensorStats],
    hints: Sequence[TensorHint | None],
    derived: Mapping[tuple[str | None, str | None, str], TensorStats],
) -> tuple[tuple[GradientEstimate, ...], list[tuple[TensorStats, float]]]:
    """Per-parameter gradient estimates from optimizer state, and negative second moments.

    One estimate per parameter and file: the RMS norm from its second moment, the mean
    norm from its first moment (see :func:`gradaudit.roles.estimate_value`).
    """
    merged: dict[tuple[str | None, str], GradientEstimate] = {}
    negatives: list[tuple[TensorStats, float]] = []
    for stats, hint in zip(tensors, hints, strict=True):
        if stats.role not in (Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT):
            continue
        lowest = derived.get((stats.source, stats.name, "neg"))
        if lowest is not None and lowest.finite and lowest.max_abs > 0:
            negatives.append((stats, -lowest.max_abs))
        total = derived.get((stats.source, stats.name, "sum"))
        if hint is None or hint.basis is None:
            continue
        basis = hint.basis
        step_row = derived.get((stats.source, stats.name, "step"))
        step = basis.step if step_row is None else step_row.max_abs
        rms, mean, corrected = estimate_value(
            basis, stats.norm, total.max_abs if total is not None and total.finite else None, step
        )
        if rms is None and mean is None:
            continue
        key = stats.name.split(" (", 1)[0].rsplit(".", 1)[0]
        parameter = hint.param or key
        what = stats.name.split(" (", 1)[0].rsplit(".", 1)[-1]
        label = f"from {what}"
        if corrected and step:
            label += f", bias-corrected at step {step:g}"
        previous = merged.get((stats.source, parameter))
        if previous is None:
            previous = GradientEstimate(parameter, stats.name, stats.source, label)
        if rms is not None:
            previous = dataclasses.replace(
                previous,
                tensor=stats.name,
                basis=label,
                rms_norm=rms,
                step=step,
                bias_corrected=corrected,
            )
        else:
            previous = dataclasses.replace(previous, mean_norm=mean)
            if previous.rms_norm is None:
                previous = dataclasses.replace(
                    previous, tensor=stats.name, basis=label, step=step, bias_corrected=corrected
                )
        merged[(stats.source, parameter)] = previous
    return tuple(merged.values()), negatives
