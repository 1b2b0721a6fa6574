"""A checkpoint of a run that diverged fails even when every value is finite.

The limits (``scan/rules.py``) were measured on the real-world corpus (``corpus/``):
healthy published and trained weights at most 73 (RMS x sqrt(fan-in)) and 1.3 (norm
scale RMS); every weight of a run diverged by its learning rate at least 4e4 and 1e4.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import scan_paths
from gradaudit.policy import FindingKind
from gradaudit.results import TensorStats
from gradaudit.results.verdict import exit_code
from gradaudit.scan.rules import (
    DIVERGED_MATRIX_SCALE,
    DIVERGED_NORM_SCALE,
    diverged_weight,
    is_norm_scale,
)
from tests.models import bert_like, train, weights


@pytest.mark.parametrize(
    ("name", "norm"),
    [
        ("bert.encoder.layer.0.attention.output.LayerNorm.weight", True),
        ("transformer.h.1.ln_1.weight", True),
        ("transformer.ln_f.weight", True),
        ("layer1.0.bn1.weight", True),
        ("conv1_BN.weight", True),
        ("model.norm.weight", True),
        ("blocks.0.norm1.scale", True),
        ("bert.encoder.layer.0.attention.output.LayerNorm.bias", False),
        ("classifier.weight", False),
        ("model.cent_table", False),
        ("lnweight", False),
    ],
)
def test_normalisation_scales_by_name(name: str, norm: bool) -> None:
    assert is_norm_scale(name) is norm


def stats(name: str, values: torch.Tensor) -> TensorStats:
    finite = values.double()
    norm = float(finite.norm())
    return TensorStats(
        name=name,
        shape=tuple(values.shape),
        dtype="float32",
        numel=values.numel(),
        nan=0,
        pos_inf=0,
        neg_inf=0,
        zeros=int((values == 0).sum()),
        max_abs=float(values.abs().max()),
        norm=norm,
        rms=norm / math.sqrt(values.numel()),
    )


def test_the_limits_sit_between_healthy_and_diverged_scales() -> None:
    fan_in = 64
    healthy = torch.randn(32, fan_in) / math.sqrt(fan_in) * 70  # 70x Kaiming: still healthy
    assert diverged_weight(stats("fc.weight", healthy)) is None
    blown = torch.randn(32, fan_in) * (2 * DIVERGED_MATRIX_SCALE / math.sqrt(fan_in))
    message = diverged_weight(stats("fc.weight", blown))
    assert message is not None
    assert "fan-in 64" in message
    assert diverged_weight(stats("ln.weight", torch.full((8,), 1.3))) is None
    big = torch.full((8,), 2 * DIVERGED_NORM_SCALE)
    assert diverged_weight(stats("ln.weight", big)) is not None
    assert diverged_weight(stats("cent_table", big)) is None  # not a norm scale: a table


def test_a_real_run_diverged_by_its_learning_rate_fails_naming_its_layers(
    tmp_path: Path,
) -> None:
    """AdamW at lr 1e4 on a BERT-style model: every value finite, the weights ~1e4."""
    healthy, diverged = bert_like(), bert_like()
    train(healthy, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), steps=5)
    train(diverged, lambda m: torch.optim.AdamW(m.parameters(), lr=1e4), steps=1)
    for model, name in ((healthy, "healthy"), (diverged, "diverged")):
        state = weights(model)
        assert all(torch.isfinite(t).all() for t in state.values())
        save_file(state, str(tmp_path / f"{name}.safetensors"), metadata={"format": "pt"})
    ok = scan_paths([tmp_path / "healthy.safetensors"])
    assert exit_code(ok) == 0
    bad = scan_paths([tmp_path / "diverged.safetensors"])
    assert exit_code(bad) == 1
    flagged = {f.tensor for f in bad.findings if f.kind is FindingKind.EXPLODING and f.failing}
    assert any("LayerNorm.weight" in name for name in flagged)
    assert any(name.endswith("dense.weight") for name in flagged)
