"""Sharded safetensors: the whole index is validated before any tensor is read."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import scan_paths
from gradaudit.errors import InputError
from gradaudit.io import open_source
from gradaudit.io.sharded import ShardedSource, parse_index, referenced_shards
from tests.hostile import CASES, sharded


def test_index_and_directory_audit_every_tensor_under_the_index(tmp_path: Path) -> None:
    index = sharded(tmp_path / "ckpt")
    for given in (index, tmp_path / "ckpt"):
        report = scan_paths([given], device="cpu")
        assert [t.name for t in report.tensors] == ["a", "b", "c"]
        assert {t.source for t in report.tensors} == {str(index)}
        assert [f.path for f in report.files] == [str(index)]
        assert report.files[0].tensors == 3
        assert report.summary.global_norm == pytest.approx(13**0.5)
        assert report.skipped == ()


def test_shards_in_subdirectories_and_hugging_face_style_symlinks(tmp_path: Path) -> None:
    # The HF cache: snapshot files are symlinks into ../../blobs; following them is fine,
    # only the names in the index are checked for escaping.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    (snapshot / "sub").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(blobs / "1111"))
    save_file({"b": torch.ones(3)}, str(blobs / "2222"))
    (snapshot / "m-1.safetensors").symlink_to(blobs / "1111")
    (snapshot / "sub" / "m-2.safetensors").symlink_to(blobs / "2222")
    index = snapshot / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"a": "m-1.safetensors", "b": "./sub/m-2.safetensors"}})
    )
    report = scan_paths([index], device="cpu")
    assert [t.name for t in report.tensors] == ["a", "b"]
    assert not report.errors


def test_nothing_is_read_when_the_last_shard_is_bad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = CASES["shard-corrupt"].build(tmp_path)
    opened: list[str] = []
    import gradaudit.io.safetensors_map as module

    real_map = module.MappedSafetensors.map

    def spy(self: module.MappedSafetensors) -> object:
        opened.append(self.path)
        return real_map(self)

    monkeypatch.setattr(module.MappedSafetensors, "map", spy)
    with pytest.raises(InputError, match=re.escape('shard "m-2.safetensors"')):
        open_source(index)
    assert opened == []


def test_excluded_tensors_of_a_shard_are_not_loaded(tmp_path: Path) -> None:
    index = sharded(tmp_path / "ckpt")
    report = scan_paths([index], device="cpu", include=["c"])
    assert [t.name for t in report.tensors] == ["c"]
    assert report.summary.excluded == 2


def test_parse_index_keeps_map_order_per_shard(tmp_path: Path) -> None:
    index = sharded(tmp_path / "ckpt")
    assert parse_index(str(index)) == {
        "m-1.safetensors": ["a", "b"],
        "m-2.safetensors": ["c"],
    }
    assert referenced_shards(str(index)) == [
        os.path.normpath(tmp_path / "ckpt" / "m-1.safetensors"),
        os.path.normpath(tmp_path / "ckpt" / "m-2.safetensors"),
    ]


@pytest.mark.parametrize(
    ("document", "cause"),
    [
        ("[]", "not a JSON object"),
        ("{}", 'no "weight_map" object'),
        ('{"weight_map": {}}', "lists no tensors"),
        ('{"weight_map": {"a": 3}}', "not a file name"),
        ('{"weight_map": {"a": ""}}', "invalid shard"),
        ('{"weight_map": {"a": "C:\\\\x.safetensors"}}', "absolute path"),
        ('{"weight_map": {"a": "sub\\\\..\\\\..\\\\x.safetensors"}}', "escapes"),
        ('{"weight_map": {"a": "x.safetensors.json"}}', "not a .safetensors file"),
    ],
)
def test_bad_indexes(tmp_path: Path, document: str, cause: str) -> None:
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(document)
    with pytest.raises(InputError, match=re.escape(cause)):
        ShardedSource(str(index))
    assert referenced_shards(str(index)) == []


def test_index_too_large_or_not_utf8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = tmp_path / "m.safetensors.index.json"
    index.write_bytes(b'{"weight_map": {"\xe9": "a.safetensors"}}')
    with pytest.raises(InputError, match="not valid UTF-8"):
        parse_index(str(index))
    monkeypatch.setattr("gradaudit.io.sharded.MAX_INDEX_BYTES", 10)
    with pytest.raises(InputError, match="absurdly large"):
        parse_index(str(index))


def test_an_index_of_more_shards_than_the_old_guard_table_is_read(tmp_path: Path) -> None:
    """1,025 shards ended in exit 4 ("too many guarded ranges": the SIGBUS guard held 1024
    ranges) on the default path, while --engine eager read them."""
    import json

    from safetensors.torch import save_file

    from gradaudit import scan_paths
    from gradaudit.results.verdict import exit_code

    count = 1025
    weight_map = {}
    for index in range(count):
        shard = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        save_file({f"layer{index}.weight": torch.full((2,), 0.5)}, str(tmp_path / shard))
        weight_map[f"layer{index}.weight"] = shard
    index_path = tmp_path / "model.safetensors.index.json"
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    report = scan_paths([index_path], device="cpu")
    assert not report.errors
    assert report.summary.tensors == count
    assert exit_code(report) == 0
