"""The CLI over several inputs, directories and --include/--exclude."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner
from tests.hostile import good_checkpoint, good_safetensors, sharded


def scan(*args: str, width: int = 160) -> Any:
    return runner.invoke(app, ["scan", *args], env={"COLUMNS": str(width), "NO_COLOR": "1"})


def dump(path: Path, nan: bool = False) -> Path:
    bias = torch.tensor([math.nan if nan else 1.0, 2.0])
    save_file(
        {
            "model.weight": torch.ones(2, 3),
            "model.bias": bias,
            "optimizer.state.0.exp_avg": torch.full((2, 3), 0.5),
            "optimizer.state.1.exp_avg": torch.full((2,), 0.5),
            "epoch": torch.tensor(1),
        },
        str(path),
    )
    return path


def training_checkpoint(path: Path, nan: bool = False) -> Path:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    weights = model.state_dict()
    if nan:
        weights["bias"][0] = math.nan
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), "epoch": 1}, path)
    return path


def test_include_and_exclude_on_a_training_checkpoint(tmp_path: Path) -> None:
    path = training_checkpoint(tmp_path / "train.pt", nan=True)

    only_model = scan(str(path), "--include", "model.*", "--format", "json")
    document = json.loads(only_model.stdout)
    assert only_model.exit_code == ExitCode.FINDINGS
    assert [t["name"] for t in document["tensors"]] == ["model.weight", "model.bias"]
    assert document["summary"]["excluded"] == 4  # 2 momentum buffers, param_groups, epoch
    assert document["files"][0]["excluded"] == 4
    assert document["skipped"] == []

    no_model = scan(str(path), "--exclude", "model.*", "--exclude", "epoch")
    assert no_model.exit_code == ExitCode.OK  # the NaN is in the model, left out
    assert "optimizer.state.0.momentum_buffer (model.weight)" in no_model.stdout
    assert "excluded 3 by --include/--exclude" in no_model.stdout


def test_include_and_exclude_select_tensors_and_count_the_rest(tmp_path: Path) -> None:
    path = dump(tmp_path / "train.safetensors", nan=True)

    only_model = scan(str(path), "--include", "model.*", "--format", "json")
    document = json.loads(only_model.stdout)
    assert only_model.exit_code == ExitCode.FINDINGS
    assert sorted(t["name"] for t in document["tensors"]) == ["model.bias", "model.weight"]
    assert document["summary"]["excluded"] == 3
    assert document["files"][0]["excluded"] == 3
    assert document["skipped"] == []

    no_model = scan(str(path), "--exclude", "model.*", "--exclude", "epoch")
    assert no_model.exit_code == ExitCode.OK  # the NaN is in the model, left out
    assert "optimizer.state.0.exp_avg" in no_model.stdout
    assert "excluded 3 by --include/--exclude" in no_model.stdout


def test_a_selection_that_matches_nothing_is_nothing_to_audit(tmp_path: Path) -> None:
    path = dump(tmp_path / "train.safetensors")
    result = scan(str(path), "--include", "modle.*")
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr == (
        "gradaudit: error: nothing to audit: --include/--exclude left no floating-point tensor "
        "(5 excluded)\n"
    )
    assert "INCOMPLETE: nothing to audit: --include/--exclude left" in result.stdout


def test_several_inputs_get_a_line_each_and_one_summary(tmp_path: Path) -> None:
    good = good_safetensors(tmp_path)
    sick = training_checkpoint(tmp_path / "sick.pt", nan=True)
    index = sharded(tmp_path / "sharded")
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"\x80\x02garbage")

    result = scan(str(good), str(sick), str(index), str(broken), width=400)

    assert result.exit_code == ExitCode.INPUT_ERROR
    rows = {
        line.split("│")[1].strip(): line
        for line in result.stdout.splitlines()
        if line.startswith("│") and "verdict" not in line and line.count("│") == 7
    }
    assert "ok" in rows[str(good)]
    assert "FAIL (nan)" in rows[str(sick)]
    assert "ok" in rows[str(index)]
    assert "error: " in rows[str(broken)]
    assert "Audited 8 tensors (25 elements) in 4 files" in result.stdout
    assert "skipped epoch in " + str(sick) in result.stdout
    assert len(result.stderr.splitlines()) == 1


def test_one_input_keeps_the_single_file_layout(tmp_path: Path) -> None:
    result = scan(str(dump(tmp_path / "one.safetensors")))
    assert "verdict" not in result.stdout
    assert "global norm" in result.stdout


def test_unreadable_input_is_an_input_error_not_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As root, chmod 0 does not stop reading, so the refusal is simulated at os.access.
    locked, good = dump(tmp_path / "locked.safetensors"), dump(tmp_path / "good.safetensors")
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode)
    )
    result = scan(str(good), str(locked))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr == f"gradaudit: error: {locked}: permission denied\n"
    assert "model.weight" in result.stdout


def test_directories_and_recursive(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    good_checkpoint(folder, "last.ckpt")
    (folder / "epoch-1").mkdir()
    good_checkpoint(folder / "epoch-1", "model.pth")
    (folder / "notes.md").write_text("x")

    flat = scan(str(folder), "--format", "json")
    assert flat.exit_code == ExitCode.OK
    document = json.loads(flat.stdout)
    assert [f["path"] for f in document["files"]] == [str(folder / "last.ckpt")]
    assert {s["name"]: s["reason"] for s in document["skipped"]} == {
        str(folder / "epoch-1"): "directory; not searched (use --recursive)",
        str(folder / "notes.md"): "not a checkpoint file (unknown extension); not audited",
        "step": "int value, not a tensor; not audited",
    }

    deep = scan(str(folder), "-r", "--format", "json")
    assert deep.exit_code == ExitCode.OK
    assert [f["path"] for f in json.loads(deep.stdout)["files"]] == [
        str(folder / "last.ckpt"),
        str(folder / "epoch-1" / "model.pth"),
    ]


def test_help_names_the_input_kinds_and_options() -> None:
    result = runner.invoke(app, ["scan", "--help"], env={"COLUMNS": "200"})
    text = " ".join(result.stdout.split())
    for words in (".safetensors.index.json", ".pt/.pth/.bin/.ckpt", "--include", "--exclude"):
        assert words in text
    assert "--recursive" in text
