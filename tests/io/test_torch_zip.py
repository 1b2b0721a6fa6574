"""The zip container checks that run before torch reads a checkpoint."""

from __future__ import annotations

import re
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from gradaudit.cli import app
from gradaudit.errors import InputError
from gradaudit.io import torch_zip
from gradaudit.io.torch_zip import check_storages, inspect_torch_zip
from tests.conftest import runner
from tests.hostile import CASES, good_checkpoint, member_names, member_span


def refused(path: Path, cause: str) -> None:
    with pytest.raises(InputError, match=re.escape(cause)):
        inspect_torch_zip(str(path))


def test_a_valid_checkpoint_lists_its_records(tmp_path: Path) -> None:
    path = good_checkpoint(tmp_path, "ckpt.pt")
    archive = inspect_torch_zip(str(path))
    assert archive.prefix == "ckpt"
    assert {"data.pkl", "data/0", "version", "byteorder"} <= set(archive.records)
    offset, size = member_span(path, "ckpt/data/0")
    assert (archive.records["data/0"].offset, archive.records["data/0"].size) == (offset, size)


def test_crc_mismatch_is_found_in_threads_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = CASES["zip-crc-mismatch"].build(tmp_path)
    refused(path, "fails its CRC-32 check")
    monkeypatch.setattr(torch_zip, "_THREADS_FROM_BYTES", 0)
    monkeypatch.setattr(torch_zip, "CRC_CHUNK_BYTES", 64)  # many chunks per member
    refused(path, 'zip member "flipped/data/0" fails its CRC-32 check')
    inspect_torch_zip(str(good_checkpoint(tmp_path)))  # and a good file still passes


def test_duplicate_member_names(tmp_path: Path) -> None:
    path = tmp_path / "dup.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("dup/data.pkl", b"x")
        with pytest.warns(UserWarning, match="Duplicate name"):
            archive.writestr("dup/data.pkl", b"y")
    refused(path, 'member "dup/data.pkl" appears more than once')


def test_not_a_torch_zip(tmp_path: Path) -> None:
    flat = tmp_path / "flat.pt"
    with zipfile.ZipFile(flat, "w") as archive:
        archive.writestr("arr_0.npy", b"x")
    refused(flat, "not a PyTorch checkpoint (no data.pkl)")
    folder = tmp_path / "folder.pt"
    with zipfile.ZipFile(folder, "w") as archive:
        archive.writestr("x/readme.txt", b"x")
    refused(folder, 'not a PyTorch checkpoint (no "x"/data.pkl)')
    empty = tmp_path / "empty.pt"
    zipfile.ZipFile(empty, "w").close()
    refused(empty, "zip archive is empty")


def test_damaged_local_header_and_member_past_the_end(tmp_path: Path) -> None:
    path = good_checkpoint(tmp_path, "ckpt.pt")
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        start = archive.getinfo("ckpt/data/0").header_offset
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(bytes(data[:start]) + b"XXXX" + bytes(data[start + 4 :]))
    refused(damaged, 'member "ckpt/data/0" has a damaged local header')
    # Point the central directory entry of data/0 past the end of the file.
    name = b"ckpt/data/0"
    position = data.find(b"PK\x01\x02")
    while data[position + 46 : position + 46 + len(name)] != name:
        position = data.find(b"PK\x01\x02", position + 4)
    struct.pack_into("<I", data, position + 20, 1 << 30)  # compressed size
    struct.pack_into("<I", data, position + 24, 1 << 30)  # uncompressed size
    beyond = tmp_path / "beyond.pt"
    beyond.write_bytes(bytes(data))
    refused(beyond, "runs past the end of the file")


def test_encrypted_member(tmp_path: Path) -> None:
    path = good_checkpoint(tmp_path, "ckpt.pt")
    data = bytearray(path.read_bytes())
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        position = data.find(signature)
        while position >= 0:
            data[position + flag_at] |= 0x1
            position = data.find(signature, position + 4)
    path.write_bytes(bytes(data))
    refused(path, "is encrypted")


def test_storage_check_compares_offsets_and_sizes(tmp_path: Path) -> None:
    path = good_checkpoint(tmp_path, "ckpt.pt")
    archive = inspect_torch_zip(str(path))
    meta = torch.load(path, map_location="meta", weights_only=True)
    check_storages(str(path), archive, [meta["model"]["w"]])  # consistent: no error
    shifted = torch.empty(6, device="meta")
    shifted.untyped_storage()._checkpoint_offset = 1  # type: ignore[attr-defined]
    with pytest.raises(InputError, match="is not the start of any zip member"):
        check_storages(str(path), archive, [shifted])
    assert "ckpt/data/0" in member_names(path)


def zipped_directory(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/config.json", "{}")


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (
            lambda path: torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), str(path)),
            "a TorchScript archive (torch.jit.save): a program, not a state dict",
        ),
        (
            lambda path: torch.save({"w": torch.ones(2)}, path),
            "a PyTorch checkpoint (torch.save's zip format): name it .pt",
        ),
        (
            lambda path: zipped_directory(path),
            "a zip archive that is not a PyTorch checkpoint (no data.pkl): unzip it",
        ),
    ],
    ids=["torchscript", "torch-save", "zipped-directory"],
)
def test_a_zip_under_another_name_is_said_for_what_it_holds(
    make: object, said: str, tmp_path: Path
) -> None:
    """A ``.jit`` program or a zipped model directory is not invited to be renamed ``.pt``."""
    path = tmp_path / "model.jit"
    make(path)  # type: ignore[operator]
    result = runner.invoke(app, ["scan", str(path), "--no-config"], env={"COLUMNS": "300"})
    assert result.exit_code == 3
    assert said in " ".join(result.stderr.split())
