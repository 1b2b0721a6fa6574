"""The installed entry points on the committed fixtures, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from gradaudit import DEFAULT_VANISHING_THRESHOLD
from tests.conftest import FIXTURES


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradaudit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "120", "NO_COLOR": "1"},
        cwd=Path(__file__).resolve().parent.parent,
    )


def test_python_m_gradaudit_scans_the_demo_fixture() -> None:
    result = run("scan", str(FIXTURES / "demo_grads.safetensors"))
    assert result.returncode == 1, result.stderr
    assert "head.weight" in result.stdout
    assert "layers.1.fc2.weight" in result.stdout
    assert "FAIL" in result.stdout
    assert result.stderr == ""


def test_healthy_fixture_passes_and_json_round_trips() -> None:
    result = run("scan", str(FIXTURES / "healthy_grads.safetensors"), "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 0
    assert doc["summary"]["tensors"] == 35
    assert doc["summary"]["vanishing_tensors"] == 2  # attention key biases, by design


def test_fixtures_are_reproducible() -> None:
    """The committed fixtures are what the generator script makes, to float32 rounding.

    The gradients come from a real forward and backward pass, whose last bits depend
    on the CPU's kernels (AVX-512 vs AVX2 vs scalar, thread count): those are compared
    with a tolerance. What was planted is checked exactly: the NaN's position, the
    exploding layer's scale, the integer step, and that the attention key biases
    vanish by construction (softmax ignores them).
    """
    sys.path.insert(0, str(FIXTURES))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(FIXTURES))
    from safetensors.torch import load_file

    committed = load_file(str(FIXTURES / "demo_grads.safetensors"))
    regenerated = make_fixtures.demo_gradients()
    assert committed.keys() == regenerated.keys()
    for name, tensor in committed.items():
        fresh = regenerated[name]
        assert (tensor.dtype, tensor.shape) == (fresh.dtype, fresh.shape), name
        assert tensor.isnan().equal(fresh.isnan()), name
        if not tensor.is_floating_point():
            assert tensor.equal(fresh), name
            continue
        if name.endswith(".k.bias"):
            continue  # zero by construction: only rounding noise, checked by magnitude below
        # Relative to the tensor's scale: one float32 rounding of the backward pass is
        # ~1e-7 of it; 1e-4 leaves room for a different summation order, not for a change.
        scale = fresh.nan_to_num().abs().max().item()
        assert torch.allclose(tensor, fresh, rtol=1e-4, atol=1e-4 * scale, equal_nan=True), name
    nan_at = committed["head.weight"].isnan().nonzero().tolist()
    assert nan_at == [[3, 5]]
    assert sum(int(t.isnan().sum()) for t in committed.values() if t.is_floating_point()) == 1
    exploding = committed["layers.1.fc2.weight"].norm().item()
    healthy = committed["layers.0.fc2.weight"].norm().item()
    assert exploding > 1e4 * healthy
    for index in range(make_fixtures.LAYERS):
        for grads in (committed, regenerated):
            key_bias = grads[f"layers.{index}.k.bias"].double().norm().item()
            assert key_bias < DEFAULT_VANISHING_THRESHOLD  # what the scans report
            assert key_bias < 1e-5 * grads[f"layers.{index}.q.bias"].double().norm().item()
    assert committed["step"].item() == 1000
