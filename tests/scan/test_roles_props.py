"""Properties of the role decision, the cast check and the health score."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradaudit import audit
from gradaudit.policy import CAST_TARGETS, FindingKind, Role, Severity, Thresholds
from gradaudit.results import Finding, TensorStats
from gradaudit.roles import stats_evidence
from gradaudit.scan.judge import gradient_health
from gradaudit.scan.rules import cast_limits
from tests.models import gradients

_TORCH = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@pytest.mark.parametrize("target", CAST_TARGETS)
def test_cast_targets_are_the_precision_formats(target: str) -> None:
    from gradaudit.precision.formats import Precision

    assert Precision(target).value == target
    assert {p.value for p in Precision} == set(CAST_TARGETS)


@pytest.mark.parametrize("target", CAST_TARGETS)
def test_cast_limits_are_exactly_where_torch_stops_holding_values(target: str) -> None:
    overflow, flush_from = cast_limits(target)
    f32 = np.float32
    below = np.nextafter(f32(overflow), f32(0))
    flushes = np.nextafter(f32(flush_from), f32(0))
    values = torch.tensor(np.array([overflow, below, flush_from, flushes], dtype=np.float32))
    cast = values.to(_TORCH[target]).double()
    finfo = torch.finfo(_TORCH[target])
    # At the overflow limit the value leaves the range (Inf, or saturated for e4m3fn);
    # one float32 step below it rounds to the largest finite value.
    assert not (math.isfinite(cast[0]) and abs(float(values[0]) - float(cast[0])) < 1)
    assert float(cast[1]) == finfo.max
    # From flush_from up a value survives as the smallest subnormal; one step below, 0.
    assert float(cast[2]) > 0.0
    assert float(cast[3]) == 0.0


@pytest.mark.parametrize("target", CAST_TARGETS)
def test_cast_check_flags_weights_by_max_abs(target: str) -> None:
    overflow, flush_from = cast_limits(target)
    policy = Thresholds(cast_check=target, kind="weights")
    below = float(np.nextafter(np.float32(overflow), np.float32(0)))
    tiny = float(np.nextafter(np.float32(flush_from), np.float32(0)))
    fits = audit({"w": torch.tensor([below, 1.0])}, thresholds=policy)
    too_big = audit({"w": torch.tensor([overflow, 1.0])}, thresholds=policy)
    flushed = audit({"w": torch.tensor([tiny, -tiny, 0.0])}, thresholds=policy)
    survives = audit({"w": torch.tensor([flush_from, 0.0])}, thresholds=policy)
    assert not [f for f in fits.findings if f.kind is FindingKind.CAST]
    assert [f.kind for f in too_big.findings] == [FindingKind.CAST]
    assert [f.kind for f in flushed.findings] == [FindingKind.CAST]
    assert not [f for f in survives.findings if f.kind is FindingKind.CAST]
    assert too_big.findings[0].failing


def _random_stack(seed: int, width: int, depth: int, norm: str) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Linear(width, width))
        if norm == "layer":
            layers.append(nn.LayerNorm(width))
        elif norm == "batch":
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.Tanh())
    layers.append(nn.Linear(width, 3))
    return nn.Sequential(*layers)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    width=st.sampled_from([16, 32, 64, 128]),
    depth=st.integers(1, 3),
    norm=st.sampled_from(["layer", "batch"]),
    scale=st.sampled_from([0.1, 1.0, 10.0]),
    batch=st.sampled_from([2, 8, 32]),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_weights_with_norm_layers_and_their_gradients_are_told_apart(
    seed: int, width: int, depth: int, norm: str, scale: float, batch: int, reduction: str
) -> None:
    """Measured over 600 random stacks too (docs/roles.md): no gradient file read as weights."""
    model = _random_stack(seed, width, depth, norm)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed)) * scale
    loss = (model(x) - 1).pow(2)
    (loss.sum() if reduction == "sum" else loss.mean()).backward()
    weight_file = audit({k: v for k, v in model.state_dict().items() if v.is_floating_point()})
    gradient_file = audit(gradients(model))
    assert stats_evidence(weight_file.tensors).role is Role.WEIGHT
    assert stats_evidence(gradient_file.tensors).role is Role.GRADIENT


_stats = st.builds(
    lambda n, nan, zeros, i: TensorStats(
        f"t{i}", (n,), "float32", n, min(nan, n), 0, 0, 0, 1.0, 1.0, 0.1
    ),
    st.integers(0, 1000),
    st.integers(0, 5),
    st.integers(0, 3),
    st.integers(0, 10**6),
)


@settings(max_examples=200, derandomize=True)
@given(
    tensors=st.lists(_stats, max_size=12, unique_by=lambda t: t.name),
    flags=st.lists(st.booleans(), max_size=12),
)
def test_gradient_health_is_bounded_and_halved_by_any_nonfinite(
    tensors: list[TensorStats], flags: list[bool]
) -> None:
    findings = [
        Finding(FindingKind.OUTLIER, Severity.WARNING, t.name, "")
        for t, flagged in zip(tensors, flags, strict=False)
        if flagged
    ]
    health = gradient_health(tensors, findings)
    assert 0.0 <= health <= 1.0
    if any(t.nonfinite for t in tensors):
        assert health <= 0.5
    elif not findings and sum(t.numel for t in tensors):
        assert health == 1.0
    if not sum(t.numel for t in tensors):
        assert health == 0.0
