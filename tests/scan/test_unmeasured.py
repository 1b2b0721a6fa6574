"""A tensor with no finite element never shows a norm of 0: that reads as a dead layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gradaudit.cli import app
from tests.conftest import runner


def scan(*args: str) -> str:
    result = runner.invoke(
        app, ["scan", *args, "--no-config"], env={"COLUMNS": "160", "NO_COLOR": "1"}
    )
    assert result.exit_code == 1, result.output
    return result.stdout


def test_all_nan_tensors_show_nan_and_null_never_zero(tmp_path: Path) -> None:
    dead = tmp_path / "dead.safetensors"
    save_file({"a": torch.full((4,), float("nan")), "b": torch.full((3,), float("inf"))}, str(dead))
    mixed = tmp_path / "mixed.safetensors"
    save_file({"a": torch.full((4,), float("nan")), "b": torch.ones(4)}, str(mixed))

    document = json.loads(scan(str(dead), str(mixed), "--format", "json"))
    tensors = {(Path(t["file"]).name, t["name"]): t for t in document["tensors"]}
    for key in (("dead.safetensors", "a"), ("dead.safetensors", "b"), ("mixed.safetensors", "a")):
        assert (tensors[key]["norm"], tensors[key]["max_abs"], tensors[key]["rms"]) == (
            None,
            None,
            None,
        )
    assert tensors[("mixed.safetensors", "b")]["norm"] == 2.0
    assert document["summary"]["global_norm"] == 2.0
    files = {Path(f["path"]).name: f["global_norm"] for f in document["files"]}
    assert files == {"dead.safetensors": None, "mixed.safetensors": 2.0}

    alone = json.loads(scan(str(dead), "--format", "json"))
    assert alone["summary"]["global_norm"] is None

    table = scan(str(dead))
    rows = [line for line in table.splitlines() if line.startswith("│")]
    assert rows
    assert all(" nan " in row for row in rows)
    assert " 0 " not in "".join(row.split("│")[4] for row in rows)  # the norm column
    assert "global norm nan" in table
