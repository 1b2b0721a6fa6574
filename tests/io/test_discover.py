"""Directory expansion: known files, --recursive, symlink loops, skipped entries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gradaudit.io.discover import BadInput, FileInput, SkippedPath, expand_inputs, input_kind
from tests.hostile import good_checkpoint, good_safetensors, sharded


def expand(*paths: Path, recursive: bool = False) -> list[object]:
    return list(expand_inputs(paths, recursive=recursive))


def files(entries: list[object]) -> list[str]:
    return [e.path for e in entries if isinstance(e, FileInput)]


def skipped(entries: list[object]) -> dict[str, str]:
    return {e.path: e.reason for e in entries if isinstance(e, SkippedPath)}


def test_input_kind_by_name() -> None:
    assert input_kind("a/model.safetensors.index.json") == "index"
    assert input_kind("MODEL.SAFETENSORS") == "safetensors"
    for name in ("x.pt", "x.PTH", "pytorch_model.bin", "last.ckpt"):
        assert input_kind(name) == "pickle"
    for name in ("x.json", "x.npz", "x.pt.gz", "pytorch_model.bin.index.json", "pt"):
        assert input_kind(name) is None


def test_a_directory_lists_checkpoints_and_accounts_for_everything_else(tmp_path: Path) -> None:
    good_safetensors(tmp_path, "b.safetensors")
    good_checkpoint(tmp_path, "a.pt")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    good_checkpoint(tmp_path / "sub", "inner.ckpt")
    (tmp_path / ".git").mkdir()
    good_checkpoint(tmp_path / ".git", "hidden.pt")
    os.mkfifo(tmp_path / "pipe")

    flat = expand(tmp_path)
    assert files(flat) == [str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors")]
    assert skipped(flat) == {
        str(tmp_path / ".git"): "hidden directory; not searched",
        str(
            tmp_path / "config.json"
        ): "model companion file (config, tokenizer, docs); not audited",
        str(tmp_path / "pipe"): "not a regular file; not audited",
        str(tmp_path / "sub"): "directory; not searched (use --recursive)",
    }
    assert all(e.within == str(tmp_path) for e in flat if isinstance(e, SkippedPath))

    deep = expand(tmp_path, recursive=True)
    assert files(deep) == [
        str(tmp_path / "a.pt"),
        str(tmp_path / "b.safetensors"),
        str(tmp_path / "sub" / "inner.ckpt"),
    ]
    assert str(tmp_path / ".git") in skipped(deep)


def test_shards_are_covered_by_their_index(tmp_path: Path) -> None:
    index = sharded(tmp_path)
    good_safetensors(tmp_path, "stray.safetensors")
    entries = expand(tmp_path)
    assert files(entries) == [str(index), str(tmp_path / "stray.safetensors")]
    assert skipped(entries) == {}


def test_symlink_loops_end_and_files_are_audited_once(tmp_path: Path) -> None:
    good_checkpoint(tmp_path, "a.pt")
    (tmp_path / "again.pt").symlink_to(tmp_path / "a.pt")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to(tmp_path)  # a loop back to the root
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere")
    (tmp_path / "dangling.pt").symlink_to(tmp_path / "nowhere.pt")

    entries = expand(tmp_path, tmp_path / "a.pt", recursive=True)

    # The dangling .pt is handed on: its reader says "dangling symlink", with exit 3.
    assert files(entries) == [str(tmp_path / "a.pt"), str(tmp_path / "dangling.pt")]
    assert skipped(entries) == {
        str(tmp_path / "again.pt"): f'same file as "{tmp_path / "a.pt"}"; audited once',
        str(tmp_path / "dangling.json"): "dangling symlink; not audited",
        str(tmp_path / "sub" / "up"): "directory already searched (a symlink loop?); skipped",
        str(tmp_path / "a.pt"): "given more than once; audited once",
    }


def test_a_given_file_is_taken_even_with_an_unknown_name(tmp_path: Path) -> None:
    # Explicit files go to open_source, which explains what is wrong with them.
    odd = tmp_path / "weights.npz"
    odd.write_bytes(b"x")
    assert files(expand(odd, tmp_path / "missing.pt")) == [
        str(odd),
        str(tmp_path / "missing.pt"),
    ]


def test_a_directory_without_checkpoints_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    torch.save({"w": torch.ones(1)}, tmp_path / "sub" / "deep.pt")
    entries = expand(tmp_path)
    (error,) = [e for e in entries if isinstance(e, BadInput)]
    assert error.path == str(tmp_path)
    assert error.cause.startswith("no checkpoint file in this directory (looked for ")
    assert error.cause.endswith("; 1 subdirectories not searched (use --recursive)")
    assert files(expand(tmp_path, recursive=True)) == [str(tmp_path / "sub" / "deep.pt")]


def test_a_distributed_checkpoint_directory_is_one_input(tmp_path: Path) -> None:
    """A DCP directory is read as a whole; its .metadata and .distcp files are not listed."""
    (tmp_path / ".metadata").write_bytes(b"x")
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("x")
    entries = expand(tmp_path)
    assert files(entries) == [str(tmp_path)]
    assert [e.path for e in entries if isinstance(e, SkippedPath)] == [str(tmp_path / "notes.txt")]
    assert files(expand(tmp_path.parent / tmp_path.name)) == [str(tmp_path)]


def test_distcp_files_without_metadata_get_a_hint(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    (error,) = [e for e in expand(tmp_path) if isinstance(e, BadInput)]
    assert "torch.distributed.checkpoint data (.distcp) but no .metadata" in error.cause


def test_an_unlistable_directory_is_an_input_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def deny(path: object) -> object:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "scandir", deny)
    (error, *_) = expand(tmp_path)
    assert isinstance(error, BadInput)
    assert error.cause == "cannot list the directory: permission denied"


def test_recursive_stays_inside_the_tree_it_was_given(tmp_path: Path) -> None:
    """A planted link to / (or /proc, /usr) would crawl the machine under -r."""
    tree = tmp_path / "run"
    (tree / "inner").mkdir(parents=True)
    good_checkpoint(tree / "inner", "a.pt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    good_checkpoint(outside, "b.pt")
    (tree / "root").symlink_to("/")
    (tree / "out").symlink_to(outside)
    (tree / "within").symlink_to(tree / "inner")  # a link within the tree is followed

    entries = expand(tree, recursive=True)

    assert files(entries) == [str(tree / "inner" / "a.pt")]
    reason = "symbolic link out of the input directory; not searched"
    assert skipped(entries) == {
        str(tree / "root"): reason,
        str(tree / "out"): reason,
        str(tree / "within"): "directory already searched (a symlink loop?); skipped",
    }
