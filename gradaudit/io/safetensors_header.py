"""Validate a safetensors file from its raw bytes before the safetensors library sees it.

The safetensors library is fast and memory-safe, but it is not written to explain a bad
input: it raises terse errors, silently keeps the *last* of two tensors with the same name
(a hostile file can hide a NaN tensor behind a clean one that way), and it is handed a
path, so a FIFO or a device node would make it block or read forever. gradaudit promises
that no input can crash, hang or fool it, so this module checks everything the format
requires, from the file type down to how the tensors tile the data section, and turns
every problem into an :class:`~gradaudit.errors.InputError` with a one-line cause.

The checks are deliberately at least as strict as the library's (``safetensors`` 0.8): a
file this module accepts must load without error. The module only reads: 8 bytes of
header length, then the header itself (bounded by :data:`MAX_HEADER_BYTES` and by the file
size). It never reads the tensor data and never writes.

The header's JSON is parsed by :mod:`gradaudit.io.safetensors_json` (duplicates kept
visible); the tensors are kept as columns by :mod:`gradaudit.io.safetensors_table`,
which also checks a header in the common form column by column. Whatever that fast
path is unsure of comes here, entry by entry, and the first problem is named.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NoReturn

from gradaudit.errors import InputError
from gradaudit.io.files import FileIdentity, describe_os_error, open_checked, show
from gradaudit.io.safetensors_json import (
    METADATA_KEY,
    JsonObject,
    Refused,
    check_text,
    json_type,
    parse_json,
    parse_metadata,
    show_value,
    unique_pairs,
)
from gradaudit.io.safetensors_table import (
    SAFETENSORS_DTYPE_SIZES,
    TENSOR_KEY_SET,
    TENSOR_KEYS,
    UNSUPPORTED_SAFETENSORS_DTYPES,
    TensorEntry,
    TensorTable,
    fast_table,
    from_columns,
)
from gradaudit.io.sniff import SAFETENSORS_LENGTH_BYTES, classify_head
from gradaudit.no_gc import paused_gc

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "read_header",
    "read_header_open",
]

#: Headers longer than this are refused as absurd. The value is the safetensors library's
#: own limit (``MAX_HEADER_SIZE = 100_000_000`` in the Rust crate), not 100 MiB: with a
#: larger limit a header between the two sizes would pass here and then make the library
#: fail, which is exactly what this module exists to prevent.
MAX_HEADER_BYTES = 100_000_000

#: Shape dimensions must fit a signed 64-bit int: PyTorch refuses larger sizes even when
#: another dimension is 0, and the library refuses running products above 2**64 - 1.
_MAX_DIM = 2**63 - 1
_MAX_USIZE = 2**64 - 1
_SNIFF_BYTES = 64
_FOREIGN_KINDS = {
    "zip": "looks like a zip archive (a PyTorch checkpoint?), not safetensors",
    "git-lfs": "is a git-lfs pointer, not the file's content: run `git lfs pull`",
    "pickle": "looks like a pickle (a PyTorch .pt/.bin file?), not safetensors",
}


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors header that passed every structural check."""

    path: str
    header_length: int
    file_size: int
    #: ``__metadata__`` (string to string), or ``{}`` when absent. Excluded from the hash
    #: because a dict is unhashable; equality still compares it.
    metadata: dict[str, str] = field(hash=False)
    #: In data-offset order, which is also the order they tile the data section.
    tensors: TensorTable = field(hash=False)
    #: The file the header was read from, when it was read (``None`` if unknown).
    identity: FileIdentity | None = field(default=None, compare=False)


def _is_count(value: Any, limit: int) -> bool:
    """A JSON integer in ``[0, limit]``; ``True``/``False`` are not integers here."""
    return type(value) is int and 0 <= value <= limit


def _parse_entry(name: str, value: Any, data_length: int) -> TensorEntry:
    """Validate one tensor entry against the format and against the data section's size.

    Runs once per tensor, so the label for a message (which escapes every
    character of the name) is only built when there is something to refuse.
    """
    if not _well_formed(value, data_length):
        _refuse_entry(name, value, data_length)
    check_text(name, "a tensor name")
    fields = dict(value)
    shape = tuple(fields["shape"])
    begin, end = fields["data_offsets"]
    return TensorEntry(name=name, dtype=fields["dtype"], shape=shape, begin=begin, end=end)


def _well_formed(value: Any, data_length: int) -> bool:
    """The common case, checked fast: exactly the three keys, all valid and consistent."""
    if not isinstance(value, JsonObject) or len(value) != 3:
        return False
    fields = dict(value)
    if fields.keys() != TENSOR_KEY_SET:
        return False
    dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    size = SAFETENSORS_DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if size is None or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
        return False
    numel = 1
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= _MAX_DIM:
            return False
        numel *= dim
        if numel > _MAX_USIZE:
            return False
    begin, end = offsets
    return (
        type(begin) is int
        and type(end) is int
        and 0 <= begin <= end <= data_length
        and end - begin == numel * size
    )


def _refuse_entry(name: str, value: Any, data_length: int) -> NoReturn:
    """Find what is wrong with an entry that failed :func:`_well_formed` and say it."""
    label = f"tensor {show(name)}"
    check_text(name, "a tensor name")
    if not isinstance(value, JsonObject):
        raise Refused(f"{label}: entry is not a JSON object (got {json_type(value)})")
    fields = unique_pairs(value, lambda key: f"{label}: duplicate key {key}")
    for key in fields:
        if key not in TENSOR_KEYS:
            raise Refused(f"{label}: unexpected key {show(key)}")
    for key in TENSOR_KEYS:
        if key not in fields:
            raise Refused(f'{label}: missing "{key}"')

    dtype = fields["dtype"]
    if not isinstance(dtype, str):
        raise Refused(f"{label}: dtype is not a string (got {json_type(dtype)})")
    if dtype in UNSUPPORTED_SAFETENSORS_DTYPES:
        raise Refused(f"{label}: unsupported dtype {show(dtype)} (sub-byte elements)")
    if dtype not in SAFETENSORS_DTYPE_SIZES:
        raise Refused(f"{label}: unknown dtype {show(dtype)}")

    raw_shape = fields["shape"]
    if not isinstance(raw_shape, list) or not all(_is_count(d, _MAX_DIM) for d in raw_shape):
        raise Refused(
            f"{label}: shape is not a list of non-negative integers ({show_value(raw_shape)})"
        )
    shape: tuple[int, ...] = tuple(raw_shape)
    numel = 1
    for dim in shape:
        # Left to right with an overflow check, as the library does: it refuses
        # [2**40, 2**40, 0] even though the product is 0.
        numel *= dim
        if numel > _MAX_USIZE:
            raise Refused(f"{label}: shape {show_value(raw_shape)} overflows 64 bits")

    offsets = fields["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o, _MAX_USIZE) for o in offsets)
    ):
        raise Refused(
            f"{label}: data_offsets is not two non-negative integers ({show_value(offsets)})"
        )
    begin, end = offsets
    if begin > end:
        raise Refused(f"{label}: data_offsets [{begin}, {end}] end before they begin")
    needed = numel * SAFETENSORS_DTYPE_SIZES[dtype]
    if end - begin != needed:
        raise Refused(
            f"{label}: shape/size mismatch: shape {list(shape)} of {dtype} needs {needed} bytes"
            f" but data_offsets [{begin}, {end}] span {end - begin}"
        )
    if end > data_length:
        raise Refused(
            f"{label}: data_offsets [{begin}, {end}] run past the end of the data section"
            f" ({data_length} bytes; is the file truncated?)"
        )
    raise AssertionError(f"{label}: refused without a cause")  # pragma: no cover


def _check_tiling(tensors: list[TensorEntry], data_length: int) -> None:
    """Require the tensors, in offset order, to cover ``[0, data_length)`` exactly.

    The format stores tensors back to back; an overlap lets two names share bytes, a gap
    or trailing bytes hide data no tensor declares. The library refuses all three.
    """
    position = 0
    previous: TensorEntry | None = None
    for tensor in tensors:
        if tensor.begin < position and previous is not None:  # previous is set once position > 0
            raise Refused(
                f"tensors {show(previous.name)} and {show(tensor.name)} overlap"
                f" (bytes {tensor.begin} to {min(position, tensor.end)})"
            )
        if tensor.begin > position:
            raise Refused(
                f"gap of {tensor.begin - position} bytes before tensor {show(tensor.name)}"
                f" (data offset {position} to {tensor.begin})"
            )
        position = tensor.end
        previous = tensor
    if position != data_length:
        raise Refused(
            f"{data_length - position} trailing bytes after the last tensor"
            f" (the data section is {data_length} bytes, the tensors cover {position})"
        )


def _parse_header(header: bytes, data_length: int) -> tuple[dict[str, str], TensorTable]:
    """Validate the header bytes; return the metadata and the tensors in offset order.

    A header in the common form is read straight into columns
    (:mod:`gradaudit.io.header_columns`); every other header, and every header
    with a problem, goes through the JSON parser, which names the problem.
    """
    found = from_columns(header, data_length)
    if found is not None:
        return found
    return _parse_document(header, data_length)


def _parse_document(header: bytes, data_length: int) -> tuple[dict[str, str], TensorTable]:
    """:func:`_parse_header` through a JSON document: any header, and every refusal."""
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Refused(f"header is not valid UTF-8 (at byte {error.start})") from None
    with paused_gc():
        document = parse_json(text)
        if not isinstance(document, JsonObject):
            raise Refused(f"header is not a JSON object (got {json_type(document)})")
        # A lone surrogate can only come from a \u escape; without one in the text,
        # no name needs the per-name check.
        escapes = "\\ud" in text or "\\uD" in text
        table = None if escapes else fast_table(document, data_length)
        if table is not None:
            metadata = parse_metadata(dict(document).get(METADATA_KEY))
            return metadata, table
        return _parse_entries(document, data_length)


def _parse_entries(document: JsonObject, data_length: int) -> tuple[dict[str, str], TensorTable]:
    """The entry-by-entry validation: every file the fast path does not take, and every refusal.

    It finds and names the first problem; the fast path only says whether there is one.
    """
    entries = unique_pairs(
        document,
        lambda key: (
            f"duplicate tensor name {key} in the header"
            " (the safetensors library would silently keep only the last one)"
        ),
    )
    metadata = parse_metadata(entries.pop(METADATA_KEY, None))
    tensors = [_parse_entry(name, value, data_length) for name, value in entries.items()]
    tensors.sort(key=lambda t: (t.begin, t.end, t.name))
    _check_tiling(tensors, data_length)
    return metadata, TensorTable.from_entries(tensors)


def _read_exactly(handle: BinaryIO, count: int) -> bytes:
    """Read ``count`` bytes, refusing a file that shrank after its size was taken."""
    data = handle.read(count)
    if len(data) != count:
        raise Refused("the file shrank while being read")
    return data


def _read_content(path: str, handle: BinaryIO, size: int) -> SafetensorsHeader:
    """Read and validate the length prefix and the header that follows it."""
    if size < SAFETENSORS_LENGTH_BYTES:
        raise Refused(f"too short to be a safetensors file ({size} bytes, need at least 8)")
    (length,) = struct.unpack("<Q", _read_exactly(handle, SAFETENSORS_LENGTH_BYTES))
    if length > size - SAFETENSORS_LENGTH_BYTES:
        raise Refused(
            f"not a safetensors file: header length {length} is larger than the file ({size} bytes)"
        )
    if length > MAX_HEADER_BYTES:
        raise Refused(
            f"not a safetensors file: header length {length} is absurdly large"
            f" (the limit is {MAX_HEADER_BYTES} bytes)"
        )
    if length == 0:
        raise Refused("not a safetensors file: header length is 0")
    data_length = size - SAFETENSORS_LENGTH_BYTES - length
    metadata, tensors = _parse_header(_read_exactly(handle, length), data_length)
    return SafetensorsHeader(
        path=path,
        header_length=length,
        file_size=size,
        metadata=metadata,
        tensors=tensors,
        identity=FileIdentity.of(os.fstat(handle.fileno())),
    )


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Validate a safetensors file's structure and return its header.

    Checks, in order: the path (see :func:`check_regular_file`), the 8-byte little-endian
    header length against the file size and :data:`MAX_HEADER_BYTES`, the header as a
    UTF-8 JSON object with no duplicate keys, ``__metadata__`` as string-to-string, every
    tensor entry (exactly ``dtype``, ``shape``, ``data_offsets``; a known dtype; byte span
    equal to numel times the element size), and finally that the tensors tile the data
    section exactly. When the file fails and its first bytes look like a zip archive, a
    git-lfs pointer or a pickle, the cause says so instead, since that is the real problem.

    Raises :class:`InputError` with a one-line cause; never any other exception for any
    file content.
    """
    header, handle = read_header_open(path)
    handle.close()
    return header


def read_header_open(path: str | os.PathLike[str]) -> tuple[SafetensorsHeader, BinaryIO]:
    """:func:`read_header`, and the open file it was read from, for reading the data.

    The data must come from the file whose header was validated: reopening the
    path could reach another file (an ``os.replace`` in between), whose bytes
    would then be read at this header's offsets. The caller closes the file.
    """
    path = os.fspath(path)
    handle, size = open_checked(path)
    try:
        return _read_content(path, handle, size), handle
    except Refused as refused:
        cause = refused.cause
        try:
            handle.seek(0)
            kind = classify_head(handle.read(_SNIFF_BYTES), size)
        except OSError:
            kind = None
        if kind in _FOREIGN_KINDS:
            cause = _FOREIGN_KINDS[kind]
        handle.close()
        raise InputError(path, cause) from None
    except OSError as error:
        handle.close()
        raise InputError(path, describe_os_error(error)) from None
    except BaseException:
        handle.close()
        raise
