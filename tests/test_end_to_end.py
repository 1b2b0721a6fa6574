"""The installed entry points on the committed fixtures, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_fixtures_are_reproducible(tmp_path: Path) -> None:
    """The committed fixtures are exactly what the generator script makes."""
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
        assert tensor.equal(regenerated[name]) or (
            tensor.isnan().any() and tensor.nan_to_num().equal(regenerated[name].nan_to_num())
        ), name
