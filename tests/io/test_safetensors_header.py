"""The safetensors header validator against hostile, truncated and foreign files.

Every file is built in ``tmp_path``. Each hostile case must end in an ``InputError`` whose
one-line cause names the problem; every file the validator accepts must load through the
safetensors library with the same names, dtypes and shapes (checked by the properties).
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from gradaudit.errors import ExitCode, InputError
from gradaudit.io.files import check_regular_file
from gradaudit.io.safetensors_header import MAX_HEADER_BYTES, SafetensorsHeader, read_header
from gradaudit.io.safetensors_table import (
    SAFETENSORS_DTYPE_SIZES,
    UNSUPPORTED_SAFETENSORS_DTYPES,
    TensorEntry,
)
from gradaudit.io.sniff import sniff
from gradaudit.report.text import printable
from tests.hostile import pairs_json
from tests.hostile import raw_safetensors as raw_file
from tests.torch_features import requires_dtype

F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}

PROPERTY_SETTINGS = settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def refused(path: str | os.PathLike[str], keyword: str) -> InputError:
    """Assert ``read_header`` refuses ``path`` with a one-line cause containing ``keyword``."""
    with pytest.raises(InputError) as caught:
        read_header(path)
    error = caught.value
    assert keyword in error.cause, error.cause
    assert error.path == os.fspath(path)
    assert error.exit_code == ExitCode.INPUT_ERROR
    assert "\n" not in str(error)
    assert "Traceback" not in str(error)
    return error


def run_with_timeout(func: Callable[[], object], seconds: float = 10.0) -> object:
    """Run ``func`` in a daemon thread; fail (instead of hanging the suite) if it blocks."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = func()
        except BaseException as error:  # noqa: BLE001 - handed back to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked: the FIFO was opened"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


def attempt(path: Path) -> SafetensorsHeader | InputError:
    """``read_header``'s result or its ``InputError``; any other exception propagates."""
    try:
        return read_header(path)
    except InputError as error:
        return error


def assert_library_agrees(path: Path, header: SafetensorsHeader) -> None:
    """Whatever ``read_header`` accepts, the safetensors library must load identically."""
    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == {t.name for t in header.tensors}
        assert (handle.metadata() or {}) == header.metadata
        for entry in header.tensors:
            tensor = handle.get_tensor(entry.name)
            assert tuple(tensor.shape) == entry.shape
            assert tensor.element_size() == SAFETENSORS_DTYPE_SIZES[entry.dtype]


# --------------------------------------------------------------------------- valid files


VALID_TENSORS: dict[str, torch.Tensor] = {
    "f32": torch.randn(3, 4),
    "f16": torch.randn(5).half(),
    "bf16": torch.randn(2, 2, 2).bfloat16(),
    "f64": torch.randn(7, dtype=torch.float64),
    "i64": torch.arange(6).reshape(2, 3),
    "i32": torch.arange(4, dtype=torch.int32),
    "i16": torch.arange(4, dtype=torch.int16),
    "i8": torch.arange(4, dtype=torch.int8),
    "u8": torch.arange(4, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "f8_e4m3": torch.randn(4).to(torch.float8_e4m3fn),
    "f8_e5m2": torch.randn(4).to(torch.float8_e5m2),
    "scalar": torch.tensor(1.5),
    "empty": torch.zeros(0, 3),
    "empty_f16": torch.zeros(4, 0, dtype=torch.float16),
}

EXPECTED_DTYPES = {
    "f32": "F32",
    "f16": "F16",
    "bf16": "BF16",
    "f64": "F64",
    "i64": "I64",
    "i32": "I32",
    "i16": "I16",
    "i8": "I8",
    "u8": "U8",
    "bool": "BOOL",
    "f8_e4m3": "F8_E4M3",
    "f8_e5m2": "F8_E5M2",
    "scalar": "F32",
    "empty": "F32",
    "empty_f16": "F16",
}


def test_valid_file_from_save_file(tmp_path: Path) -> None:
    path = tmp_path / "valid.safetensors"
    metadata = {"step": "12", "format": "pt", "note": "ünïcode ✓"}
    save_file(VALID_TENSORS, str(path), metadata=metadata)

    header = read_header(path)

    assert header.path == str(path)
    assert header.file_size == path.stat().st_size
    assert header.header_length == struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header.metadata == metadata
    by_name = {t.name: t for t in header.tensors}
    assert set(by_name) == set(VALID_TENSORS)
    for name, tensor in VALID_TENSORS.items():
        entry = by_name[name]
        assert entry.dtype == EXPECTED_DTYPES[name]
        assert entry.shape == tuple(tensor.shape)
        assert entry.end - entry.begin == tensor.numel() * tensor.element_size()
    # In data-offset order, tiling the data section exactly.
    position = 0
    for entry in header.tensors:
        assert entry.begin == position
        position = entry.end
    assert position == header.file_size - 8 - header.header_length
    assert by_name["scalar"].shape == ()
    assert by_name["empty"].begin == by_name["empty"].end
    assert_library_agrees(path, header)


@requires_dtype("float8_e8m0fnu")
def test_valid_file_with_unsigned_complex_and_exotic_float8(tmp_path: Path) -> None:
    tensors = {
        "u16": torch.zeros(3, dtype=torch.uint16),
        "u32": torch.zeros(3, dtype=torch.uint32),
        "u64": torch.zeros(3, dtype=torch.uint64),
        "c64": torch.randn(2, dtype=torch.complex64),
        "e8m0": torch.ones(2).to(torch.float8_e8m0fnu),
        "fnuz": torch.ones(2).to(torch.float8_e4m3fnuz),
    }
    path = tmp_path / "exotic.safetensors"
    save_file(tensors, str(path))
    header = read_header(path)
    assert {t.name: t.dtype for t in header.tensors} == {
        "u16": "U16",
        "u32": "U32",
        "u64": "U64",
        "c64": "C64",
        "e8m0": "F8_E8M0",
        "fnuz": "F8_E4M3FNUZ",
    }
    assert_library_agrees(path, header)


def test_accepts_pathlike_and_returns_frozen_dataclasses(tmp_path: Path) -> None:
    path = tmp_path / "one.safetensors"
    save_file({"w": torch.ones(2)}, str(path))
    header = read_header(path)
    assert header.tensors == (TensorEntry("w", "F32", (2,), 0, 8),)
    assert read_header(str(path)) == header
    hash(header)  # hashable although metadata is a dict
    with pytest.raises(AttributeError):
        header.path = "elsewhere"  # type: ignore[misc]


def test_empty_header_without_data_is_valid(tmp_path: Path) -> None:
    header = read_header(raw_file(tmp_path / "empty.safetensors", "{}"))
    assert header.tensors == ()
    assert header.metadata == {}
    assert header.header_length == 2


def test_metadata_only_and_null_metadata_are_valid(tmp_path: Path) -> None:
    only = read_header(raw_file(tmp_path / "m.safetensors", {"__metadata__": {"a": "b"}}))
    assert only.metadata == {"a": "b"}
    assert only.tensors == ()
    # The library accepts null (its field is optional), so must we.
    null = read_header(
        raw_file(tmp_path / "n.safetensors", {"__metadata__": None, "t": F32_1}, b"\0" * 4)
    )
    assert null.metadata == {}


def test_whitespace_padded_header_is_valid(tmp_path: Path) -> None:
    # Writers pad the header with spaces to an 8-byte boundary.
    path = raw_file(tmp_path / "pad.safetensors", json.dumps({"t": F32_1}) + "   \n", b"\0" * 4)
    assert [t.name for t in read_header(path).tensors] == ["t"]


def test_tensors_are_returned_in_offset_order_not_header_order(tmp_path: Path) -> None:
    header_pairs = [
        ("b", {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}),
        ("a", {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}),
        ("z", {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}),
    ]
    path = raw_file(tmp_path / "order.safetensors", pairs_json(header_pairs), b"\0" * 8)
    assert [t.name for t in read_header(path).tensors] == ["a", "b", "z"]


def test_valid_header_whose_length_looks_like_a_pickle_is_not_misread(tmp_path: Path) -> None:
    # A header length of 640 is stored as 80 02 00 ..., which is also how a protocol-2
    # pickle starts: the sniffing must not override a valid file.
    text = json.dumps({"t": F32_1})
    path = raw_file(tmp_path / "640.safetensors", text.ljust(640), b"\0" * 4)
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert [t.name for t in read_header(path).tensors] == ["t"]
    assert sniff(path).kind == "safetensors"


# --------------------------------------------------------------------------- path checks


def test_missing_file(tmp_path: Path) -> None:
    refused(tmp_path / "nope.safetensors", "no such file")


def test_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "link.safetensors"
    link.symlink_to(tmp_path / "gone.safetensors")
    error = refused(link, "dangling symlink")
    assert "gone.safetensors" in error.cause


def test_symlink_loop(tmp_path: Path) -> None:
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    first.symlink_to(second)
    second.symlink_to(first)
    refused(first, "symlink loop")


def test_symlink_to_a_valid_file_is_followed(tmp_path: Path) -> None:
    target = tmp_path / "real.safetensors"
    save_file({"w": torch.ones(1)}, str(target))
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert [t.name for t in read_header(link).tensors] == ["w"]


def test_directory(tmp_path: Path) -> None:
    folder = tmp_path / "dir.safetensors"
    folder.mkdir()
    refused(folder, "directory")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match=r"not a regular file \(FIFO\)"):
        run_with_timeout(lambda: read_header(fifo))
    with pytest.raises(InputError, match="FIFO"):
        run_with_timeout(lambda: sniff(fifo))
    link = tmp_path / "link-to-pipe.safetensors"
    link.symlink_to(fifo)
    with pytest.raises(InputError, match="FIFO"):
        run_with_timeout(lambda: read_header(link))


def test_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    if len(os.fsencode(path)) > 100:
        pytest.skip("tmp_path too long for an AF_UNIX socket name")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        refused(path, "not a regular file (socket)")
    finally:
        server.close()


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_character_device_via_symlink(tmp_path: Path) -> None:
    link = tmp_path / "null.safetensors"
    link.symlink_to("/dev/null")
    refused(link, "not a regular file (character device)")


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores file permissions"
)
def test_permission_denied(tmp_path: Path) -> None:
    path = tmp_path / "locked.safetensors"
    save_file({"w": torch.ones(1)}, str(path))
    path.chmod(0)
    try:
        refused(path, "permission denied")
    finally:
        path.chmod(0o600)


def test_open_failure_becomes_input_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs as root too: the OSError from open is simulated.
    path = tmp_path / "locked.safetensors"
    save_file({"w": torch.ones(1)}, str(path))

    def deny(*args: object, **kwargs: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", deny)
    refused(path, "permission denied")


def test_path_with_nul_byte(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="NUL byte"):
        read_header(f"{tmp_path}/a\0b.safetensors")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    refused(path, "empty file")


def test_check_regular_file_returns_stat_and_refuses_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    assert check_regular_file(path).st_size == 1
    with pytest.raises(InputError, match="directory"):
        check_regular_file(tmp_path)
    with pytest.raises(InputError, match="no such file"):
        check_regular_file(tmp_path / "missing.pt")


# --------------------------------------------------------------------------- framing


def test_too_short(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02\x00\x00")
    refused(path, "too short to be a safetensors file")


def test_header_length_larger_than_file(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    error = refused(path, "larger than the file")
    assert str(2**63) in error.cause
    assert "(10 bytes)" in error.cause


def test_header_length_absurdly_large(tmp_path: Path) -> None:
    # A sparse file bigger than the limit, so only the limit can refuse it.
    path = tmp_path / "absurd.safetensors"
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{")
        handle.truncate(MAX_HEADER_BYTES + 64)
    refused(path, "absurdly large")


def test_zero_header_length(tmp_path: Path) -> None:
    refused(raw_file(tmp_path / "zero.safetensors", b"", b"{}"), "header length is 0")


def test_header_not_utf8(tmp_path: Path) -> None:
    refused(raw_file(tmp_path / "latin1.safetensors", b'{"\xe9": 1}'), "not valid UTF-8")


@pytest.mark.parametrize(
    "header",
    [
        pytest.param("{not json}", id="garbage"),
        pytest.param('{"a": ', id="truncated"),
        pytest.param("{}\0", id="trailing-nul"),
        pytest.param('{"__metadata__": {"a": NaN}}', id="nan-constant"),
        pytest.param("\ufeff{}", id="bom"),
        pytest.param("[" * 50_000 + "]" * 50_000, id="deep-nesting"),
        pytest.param('{"t": {"shape": [' + "9" * 5000 + "]}}", id="huge-number"),
    ],
)
def test_header_not_json(tmp_path: Path, header: str) -> None:
    refused(raw_file(tmp_path / "bad.safetensors", header), "not valid JSON")


@pytest.mark.parametrize("header", ["[]", '"text"', "42", "null"])
def test_header_not_an_object(tmp_path: Path, header: str) -> None:
    refused(raw_file(tmp_path / "bad.safetensors", header), "not a JSON object")


# --------------------------------------------------------------------------- duplicates


def test_duplicate_tensor_names(tmp_path: Path) -> None:
    # The library would keep only the second "t" and never show the first.
    second = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}
    path = raw_file(
        tmp_path / "dup.safetensors", pairs_json([("t", F32_1), ("t", second)]), b"\0" * 8
    )
    error = refused(path, "duplicate tensor name")
    assert '"t"' in error.cause


def test_identical_duplicate_tensor_entries(tmp_path: Path) -> None:
    path = raw_file(
        tmp_path / "dup.safetensors", pairs_json([("t", F32_1), ("t", F32_1)]), b"\0" * 4
    )
    refused(path, "duplicate tensor name")


def test_duplicate_metadata_keys(tmp_path: Path) -> None:
    header = '{"__metadata__": {"k": "1", "k": "2"}}'
    refused(raw_file(tmp_path / "dup.safetensors", header), "duplicate key")


def test_duplicate_key_inside_a_tensor_entry(tmp_path: Path) -> None:
    header = '{"t": {"dtype": "F16", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    refused(raw_file(tmp_path / "dup.safetensors", header, b"\0" * 4), "duplicate key")


@pytest.mark.parametrize("name", ["{key}", "{0}", "{x.y}", "}{", "%s"])
def test_braces_in_a_name_do_not_break_the_message(tmp_path: Path, name: str) -> None:
    header = pairs_json([(name, F32_1)]).replace('"dtype"', '"dtype": "F32", "dtype"', 1)
    error = refused(raw_file(tmp_path / "dup.safetensors", header, b"\0" * 4), "duplicate key")
    assert f'tensor "{name}": duplicate key "dtype"' in error.cause


def test_hostile_name_is_cut_in_the_message_and_escaped_when_rendered(tmp_path: Path) -> None:
    # The reader quotes and cuts the name; escaping is the renderers' (printable), once.
    name = "evil\n\x1b[31mred\u202e" + "x" * 500
    pairs = [(name, F32_1), (name, F32_1)]
    with pytest.raises(InputError) as caught:
        read_header(raw_file(tmp_path / "dup.safetensors", pairs_json(pairs), b"\0" * 4))
    cause = caught.value.cause
    assert "duplicate" in cause
    assert len(cause) < 300
    assert name[:40] in cause  # the exact name, as JSON will carry it
    shown = printable(cause)
    assert "\x1b" not in shown
    assert "\u202e" not in shown
    assert "\n" not in shown
    assert "evil\\x0a\\x1b[31mred\\u202e" in shown


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize("value", [[], "text", 3, True])
def test_metadata_not_an_object(tmp_path: Path, value: object) -> None:
    path = raw_file(tmp_path / "meta.safetensors", {"__metadata__": value})
    refused(path, "__metadata__ is not a JSON object")


@pytest.mark.parametrize("value", [1, 1.5, None, True, ["a"], {"a": "b"}])
def test_metadata_value_not_a_string(tmp_path: Path, value: object) -> None:
    path = raw_file(tmp_path / "meta.safetensors", {"__metadata__": {"step": value}})
    refused(path, "is not a string")


def test_lone_surrogate_is_refused(tmp_path: Path) -> None:
    # Python's json accepts "\ud800"; the library's parser does not.
    header = '{"__metadata__": {"k": "\\ud800"}}'
    refused(raw_file(tmp_path / "surrogate.safetensors", header), "lone surrogate")
    header = '{"t\\udc00": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    refused(raw_file(tmp_path / "surrogate2.safetensors", header, b"\0" * 4), "lone surrogate")


# --------------------------------------------------------------------------- tensor entries


def entry_file(tmp_path: Path, entry: object, data: bytes = b"\0" * 4) -> Path:
    """A file with one tensor ``t`` described by ``entry``."""
    return raw_file(tmp_path / "entry.safetensors", {"t": entry}, data)


@pytest.mark.parametrize("entry", [[1, 2], "F32", 4, None])
def test_entry_not_an_object(tmp_path: Path, entry: object) -> None:
    refused(entry_file(tmp_path, entry), "entry is not a JSON object")


@pytest.mark.parametrize("missing", ["dtype", "shape", "data_offsets"])
def test_entry_missing_a_key(tmp_path: Path, missing: str) -> None:
    entry = {k: v for k, v in F32_1.items() if k != missing}
    refused(entry_file(tmp_path, entry), f'missing "{missing}"')


def test_entry_with_an_unexpected_key(tmp_path: Path) -> None:
    refused(entry_file(tmp_path, {**F32_1, "offset": 0}), 'unexpected key "offset"')


@pytest.mark.parametrize("dtype", ["FLOAT32", "f32", "E8M0", ""])
def test_unknown_dtype(tmp_path: Path, dtype: str) -> None:
    refused(entry_file(tmp_path, {**F32_1, "dtype": dtype}), "unknown dtype")


def test_dtype_not_a_string(tmp_path: Path) -> None:
    refused(entry_file(tmp_path, {**F32_1, "dtype": 4}), "dtype is not a string")


@pytest.mark.parametrize("dtype", sorted(UNSUPPORTED_SAFETENSORS_DTYPES))
def test_unsupported_sub_byte_dtype(tmp_path: Path, dtype: str) -> None:
    refused(entry_file(tmp_path, {**F32_1, "dtype": dtype}), "unsupported dtype")


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param("[1]", id="string"),
        pytest.param({"0": 1}, id="object"),
        pytest.param([True], id="bool"),
        pytest.param([-1], id="negative"),
        pytest.param([1.0], id="float"),
        pytest.param([[1]], id="nested"),
        pytest.param(None, id="null"),
        pytest.param([2**63], id="beyond-int64"),
    ],
)
def test_bad_shape(tmp_path: Path, shape: object) -> None:
    refused(entry_file(tmp_path, {**F32_1, "shape": shape}), "shape is not a list of non-negative")


def test_negative_zero_dimension(tmp_path: Path) -> None:
    # Python reads -0 as 0; the library reads -0.0 and refuses it.
    header = '{"t": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}'
    refused(raw_file(tmp_path / "neg0.safetensors", header), "shape is not a list")


def test_shape_overflowing_64_bits(tmp_path: Path) -> None:
    entry = {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}
    refused(entry_file(tmp_path, entry, b""), "overflows 64 bits")


@pytest.mark.parametrize(
    "offsets",
    [
        pytest.param([0], id="one"),
        pytest.param([0, 4, 4], id="three"),
        pytest.param([0, True], id="bool"),
        pytest.param([-4, 0], id="negative"),
        pytest.param([0, 4.0], id="float"),
        pytest.param("0,4", id="string"),
        pytest.param([0, 2**64], id="beyond-u64"),
    ],
)
def test_bad_data_offsets(tmp_path: Path, offsets: object) -> None:
    refused(entry_file(tmp_path, {**F32_1, "data_offsets": offsets}), "data_offsets is not two")


def test_data_offsets_reversed(tmp_path: Path) -> None:
    refused(entry_file(tmp_path, {**F32_1, "data_offsets": [4, 0]}), "end before they begin")


# --------------------------------------------------------------------------- layout


def test_offsets_outside_the_data_section(tmp_path: Path) -> None:
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    refused(entry_file(tmp_path, entry, b"\0" * 4), "run past the end of the data section")


def test_truncated_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    save_file({"a": torch.ones(16), "b": torch.ones(16)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    refused(path, "is the file truncated?")


def test_overlapping_tensors(tmp_path: Path) -> None:
    pairs = [
        ("a", {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}),
        ("b", {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}),
    ]
    refused(raw_file(tmp_path / "ov.safetensors", pairs_json(pairs), b"\0" * 12), "overlap")


def test_same_bytes_under_two_names(tmp_path: Path) -> None:
    pairs = [("a", F32_1), ("b", F32_1)]
    refused(raw_file(tmp_path / "alias.safetensors", pairs_json(pairs), b"\0" * 4), "overlap")


def test_gap_between_tensors(tmp_path: Path) -> None:
    pairs = [("a", F32_1), ("b", {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]})]
    error = refused(raw_file(tmp_path / "gap.safetensors", pairs_json(pairs), b"\0" * 12), "gap")
    assert "4 bytes" in error.cause


def test_gap_before_the_first_tensor(tmp_path: Path) -> None:
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}
    refused(entry_file(tmp_path, entry, b"\0" * 8), "gap of 4 bytes")


def test_shape_size_mismatch(tmp_path: Path) -> None:
    entry = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}
    error = refused(entry_file(tmp_path, entry, b"\0" * 20), "shape/size mismatch")
    assert "24" in error.cause


def test_trailing_bytes_after_the_last_tensor(tmp_path: Path) -> None:
    refused(entry_file(tmp_path, F32_1, b"\0" * 9), "5 trailing bytes")


def test_empty_header_with_data_has_trailing_bytes(tmp_path: Path) -> None:
    refused(raw_file(tmp_path / "e.safetensors", "{}", b"\0" * 4), "trailing bytes")


# --------------------------------------------------------------------------- sniffing


def test_zip_archive(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(2)}, path)
    assert path.read_bytes()[:4] == b"PK\x03\x04"
    refused(path, "looks like a zip archive")
    assert sniff(path).kind == "zip"


def test_legacy_pickle(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    refused(path, "looks like a pickle")
    assert sniff(path).kind == "torch-legacy"


def test_git_lfs_pointer(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 12345\n"
    )
    refused(path, "git lfs pull")
    assert sniff(path).kind == "git-lfs"


def test_sniff_on_safetensors_and_on_noise(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(1)}, str(good))
    assert sniff(good).kind == "safetensors"
    noise = tmp_path / "noise.bin"
    noise.write_bytes(b"hello world, not a tensor file")
    assert sniff(noise).kind is None


# --------------------------------------------------------------------------- properties


@pytest.fixture(scope="module")
def valid_bytes() -> bytes:
    """A small valid file, header and data, as produced by the library."""
    tensors = {
        "a": torch.randn(2, 3),
        "b": torch.arange(4, dtype=torch.int64),
        "c": torch.tensor(2.0, dtype=torch.float16),
        "d": torch.zeros(0),
    }
    from safetensors.torch import save

    return save(tensors, metadata={"k": "v"})


_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("data"), st.integers(0, 10_000), st.integers(0, 255)),
)


def _mutate(data: bytes, ops: list[tuple[str, int, int]], header_bias: int) -> bytes:
    """Apply byte edits; indices are mostly folded into the first ``header_bias`` bytes.

    ``data`` edits overwrite a byte after the header, which keeps a valid file valid.
    """
    out = bytearray(data)
    for op, index, value in ops:
        if op == "data":
            if len(out) > header_bias:
                out[header_bias + index % (len(out) - header_bias)] = value
            continue
        span = len(out) if index % 4 == 0 or header_bias <= 0 else min(header_bias, len(out))
        if span == 0:
            if op == "insert":
                out.append(value)
            continue
        at = index % span
        if op == "set":
            out[at] = value
        elif op == "insert":
            out.insert(at, value)
        else:
            del out[at]
    return bytes(out)


@PROPERTY_SETTINGS
@given(
    ops=st.lists(_mutation, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
    length=st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(0, 600)),
)
def test_mutated_files_are_refused_cleanly_or_load_identically(
    tmp_path_factory: pytest.TempPathFactory,
    valid_bytes: bytes,
    ops: list[tuple[str, int, int]],
    cut: int | None,
    length: int | None,
) -> None:
    header_end = 8 + struct.unpack("<Q", valid_bytes[:8])[0]
    data = _mutate(valid_bytes, ops, header_end)
    if length is not None and len(data) >= 8:
        data = struct.pack("<Q", length) + data[8:]
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    path = tmp_path_factory.mktemp("mutated") / "m.safetensors"
    path.write_bytes(data)
    outcome = attempt(path)
    event("refused" if isinstance(outcome, InputError) else "accepted")
    if isinstance(outcome, InputError):
        assert outcome.cause
        assert "\n" not in outcome.cause
    else:
        assert_library_agrees(path, outcome)


_ALL_DTYPES = sorted(SAFETENSORS_DTYPE_SIZES) + sorted(UNSUPPORTED_SAFETENSORS_DTYPES) + ["X"]


@st.composite
def _headers(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """A mostly-valid header and data, plus whether it was left unperturbed and valid."""
    count = draw(st.integers(0, 4))
    names = draw(
        st.lists(st.sampled_from(["a", "b", "c", "d", "é", ""]), min_size=count, max_size=count)
    )
    pairs: list[tuple[str, Any]] = []
    offset = 0
    clean = len(set(names)) == len(names)
    for name in names:
        dtype = draw(st.sampled_from(_ALL_DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = math.prod(shape) * SAFETENSORS_DTYPE_SIZES.get(dtype, 1)
        clean = clean and dtype in SAFETENSORS_DTYPE_SIZES
        pairs.append(
            (name, {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]})
        )
        offset += size
    pairs = list(draw(st.permutations(pairs)))
    nudge: bool = draw(st.booleans())
    if pairs and nudge:
        # Nudge one offset, shape or key.
        index = draw(st.integers(0, len(pairs) - 1))
        entry = dict(pairs[index][1])
        field = draw(st.sampled_from(["begin", "end", "shape", "drop", "extra"]))
        delta = draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))
        if field in ("begin", "end"):
            begin, end = entry["data_offsets"]
            entry["data_offsets"] = (
                [begin + delta, end] if field == "begin" else [begin, end + delta]
            )
        elif field == "shape":
            entry["shape"] = [*entry["shape"], abs(delta)]
            clean = clean and abs(delta) == 1
        elif field == "drop":
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])))
        else:
            entry["x"] = delta
        if field != "shape":
            clean = False
        pairs[index] = (pairs[index][0], entry)
    if draw(st.booleans()):
        metadata = draw(
            st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), st.integers()))
        )
        clean = clean and all(isinstance(v, str) for v in metadata.values())
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", metadata))
    extra = draw(st.integers(-2, 2))
    if extra:
        clean = False
    data = bytes(max(0, offset + extra))
    padding = " " * draw(st.integers(0, 7))
    return pairs_json(pairs) + padding, data, clean


@PROPERTY_SETTINGS
@given(case=_headers())
def test_generated_headers_are_refused_cleanly_or_load_identically(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[str, bytes, bool]
) -> None:
    header_text, data, clean = case
    path = raw_file(tmp_path_factory.mktemp("gen") / "g.safetensors", header_text, data)
    outcome = attempt(path)
    event("refused" if isinstance(outcome, InputError) else "accepted")
    if isinstance(outcome, InputError):
        assert not clean, f"a valid file was refused: {outcome.cause}"
        assert "\n" not in outcome.cause
    else:
        assert_library_agrees(path, outcome)
