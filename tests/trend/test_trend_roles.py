"""``trend`` and ``compare`` speak of what the files hold, or refuse (issue 26 item 7)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}


def model_file(path: Path, scale: float) -> Path:
    torch.manual_seed(0)
    state = {
        "enc.weight": torch.randn(16, 16) * 0.25 * scale,
        "enc.bias": torch.zeros(16),
        "head.weight": torch.randn(4, 16) * 0.25 * scale,
    }
    save_file(state, str(path), metadata={"format": "pt"})  # as transformers writes weights
    return path


def training_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return path


def test_a_trend_of_model_files_is_titled_by_weights(tmp_path: Path) -> None:
    paths = [str(model_file(tmp_path / f"step-{s}.safetensors", 1 + s / 100)) for s in (10, 20)]
    result = runner.invoke(app, ["trend", *paths, "--no-config"], env=ENV)
    assert result.exit_code == ExitCode.OK, result.stdout
    assert "Weight norm per layer over 2 steps" in result.stdout
    assert "Gradient norm" not in result.stdout


def test_a_trend_of_training_checkpoints_is_refused_naming_what_to_trend(tmp_path: Path) -> None:
    paths = [str(training_checkpoint(tmp_path / f"ckpt-{s}.pt")) for s in (1, 2)]
    result = runner.invoke(app, ["trend", *paths, "--no-config"], env=ENV)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "read as training checkpoint" in result.stderr
    assert "trend its model files for weights" in result.stderr


def test_a_comparison_of_weights_speaks_of_weights(tmp_path: Path) -> None:
    a = model_file(tmp_path / "a.safetensors", 1.0)
    b = model_file(tmp_path / "b.safetensors", 2.0)
    result = runner.invoke(app, ["compare", str(a), str(b), "--no-config"], env=ENV)
    assert result.exit_code == ExitCode.OK, result.stdout
    flat = " ".join(result.stdout.split())
    assert "B's weights are 2× as large per parameter as A's" in flat
    assert "gradients" not in flat
