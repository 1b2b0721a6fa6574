"""A generator of hostile, broken and mislabelled inputs, built in a test's ``tmp_path``.

Each :class:`Case` builds one bad input and names the words its one-line error must
contain. ``tests/io/test_hostile_inputs.py`` runs every case through the CLI next to a good
file; the reader tests reuse the builders. Nothing is ever written outside the directory
handed in, and the pickles that "run code" only ever try to create a marker file there.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: The file a malicious pickle's payload would create if it were ever run.
MARKER_NAME = "PWNED"

F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


# --------------------------------------------------------------------------- payloads


class OpenMarker:
    """Unpickling it calls ``open(marker, "w")``: harmless, but it leaves a file behind."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


class ExecMarker:
    """Unpickling it calls ``exec`` on code that creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class TouchMarker:
    """Unpickling it calls ``Path(marker).touch`` through a pickled bound method."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.marker.touch, ())


class Custom:
    """An ordinary user class: not malicious, but not on the weights-only allowlist."""

    def __init__(self) -> None:
        self.lr = 0.1


def marker(folder: Path) -> Path:
    return folder / MARKER_NAME


# --------------------------------------------------------------------------- raw builders


def raw_safetensors(path: Path, header: bytes | str | dict[str, Any], data: bytes = b"") -> Path:
    """``u64 length + header + data``; a dict header is serialised as JSON."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def pairs_json(pairs: list[tuple[str, Any]]) -> str:
    """A JSON object from key/value pairs, duplicates kept (``json.dumps`` cannot)."""
    return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"


def member_span(path: Path, name: str) -> tuple[int, int]:
    """``(offset, size)`` of a stored zip member's data in the file."""
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    start = info.header_offset
    name_length, extra_length = struct.unpack("<HH", data[start + 26 : start + 30])
    return start + 30 + name_length + extra_length, info.file_size


def member_names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as archive:
        return archive.namelist()


def set_member_crc(data: bytearray, name: str, crc: int) -> None:
    """Write ``crc`` into a member's local header and central directory entry."""
    encoded = name.encode()
    position = 0
    while (position := data.find(b"PK\x03\x04", position)) >= 0:
        length = struct.unpack("<H", data[position + 26 : position + 28])[0]
        if data[position + 30 : position + 30 + length] == encoded:
            struct.pack_into("<I", data, position + 14, crc)
        position += 4
    position = 0
    while (position := data.find(b"PK\x01\x02", position)) >= 0:
        length = struct.unpack("<H", data[position + 28 : position + 30])[0]
        if data[position + 46 : position + 46 + length] == encoded:
            struct.pack_into("<I", data, position + 16, crc)
        position += 4


def patch_member(path: Path, name: str, new: bytes, *, fix_crc: bool = True) -> Path:
    """Replace a stored member's bytes in place (same length), CRCs updated unless told not."""
    offset, size = member_span(path, name)
    assert len(new) == size, "patch_member keeps the size"
    data = bytearray(path.read_bytes())
    data[offset : offset + size] = new
    if fix_crc:
        set_member_crc(data, name, zlib.crc32(new))
    path.write_bytes(bytes(data))
    return path


def data_pkl(path: Path) -> str:
    return next(n for n in member_names(path) if n.endswith("/data.pkl"))


# --------------------------------------------------------------------------- good inputs


def good_safetensors(folder: Path, name: str = "good.safetensors") -> Path:
    path = folder / name
    save_file({"good.weight": torch.tensor([3.0, 4.0])}, str(path))
    return path


def good_checkpoint(folder: Path, name: str = "ckpt.pt") -> Path:
    path = folder / name
    torch.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}, path)
    return path


def sharded(folder: Path, weight_map: dict[str, str] | None = None) -> Path:
    """A valid two-shard checkpoint in ``folder``; ``weight_map`` overrides the index's map."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.ones(2), "b": torch.ones(3)}, str(folder / "m-1.safetensors"))
    save_file({"c": torch.full((2,), 2.0)}, str(folder / "m-2.safetensors"))
    default = {"a": "m-1.safetensors", "b": "m-1.safetensors", "c": "m-2.safetensors"}
    index = folder / "m.safetensors.index.json"
    index.write_text(
        json.dumps({"metadata": {"total_size": 28}, "weight_map": weight_map or default})
    )
    return index


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One hostile input: how to build it and words its error message must contain."""

    build: Callable[[Path], Path]
    cause: str


def _missing(tmp: Path) -> Path:
    return tmp / "missing.safetensors"


def _empty_directory(tmp: Path) -> Path:
    folder = tmp / "empty-dir"
    folder.mkdir()
    (folder / "notes.txt").write_text("no checkpoint here")
    return folder


def _directory_as_shard(tmp: Path) -> Path:
    index = sharded(tmp / "dir-shard")
    (tmp / "dir-shard" / "m-2.safetensors").unlink()
    (tmp / "dir-shard" / "m-2.safetensors").mkdir()
    return index


def _dangling(tmp: Path) -> Path:
    link = tmp / "dangling.pt"
    link.symlink_to(tmp / "gone.pt")
    return link


def _loop(tmp: Path) -> Path:
    first, second = tmp / "loop-a.pt", tmp / "loop-b.pt"
    first.symlink_to(second)
    second.symlink_to(first)
    return first


def _fifo(tmp: Path) -> Path:
    path = tmp / "pipe.pt"
    os.mkfifo(path)
    return path


def _device(tmp: Path) -> Path:
    link = tmp / "null.safetensors"
    link.symlink_to("/dev/null")
    return link


def _empty(name: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        path = tmp / name
        path.write_bytes(b"")
        return path

    return build


def _truncated_safetensors(tmp: Path) -> Path:
    path = tmp / "cut.safetensors"
    save_file({"a": torch.ones(16), "b": torch.ones(16)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    return path


def _truncated_zip(tmp: Path) -> Path:
    path = good_checkpoint(tmp, "cut.pt")
    path.write_bytes(path.read_bytes()[:-100])
    return path


def _truncated_legacy(tmp: Path) -> Path:
    path = tmp / "cut-legacy.pt"
    torch.save({"w": torch.ones(64)}, path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:-40])
    return path


def _header(
    name: str, header: bytes | str | dict[str, Any], data: bytes = b""
) -> Callable[[Path], Path]:
    return lambda tmp: raw_safetensors(tmp / name, header, data)


def _too_short(tmp: Path) -> Path:
    path = tmp / "short.safetensors"
    path.write_bytes(b"\x02\x00\x00")
    return path


def _longer_than_file(tmp: Path) -> Path:
    path = tmp / "long.safetensors"
    path.write_bytes(struct.pack("<Q", 100) + b'{"t": 1}')
    return path


def _length_2_63(tmp: Path) -> Path:
    path = tmp / "2-63.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    return path


def _torch_zip_as_safetensors(tmp: Path) -> Path:
    path = tmp / "really-a-zip.safetensors"
    torch.save({"w": torch.ones(2)}, path)
    return path


def _lfs_pointer(tmp: Path) -> Path:
    path = tmp / "pytorch_model.bin"
    path.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 12345\n"
    )
    return path


def _safetensors_as_pt(tmp: Path) -> Path:
    path = tmp / "really-safetensors.pt"
    save_file({"w": torch.ones(2)}, str(path))
    return path


def _gzip_as_pt(tmp: Path) -> Path:
    path = tmp / "model.pt"
    path.write_bytes(gzip.compress(b"not a checkpoint"))
    return path


def _unknown_type(tmp: Path) -> Path:
    path = tmp / "weights.npz"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    return path


def _unsafe(name: str, payload: Callable[[Path], object], **save: Any) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        path = tmp / name
        torch.save({"w": torch.ones(2), "x": payload(marker(tmp))}, path, **save)
        return path

    return build


def _plain_pickle(protocol: int, name: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        path = tmp / name
        with path.open("wb") as handle:
            pickle.dump({"x": OpenMarker(marker(tmp))}, handle, protocol=protocol)
        return path

    return build


def _whole_module(tmp: Path) -> Path:
    path = tmp / "model.pth"
    torch.save(torch.nn.Linear(2, 2), path)
    return path


def _custom_class(tmp: Path) -> Path:
    path = tmp / "custom.ckpt"
    torch.save({"w": torch.ones(2), "hparams": Custom()}, path)
    return path


def _torchscript(tmp: Path) -> Path:
    path = tmp / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    return path


def _crc_mismatch(tmp: Path) -> Path:
    path = tmp / "flipped.pt"
    torch.save({"w": torch.arange(100.0)}, path)
    name = next(n for n in member_names(path) if n.endswith("/data/0"))
    offset, _ = member_span(path, name)
    data = bytearray(path.read_bytes())
    data[offset + 200] ^= 0x40  # one bit of one float: torch would load it silently
    path.write_bytes(bytes(data))
    return path


def _compressed_member(tmp: Path) -> Path:
    source = good_checkpoint(tmp, "stored.pt")
    path = tmp / "rezipped.pt"
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info.filename))
    source.unlink()
    return path


def _oversized_storage(tmp: Path) -> Path:
    """data.pkl claims a storage of 1100 floats where the member holds 1000 (CRC fixed)."""
    path = tmp / "oversized.pt"
    torch.save({"w": torch.arange(1000.0)}, path)
    name = data_pkl(path)
    with zipfile.ZipFile(path) as archive:
        pickled = archive.read(name)
    declared = b"M" + struct.pack("<H", 1000)  # BININT2 1000: the storage's element count
    assert pickled.count(declared) == 2  # the storage's size, then the tensor's shape
    patched = pickled.replace(declared, b"M" + struct.pack("<H", 1100), 1)
    return patch_member(path, name, patched)


def _protocol_4(tmp: Path) -> Path:
    path = tmp / "protocol4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4)
    return path


def _nothing_but_ints(tmp: Path) -> Path:
    path = tmp / "ints.pt"
    torch.save({"step": torch.tensor(3), "epoch": 2, "ids": torch.arange(4)}, path)
    return path


def _index(name: str, weight_map: dict[str, str]) -> Callable[[Path], Path]:
    return lambda tmp: sharded(tmp / name, weight_map)


def _shard_missing(tmp: Path) -> Path:
    index = sharded(tmp / "missing-shard")
    (tmp / "missing-shard" / "m-2.safetensors").unlink()
    return index


def _shard_extra_tensor(tmp: Path) -> Path:
    index = sharded(tmp / "extra")
    save_file({"c": torch.ones(2), "d": torch.ones(1)}, str(tmp / "extra" / "m-2.safetensors"))
    return index


def _shard_corrupt(tmp: Path) -> Path:
    index = sharded(tmp / "corrupt-shard")
    shard = tmp / "corrupt-shard" / "m-2.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    return index


def _index_not_json(tmp: Path) -> Path:
    index = sharded(tmp / "bad-json")
    index.write_text('{"weight_map": {"a": ')
    return index


def _index_duplicate(tmp: Path) -> Path:
    index = sharded(tmp / "dup-index")
    index.write_text(
        '{"weight_map": {"a": "m-1.safetensors", "b": "m-1.safetensors", '
        '"c": "m-2.safetensors", "a": "m-2.safetensors"}}'
    )
    return index


def _index_escaping_symlink_free(tmp: Path) -> Path:
    index = sharded(tmp / "outside", {"a": "m-1.safetensors", "b": "m-1.safetensors"})
    shutil.copy(tmp / "outside" / "m-2.safetensors", tmp / "elsewhere.safetensors")
    index.write_text(
        json.dumps(
            {
                "weight_map": {
                    "a": "m-1.safetensors",
                    "b": "m-1.safetensors",
                    "c": "../elsewhere.safetensors",
                }
            }
        )
    )
    return index


#: Every hostile input of the issue, by name. Each must end in exit 3 and one stderr line.
CASES: dict[str, Case] = {
    # --- the path itself
    "missing-file": Case(_missing, "no such file"),
    "empty-directory": Case(_empty_directory, "no checkpoint file in this directory"),
    "directory-as-shard": Case(_directory_as_shard, "is a directory"),
    "dangling-symlink": Case(_dangling, "dangling symlink"),
    "symlink-loop": Case(_loop, "symlink loop"),
    "fifo": Case(_fifo, "not a regular file (FIFO)"),
    "device-file": Case(_device, "not a regular file (character device)"),
    "empty-safetensors": Case(_empty("empty.safetensors"), "empty file"),
    "empty-pt": Case(_empty("empty.pt"), "empty file"),
    "truncated-safetensors": Case(_truncated_safetensors, "truncated"),
    "truncated-zip-checkpoint": Case(_truncated_zip, "truncated or corrupt"),
    "truncated-legacy-checkpoint": Case(_truncated_legacy, "truncated or corrupt"),
    # --- safetensors headers
    "header-too-short": Case(_too_short, "too short"),
    "header-longer-than-file": Case(_longer_than_file, "larger than the file"),
    "header-length-2**63": Case(_length_2_63, str(2**63)),
    "header-not-utf8": Case(_header("latin1.safetensors", b'{"\xe9": 1}'), "not valid UTF-8"),
    "header-not-json": Case(_header("garbage.safetensors", "{not json}"), "not valid JSON"),
    "header-not-object": Case(_header("list.safetensors", "[]"), "not a JSON object"),
    "unknown-dtype": Case(
        _header("dtype.safetensors", {"t": {**F32_1, "dtype": "F33"}}, b"\0" * 4),
        "unknown dtype",
    ),
    "out-of-bounds-offsets": Case(
        _header(
            "oob.safetensors", {"t": {**F32_1, "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4
        ),
        "run past the end",
    ),
    "overlapping-offsets": Case(
        _header(
            "overlap.safetensors",
            pairs_json(
                [
                    ("a", {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}),
                    ("b", {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}),
                ]
            ),
            b"\0" * 12,
        ),
        "overlap",
    ),
    "shape-size-mismatch": Case(
        _header(
            "mismatch.safetensors",
            {"t": {**F32_1, "shape": [2, 3], "data_offsets": [0, 20]}},
            b"\0" * 20,
        ),
        "shape/size mismatch",
    ),
    "trailing-bytes": Case(_header("trail.safetensors", {"t": F32_1}, b"\0" * 9), "trailing bytes"),
    "integer-in-metadata": Case(
        _header("meta.safetensors", {"__metadata__": {"step": 3}, "t": F32_1}, b"\0" * 4),
        "is not a string",
    ),
    "duplicate-tensor-names": Case(
        _header(
            "dup.safetensors",
            pairs_json(
                [("t", F32_1), ("t", {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]})]
            ),
            b"\0" * 8,
        ),
        "duplicate tensor name",
    ),
    # --- wrong extension
    "torch-zip-named-safetensors": Case(_torch_zip_as_safetensors, "looks like a zip archive"),
    "git-lfs-pointer-named-bin": Case(_lfs_pointer, "git-lfs pointer"),
    "safetensors-named-pt": Case(_safetensors_as_pt, "looks like a safetensors file"),
    "gzip-named-pt": Case(_gzip_as_pt, "gzip"),
    "unknown-extension": Case(_unknown_type, "unsupported file type"),
    # --- pickles that would run code, or need globals outside the allowlist
    "unsafe-open-zip": Case(_unsafe("open.pt", OpenMarker), "refused as unsafe"),
    "unsafe-exec-zip": Case(_unsafe("exec.pth", ExecMarker), '"builtins.exec"'),
    "unsafe-touch-zip": Case(_unsafe("touch.ckpt", TouchMarker), "refused as unsafe"),
    "unsafe-open-legacy": Case(
        _unsafe("legacy.bin", OpenMarker, _use_new_zipfile_serialization=False),
        "refused as unsafe",
    ),
    "unsafe-open-protocol-4": Case(_unsafe("p4.pt", OpenMarker, pickle_protocol=4), '"io.open"'),
    "plain-pickle": Case(_plain_pickle(2, "plain.pt"), "plain Python pickle"),
    "plain-pickle-protocol-0": Case(_plain_pickle(0, "plain0.bin"), "refused as unsafe"),
    "pickled-module": Case(_whole_module, "torch.nn.modules.linear.Linear"),
    "custom-class": Case(_custom_class, "tests.hostile.Custom"),
    "torchscript": Case(_torchscript, "TorchScript"),
    # --- zip checkpoints torch would load silently, wrongly
    "zip-crc-mismatch": Case(_crc_mismatch, "fails its CRC-32 check"),
    "zip-compressed-member": Case(_compressed_member, "is compressed"),
    "zip-storage-larger-than-member": Case(_oversized_storage, "declares 4400"),
    "pickle-protocol-4": Case(_protocol_4, "opcode FRAME"),
    # --- sharded indexes
    "shard-missing": Case(_shard_missing, "does not exist"),
    "shard-absolute-path": Case(
        lambda tmp: sharded(tmp / "abs", {"a": str(tmp / "abs" / "m-1.safetensors")}),
        "absolute path",
    ),
    "shard-escapes-directory": Case(_index_escaping_symlink_free, "escapes the index's directory"),
    "shard-wrong-extension": Case(_index("ext", {"a": "m-1.bin"}), "not a .safetensors file"),
    "shard-lacks-tensor": Case(
        _index("lacks", {"a": "m-1.safetensors", "b": "m-1.safetensors", "z": "m-2.safetensors"}),
        "which does not hold it",
    ),
    "shard-holds-unlisted-tensor": Case(_shard_extra_tensor, "which the index does not list"),
    "tensor-in-the-wrong-shard": Case(
        _index("wrong", {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-2.safetensors"}),
        "the index maps it to",
    ),
    "shard-corrupt": Case(_shard_corrupt, 'shard "m-2.safetensors"'),
    "index-not-json": Case(_index_not_json, "not valid JSON"),
    "index-duplicate-tensor": Case(_index_duplicate, "twice"),
}


#: Inputs that are valid but hold nothing floating-point: exit 3 only when alone.
NOTHING_TO_AUDIT = _nothing_but_ints

#: Cases whose refusal relies on torch >= 2.6: the storage offsets a meta load records (the
#: size check, skipped where torch records none) and its EOF message for a cut legacy file.
TORCH_2_6_CASES = frozenset({"zip-storage-larger-than-member", "truncated-legacy-checkpoint"})
