"""``--output`` and ``--plot`` never replace a file the run reads.

The files a run reads are found after expansion (checkpoints in a directory,
the shards of a sharded index) plus the config file; "the same file" includes
another name for it (a symbolic link in the inputs, a hard link).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.io.discover import files_read
from tests.conftest import runner


def run(*args: str) -> Any:
    return runner.invoke(app, [*args, "--no-config"], env={"COLUMNS": "120", "NO_COLOR": "1"})


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoint directory with two dumps and a subdirectory holding a third."""
    folder = tmp_path / "d"
    (folder / "sub").mkdir(parents=True)
    save_file({"w": torch.ones(3)}, str(folder / "a.safetensors"))
    save_file({"w": torch.ones(3)}, str(folder / "b.safetensors"))
    save_file({"w": torch.ones(3)}, str(folder / "sub" / "c.safetensors"))
    return folder


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """A two-shard checkpoint; returns its index."""
    folder = tmp_path / "sh"
    folder.mkdir()
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    for name, shard in shards.items():
        save_file({name: torch.ones(3)}, str(folder / shard))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": shards}), encoding="utf-8")
    return index


def refused(*args: str) -> Any:
    result = run(*args)
    assert result.exit_code == ExitCode.USAGE_ERROR, result.output
    assert "gradaudit never writes to inputs" in result.stderr
    assert result.stdout == ""
    return result


def test_a_checkpoint_found_in_a_directory_is_not_overwritten(folder: Path) -> None:
    target = folder / "a.safetensors"
    before = digest(target)
    refused("scan", str(folder), "-o", str(target), "--format", "json")
    refused("trend", str(folder), "-o", str(target), "--format", "json")
    assert digest(target) == before
    assert sorted(p.name for p in folder.iterdir()) == ["a.safetensors", "b.safetensors", "sub"]


def test_recursive_reaches_subdirectories_and_only_then_refuses(folder: Path) -> None:
    deep = folder / "sub" / "c.safetensors"
    before = digest(deep)
    refused("scan", str(folder), "-r", "-o", str(deep), "--format", "json")
    assert digest(deep) == before
    # Without --recursive the subdirectory is not read, so writing there is allowed.
    report = folder / "sub" / "report.json"
    assert run("scan", str(folder), "-o", str(report), "-f", "json").exit_code == ExitCode.OK
    assert json.loads(report.read_text())["summary"]["tensors"] == 2


def test_a_shard_reached_through_its_index_is_not_overwritten(sharded: Path) -> None:
    shard = sharded.parent / "model-00001-of-00002.safetensors"
    before = digest(shard)
    refused("scan", str(sharded), "-o", str(shard), "--format", "json")
    refused("compare", str(sharded), str(sharded), "-o", str(shard))
    assert digest(shard) == before
    refused("scan", str(sharded), "-o", str(sharded))  # the index itself


def test_a_hard_link_to_an_input_is_refused(folder: Path) -> None:
    source = folder / "a.safetensors"
    alias = folder.parent / "report.json"
    os.link(source, alias)
    before = digest(source)
    result = refused("scan", str(source), "-o", str(alias), "--format", "json")
    assert f"is an input ({source})" in result.stderr
    refused("scan", str(folder), "-o", str(alias), "--format", "json")
    refused("compare", str(source), str(folder / "b.safetensors"), "-o", str(alias))
    refused("trend", str(folder), "-o", str(alias))
    assert digest(source) == before


def test_an_input_reached_through_a_symbolic_link_is_refused(folder: Path) -> None:
    link = folder.parent / "link.safetensors"
    link.symlink_to(folder / "a.safetensors")
    refused("scan", str(link), "-o", str(folder / "a.safetensors"), "--format", "json")


def test_the_config_file_is_read_too(folder: Path, tmp_path: Path) -> None:
    config = tmp_path / "gradaudit.toml"
    config.write_text('format = "json"\n', encoding="utf-8")
    result = runner.invoke(
        app, ["scan", str(folder), "--config", str(config), "-o", str(config)], env={}
    )
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert config.read_text(encoding="utf-8") == 'format = "json"\n'


def test_plot_targets_are_checked_the_same_way(folder: Path, sharded: Path) -> None:
    pytest.importorskip("matplotlib")
    shard = sharded.parent / "model-00002-of-00002.safetensors"
    png = shard.with_suffix(".png")
    os.link(shard, png)
    before = digest(shard)
    refused("scan", str(sharded), "--plot", str(png))
    refused("trend", str(sharded), "--plot", str(png))
    assert digest(shard) == before


def test_files_read_lists_expanded_inputs_and_shards(folder: Path, sharded: Path) -> None:
    read = files_read([folder, sharded])
    assert read == [
        str(folder / "a.safetensors"),
        str(folder / "b.safetensors"),
        str(sharded),
        str(sharded.parent / "model-00001-of-00002.safetensors"),
        str(sharded.parent / "model-00002-of-00002.safetensors"),
    ]
    assert str(folder / "sub" / "c.safetensors") in files_read([folder], recursive=True)


@pytest.mark.parametrize(
    ("layout", "inside"),
    [
        ({".metadata": b"dcp", "__0_0.distcp": b"data"}, ".metadata"),
        (
            {
                "trainer_state.json": b'{"log_history": []}',
                "model.safetensors": b"",
                "optimizer.pt": b"opt",
            },
            "optimizer.pt",
        ),
        ({"trainer_state.json": b'{"log_history": []}', "model.safetensors": b""}, "x"),
    ],
)
def test_a_file_inside_a_checkpoint_directory_is_not_overwritten(
    tmp_path: Path, layout: dict[str, bytes], inside: str
) -> None:
    """A DCP or Trainer directory is one input whose reader opens the files inside it:
    ``-o ckpt/.metadata`` would replace the checkpoint's index with the report."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name, data in layout.items():
        (checkpoint / name).write_bytes(data)
    if "model.safetensors" in layout:
        save_file({"w": torch.ones(3)}, str(checkpoint / "model.safetensors"))
    target = checkpoint / inside
    if inside == "x":  # a new file in the directory is not an input: writing it is allowed
        assert str(target) not in files_read([checkpoint])
        return
    before = digest(target)
    refused("scan", str(checkpoint), "-o", str(target), "--format", "json")
    refused("compare", str(checkpoint), str(checkpoint), "-o", str(target), "-f", "json")
    assert digest(target) == before
