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
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any, BinaryIO, NoReturn

import numpy as np

from gradaudit.errors import InputError
from gradaudit.io.files import SHOW_LIMIT, FileIdentity, describe_os_error, open_checked, show
from gradaudit.io.header_columns import read_columns
from gradaudit.no_gc import paused_gc
from gradaudit.results.column_view import ColumnView

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPE_SIZES",
    "UNSUPPORTED_SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "TensorEntry",
    "TensorTable",
    "classify_head",
    "read_header",
    "read_header_open",
]

#: Headers longer than this are refused as absurd. The value is the safetensors library's
#: own limit (``MAX_HEADER_SIZE = 100_000_000`` in the Rust crate), not 100 MiB: with a
#: larger limit a header between the two sizes would pass here and then make the library
#: fail, which is exactly what this module exists to prevent.
MAX_HEADER_BYTES = 100_000_000

#: Bytes per element of every whole-byte dtype the format defines and the safetensors
#: PyTorch loader can materialise. A tensor's byte span must equal numel times this.
SAFETENSORS_DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

#: Sub-byte dtypes the format defines but PyTorch cannot hold as tensors; a file using them
#: is well-formed but cannot be audited, so it gets "unsupported" rather than "unknown".
UNSUPPORTED_SAFETENSORS_DTYPES: frozenset[str] = frozenset({"F4", "F6_E2M3", "F6_E3M2"})

_LENGTH_BYTES = 8
#: Shape dimensions must fit a signed 64-bit int: PyTorch refuses larger sizes even when
#: another dimension is 0, and the library refuses running products above 2**64 - 1.
_MAX_DIM = 2**63 - 1
_MAX_USIZE = 2**64 - 1
_SNIFF_BYTES = 64
_TENSOR_KEYS = ("dtype", "shape", "data_offsets")
_TENSOR_KEY_SET = frozenset(_TENSOR_KEYS)
_METADATA_KEY = "__metadata__"

_FOREIGN_KINDS = {
    "zip": "looks like a zip archive (a PyTorch checkpoint?), not safetensors",
    "git-lfs": "is a git-lfs pointer, not the file's content: run `git lfs pull`",
    "pickle": "looks like a pickle (a PyTorch .pt/.bin file?), not safetensors",
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header declares it, already checked against the data section."""

    name: str
    #: The safetensors spelling, e.g. ``"F32"``, ``"BF16"``, ``"I64"``.
    dtype: str
    shape: tuple[int, ...]
    #: Byte offsets relative to the start of the data section (``8 + header_length``).
    begin: int
    end: int


#: Dtype spellings by code, for :class:`TensorTable`'s compact dtype column.
DTYPE_NAMES: tuple[str, ...] = tuple(SAFETENSORS_DTYPE_SIZES)
_DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(DTYPE_NAMES)}


class TensorTable(ColumnView[TensorEntry]):
    """The tensors of a header as columns, in data-offset order.

    A file can declare a million tiny tensors (LoRA adapters, MoE experts); a
    frozen :class:`TensorEntry` per tensor cost about 400 bytes and a Python
    constructor call each. The columns cost the name plus about 30 bytes, and
    readers go through them without making entries; indexing or iterating
    still gives :class:`TensorEntry` values, made on demand.
    """

    item_noun = "tensor"
    __slots__ = ("begins", "codes", "dims", "ends", "names", "starts")

    def __init__(
        self,
        names: list[str],
        codes: bytes,
        begins: np.ndarray,
        ends: np.ndarray,
        dims: np.ndarray,
        starts: np.ndarray,
    ) -> None:
        #: Tensor names.
        self.names = names
        #: One byte per tensor: the index of its dtype in :data:`SAFETENSORS_DTYPE_SIZES`.
        self.codes = codes
        #: Data offsets (int64), relative to the start of the data section.
        self.begins = begins
        self.ends = ends
        #: Every shape's dimensions laid end to end (int64); tensor ``i``'s shape is
        #: ``dims[starts[i]:starts[i + 1]]``.
        self.dims = dims
        self.starts = starts

    @classmethod
    def from_entries(cls, entries: Sequence[TensorEntry]) -> TensorTable:
        lengths = [len(e.shape) for e in entries]
        starts = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        return cls(
            [e.name for e in entries],
            bytes(_DTYPE_CODES[e.dtype] for e in entries),
            np.array([e.begin for e in entries], dtype=np.int64),
            np.array([e.end for e in entries], dtype=np.int64),
            np.array([d for e in entries for d in e.shape], dtype=np.int64),
            starts,
        )

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, index: int) -> tuple[int, ...]:
        return tuple(self.dims[self.starts[index] : self.starts[index + 1]].tolist())

    def dtype(self, index: int) -> str:
        return DTYPE_NAMES[self.codes[index]]

    def _entry(self, index: int) -> TensorEntry:
        return TensorEntry(
            self.names[index],
            DTYPE_NAMES[self.codes[index]],
            self.shape(index),
            int(self.begins[index]),
            int(self.ends[index]),
        )

    def _take(self, indices: range) -> Iterator[TensorEntry]:
        return (self._entry(i) for i in indices)

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"


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


class _Refused(Exception):
    """Internal: the content is not acceptable; carries the one-line cause."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class _JsonObject(tuple[tuple[str, Any], ...]):
    """A JSON object as its raw key/value pairs, so duplicate keys stay visible.

    ``json.loads`` would build a dict and keep the last duplicate silently, as the
    safetensors library does; keeping the pairs lets each context (tensor names, metadata
    keys, entry fields) name its own duplicate.

    A tuple subclass with no Python ``__init__``: ``json`` calls the hook once per
    object, and a constructor that runs Python code made parsing a header of
    thousands of tensors several times slower.
    """

    __slots__ = ()

    @property
    def pairs(self) -> tuple[tuple[str, Any], ...]:
        return self


def _show_value(value: Any) -> str:
    """Render a JSON value for a message, bounded in length."""
    if isinstance(value, _JsonObject):
        return "an object"
    if isinstance(value, str):
        return show(value)
    text = json.dumps(value)
    return text if len(text) <= SHOW_LIMIT else text[:SHOW_LIMIT] + "..."


def _json_type(value: Any) -> str:
    """Name a parsed JSON value's type the way the JSON spec does."""
    if isinstance(value, _JsonObject):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "null"


def classify_head(head: bytes, file_size: int) -> str | None:
    """Say what the first bytes of a file look like (:func:`gradaudit.io.sniff.sniff` names it).

    A plausible safetensors prefix wins over the other signatures: a valid header length
    such as 640 starts with ``0x80 0x02``, which is also the start of a protocol-2 pickle.
    """
    if len(head) >= _LENGTH_BYTES:
        (length,) = struct.unpack("<Q", head[:_LENGTH_BYTES])
        rest = head[_LENGTH_BYTES:].lstrip(b" \t\r\n")
        if 0 < length <= file_size - _LENGTH_BYTES and rest.startswith(b"{"):
            return "safetensors-ish"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith(b"version https://git-lfs"):
        return "git-lfs"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    return None


def _reject_constant(name: str) -> NoReturn:
    """``json`` hook: refuse ``NaN``/``Infinity``, which are not JSON and the library refuses."""
    raise _Refused(f"header is not valid JSON ({name} is not a JSON value)")


def _parse_int(text: str) -> int | float:
    """``json`` hook: keep ``-0`` distinct from ``0``.

    Python reads ``-0`` as the integer 0, the library reads it as the float -0.0 and
    refuses it as an offset or dimension; returning a float makes it fail here as well.
    The hook costs a Python call per number, so :func:`_parse_json` only uses it
    when the text contains ``-0`` at all.
    """
    return -0.0 if text == "-0" else int(text)


def _parse_json(text: str) -> Any:
    """Parse the header text, keeping objects as :class:`_JsonObject` pair lists."""
    try:
        return json.loads(
            text,
            object_pairs_hook=_JsonObject,
            parse_constant=_reject_constant,
            parse_int=_parse_int if "-0" in text else None,
        )
    except RecursionError:
        raise _Refused("header is not valid JSON (nested too deeply)") from None
    except json.JSONDecodeError as error:
        raise _Refused(f"header is not valid JSON ({error.msg} at byte {error.pos})") from None
    except ValueError:
        # int() refuses numbers with thousands of digits; nothing else raises it here.
        raise _Refused("header is not valid JSON (a number is far too long)") from None


def _check_text(text: str, what: str) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (from a ``\\ud800`` escape).

    Python's ``json`` accepts it, the library's JSON parser does not, so a name like that
    would pass here and then fail in the library.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _Refused(f"{what} holds an invalid \\u escape (a lone surrogate)") from None


def _unique_pairs(obj: _JsonObject, duplicate: Callable[[str], str]) -> dict[str, Any]:
    """Turn an object's pairs into a dict, refusing a repeated key.

    ``duplicate`` builds the message from the quoted key. A function rather than a
    ``str.format`` template: the message may hold a tensor name from the file, and braces
    in it must not be read as format fields.
    """
    result: dict[str, Any] = {}
    for key, value in obj.pairs:
        if key in result:
            raise _Refused(duplicate(show(key)))
        result[key] = value
    return result


def _parse_metadata(value: Any) -> dict[str, str]:
    """Validate ``__metadata__``: a string-to-string object (``null`` means absent).

    ``null`` is accepted because the library accepts it (its field is an ``Option``).
    """
    if value is None:
        return {}
    if not isinstance(value, _JsonObject):
        raise _Refused(f"__metadata__ is not a JSON object (got {_json_type(value)})")
    metadata = _unique_pairs(
        value,
        lambda key: (
            f"duplicate key {key} in __metadata__"
            " (the safetensors library would keep only the last)"
        ),
    )
    for key, item in metadata.items():
        _check_text(key, "a __metadata__ key")
        if not isinstance(item, str):
            raise _Refused(
                f"__metadata__ value for {show(key)} is not a string (got {_json_type(item)})"
            )
        _check_text(item, f"__metadata__ value for {show(key)}")
    return metadata


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
    _check_text(name, "a tensor name")
    fields = dict(value)
    shape = tuple(fields["shape"])
    begin, end = fields["data_offsets"]
    return TensorEntry(name=name, dtype=fields["dtype"], shape=shape, begin=begin, end=end)


def _well_formed(value: Any, data_length: int) -> bool:
    """The common case, checked fast: exactly the three keys, all valid and consistent."""
    if not isinstance(value, _JsonObject) or len(value) != 3:
        return False
    fields = dict(value)
    if fields.keys() != _TENSOR_KEY_SET:
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
    _check_text(name, "a tensor name")
    if not isinstance(value, _JsonObject):
        raise _Refused(f"{label}: entry is not a JSON object (got {_json_type(value)})")
    fields = _unique_pairs(value, lambda key: f"{label}: duplicate key {key}")
    for key in fields:
        if key not in _TENSOR_KEYS:
            raise _Refused(f"{label}: unexpected key {show(key)}")
    for key in _TENSOR_KEYS:
        if key not in fields:
            raise _Refused(f'{label}: missing "{key}"')

    dtype = fields["dtype"]
    if not isinstance(dtype, str):
        raise _Refused(f"{label}: dtype is not a string (got {_json_type(dtype)})")
    if dtype in UNSUPPORTED_SAFETENSORS_DTYPES:
        raise _Refused(f"{label}: unsupported dtype {show(dtype)} (sub-byte elements)")
    if dtype not in SAFETENSORS_DTYPE_SIZES:
        raise _Refused(f"{label}: unknown dtype {show(dtype)}")

    raw_shape = fields["shape"]
    if not isinstance(raw_shape, list) or not all(_is_count(d, _MAX_DIM) for d in raw_shape):
        raise _Refused(
            f"{label}: shape is not a list of non-negative integers ({_show_value(raw_shape)})"
        )
    shape: tuple[int, ...] = tuple(raw_shape)
    numel = 1
    for dim in shape:
        # Left to right with an overflow check, as the library does: it refuses
        # [2**40, 2**40, 0] even though the product is 0.
        numel *= dim
        if numel > _MAX_USIZE:
            raise _Refused(f"{label}: shape {_show_value(raw_shape)} overflows 64 bits")

    offsets = fields["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o, _MAX_USIZE) for o in offsets)
    ):
        raise _Refused(
            f"{label}: data_offsets is not two non-negative integers ({_show_value(offsets)})"
        )
    begin, end = offsets
    if begin > end:
        raise _Refused(f"{label}: data_offsets [{begin}, {end}] end before they begin")
    needed = numel * SAFETENSORS_DTYPE_SIZES[dtype]
    if end - begin != needed:
        raise _Refused(
            f"{label}: shape/size mismatch: shape {list(shape)} of {dtype} needs {needed} bytes"
            f" but data_offsets [{begin}, {end}] span {end - begin}"
        )
    if end > data_length:
        raise _Refused(
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
            raise _Refused(
                f"tensors {show(previous.name)} and {show(tensor.name)} overlap"
                f" (bytes {tensor.begin} to {min(position, tensor.end)})"
            )
        if tensor.begin > position:
            raise _Refused(
                f"gap of {tensor.begin - position} bytes before tensor {show(tensor.name)}"
                f" (data offset {position} to {tensor.begin})"
            )
        position = tensor.end
        previous = tensor
    if position != data_length:
        raise _Refused(
            f"{data_length - position} trailing bytes after the last tensor"
            f" (the data section is {data_length} bytes, the tensors cover {position})"
        )


def _parse_header(header: bytes, data_length: int) -> tuple[dict[str, str], TensorTable]:
    """Validate the header bytes; return the metadata and the tensors in offset order.

    A header in the common form is read straight into columns
    (:mod:`gradaudit.io.header_columns`); every other header, and every header
    with a problem, goes through the JSON parser, which names the problem.
    """
    found = _from_columns(header, data_length)
    if found is not None:
        return found
    return _parse_document(header, data_length)


def _parse_document(header: bytes, data_length: int) -> tuple[dict[str, str], TensorTable]:
    """:func:`_parse_header` through a JSON document: any header, and every refusal."""
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _Refused(f"header is not valid UTF-8 (at byte {error.start})") from None
    with paused_gc():
        document = _parse_json(text)
        if not isinstance(document, _JsonObject):
            raise _Refused(f"header is not a JSON object (got {_json_type(document)})")
        # A lone surrogate can only come from a \u escape; without one in the text,
        # no name needs the per-name check.
        escapes = "\\ud" in text or "\\uD" in text
        table = None if escapes else _fast_table(document, data_length)
        if table is not None:
            metadata = _parse_metadata(dict(document).get(_METADATA_KEY))
            return metadata, table
        return _parse_entries(document, data_length)


def _parse_entries(document: _JsonObject, data_length: int) -> tuple[dict[str, str], TensorTable]:
    """The entry-by-entry validation: every file the fast path does not take, and every refusal.

    It finds and names the first problem; the fast path only says whether there is one.
    """
    entries = _unique_pairs(
        document,
        lambda key: (
            f"duplicate tensor name {key} in the header"
            " (the safetensors library would silently keep only the last one)"
        ),
    )
    metadata = _parse_metadata(entries.pop(_METADATA_KEY, None))
    tensors = [_parse_entry(name, value, data_length) for name, value in entries.items()]
    tensors.sort(key=lambda t: (t.begin, t.end, t.name))
    _check_tiling(tensors, data_length)
    return metadata, TensorTable.from_entries(tensors)


_DTYPE = itemgetter("dtype")
_SHAPE = itemgetter("shape")
_OFFSETS = itemgetter("data_offsets")
#: Bytes per element, by :class:`TensorTable` dtype code.
SIZES_BY_CODE = np.array(list(SAFETENSORS_DTYPE_SIZES.values()), dtype=np.int64)


def _fast_table(document: _JsonObject, data_length: int) -> TensorTable | None:
    """Validate a well-formed header column by column, or return ``None``.

    The same rules as :func:`_parse_entry` and :func:`_check_tiling`, checked
    for all entries at once by C-level passes (``map``, sets, numpy) instead of
    Python code per entry: a header of a million tensors took seconds entry by
    entry. ``None`` means "not certainly valid": the entry-by-entry path then
    decides, and names the problem if there is one. Tensors with no elements
    (whose shapes need the running-product overflow rule) and ties in the
    offset order (names break them) are left to it too.
    """
    pairs: list[tuple[str, Any]] = list(document)
    names = list(map(itemgetter(0), pairs))
    values = list(map(itemgetter(1), pairs))
    del pairs
    if _METADATA_KEY in names:
        where = names.index(_METADATA_KEY)
        del names[where], values[where]
    count = len(names)
    if count == 0 or len(set(names)) != count:
        return None
    # Fresh copies of the names, made while the parsed document is still alive: they fill
    # new memory pools of their own, and when the document goes, the pools it shared with
    # the parser's names are freed whole. Keeping the parser's strings pinned those pools,
    # and the process kept most of the parse's peak (~800 MB for a million entries).
    names = list(map(bytes.decode, map(str.encode, names)))
    try:
        if set(map(type, values)) != {_JsonObject} or set(map(len, values)) != {3}:
            return None
        # Entries as one flat run of (key, value) pairs; a file written by a library
        # uses one key order throughout, and then every third pair is the same field.
        flat_pairs = list(chain.from_iterable(values))
        keys = list(map(itemgetter(0), flat_pairs))
        fields = list(map(itemgetter(1), flat_pairs))
        del flat_pairs, values
        order = keys[:3]
        if set(order) != _TENSOR_KEY_SET or any(
            set(keys[slot::3]) != {key} for slot, key in enumerate(order)
        ):
            return None  # repeated or unexpected keys, or mixed orders: entry by entry
        dtypes = fields[order.index("dtype") :: 3]
        shapes = fields[order.index("shape") :: 3]
        offsets = fields[order.index("data_offsets") :: 3]
        del fields, keys
        if not set(dtypes) <= SAFETENSORS_DTYPE_SIZES.keys():
            return None
        if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
            return None
        if set(map(len, offsets)) != {2}:
            return None
        dims = list(chain.from_iterable(shapes))
        flat = list(chain.from_iterable(offsets))
        if not set(map(type, dims)) <= {int} or set(map(type, flat)) != {int}:
            return None
        if dims and min(dims) < 0:
            return None
        numels = list(map(math.prod, shapes))
        if min(numels) <= 0 or max(numels) > data_length:
            return None  # empty tensors: the entry-by-entry rules; too large: refused there
        bounds = np.array(flat, dtype=np.int64).reshape(-1, 2)
        lengths = np.fromiter(map(len, shapes), dtype=np.int64, count=count)
        numel = np.array(numels, dtype=np.int64)
        dim_array = np.array(dims, dtype=np.int64)
    except (KeyError, TypeError, OverflowError, ValueError):
        return None
    codes = bytes(map(_DTYPE_CODES.__getitem__, dtypes))
    return _columns_table(
        names, codes, lengths, dim_array, bounds[:, 0], bounds[:, 1], data_length, numel
    )


def _columns_table(
    names: list[str],
    codes: bytes,
    lengths: np.ndarray,
    dims: np.ndarray,
    begins: np.ndarray,
    ends: np.ndarray,
    data_length: int,
    numel: np.ndarray,
) -> TensorTable | None:
    """The checks of :func:`_parse_entry` and :func:`_check_tiling` on columns, or ``None``.

    ``lengths`` is each shape's rank, ``dims`` every dimension end to end, ``numel``
    each tensor's element count (all at least 1: empty tensors are left to the
    entry-by-entry rules). One implementation for both ways of reading a header.
    """
    count = len(names)
    sizes = SIZES_BY_CODE[np.frombuffer(codes, dtype=np.uint8)]
    if (
        (begins < 0).any()
        or (ends < begins).any()
        or (ends > data_length).any()
        or ((ends - begins) != numel * sizes).any()
    ):
        return None
    by_offset = np.lexsort((ends, begins))
    begins, ends = begins[by_offset], ends[by_offset]
    # Every tensor has bytes, so tiling exactly means each starts where the last ended.
    if begins[0] != 0 or ends[-1] != data_length or (begins[1:] != ends[:-1]).any():
        return None
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    if not np.array_equal(by_offset, np.arange(count)):
        names = [names[i] for i in by_offset.tolist()]
        codes = bytes(np.frombuffer(codes, dtype=np.uint8)[by_offset])
        pieces = [dims[starts[i] : starts[i + 1]] for i in by_offset.tolist()]
        dims = np.concatenate(pieces) if pieces else dims
        np.cumsum(lengths[by_offset], out=starts[1:])
    return TensorTable(names, codes, begins, ends, dims, starts)


#: log2 of the largest element count checked exactly in int64 (beyond it: entry by entry).
_MAX_EXACT_LOG2 = 62


def _from_columns(header: bytes, data_length: int) -> tuple[dict[str, str], TensorTable] | None:
    """A header in the common form, validated column by column; ``None`` if not certainly valid.

    Reads no JSON document (:mod:`gradaudit.io.header_columns`): a million entries
    cost their names and a few int64 each instead of ~550 bytes of Python objects.
    The same rules as the JSON path; whatever it is unsure of (empty tensors,
    duplicate names, metadata that is not plain string to string) it leaves to it.
    """
    columns = read_columns(header, DTYPE_NAMES)
    if columns is None:
        return None
    names = columns.names
    count = len(names)
    if count == 0 or len(set(names)) != count or _METADATA_KEY in names:
        return None
    metadata: dict[str, str] = {}
    if columns.metadata is not None:
        start, end = columns.metadata
        try:
            metadata = _parse_metadata(_parse_json(header[start:end].decode("utf-8")))
        except (_Refused, UnicodeDecodeError):
            return None
    dims, lengths = columns.dims, columns.ranks
    if len(dims) and (dims.min() < 1 or dims.max() > data_length):
        return None  # empty tensors: the entry-by-entry rules; too large: refused there
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    shaped = np.flatnonzero(lengths > 0)
    numel = np.ones(count, dtype=np.int64)
    if len(shaped):
        if np.add.reduceat(np.log2(dims), starts[shaped]).max() > _MAX_EXACT_LOG2:
            return None
        numel[shaped] = np.multiply.reduceat(dims, starts[shaped])
    table = _columns_table(
        names, columns.codes, lengths, dims, columns.begins, columns.ends, data_length, numel
    )
    return None if table is None else (metadata, table)


def _read_exactly(handle: BinaryIO, count: int) -> bytes:
    """Read ``count`` bytes, refusing a file that shrank after its size was taken."""
    data = handle.read(count)
    if len(data) != count:
        raise _Refused("the file shrank while being read")
    return data


def _read_content(path: str, handle: BinaryIO, size: int) -> SafetensorsHeader:
    """Read and validate the length prefix and the header that follows it."""
    if size < _LENGTH_BYTES:
        raise _Refused(f"too short to be a safetensors file ({size} bytes, need at least 8)")
    (length,) = struct.unpack("<Q", _read_exactly(handle, _LENGTH_BYTES))
    if length > size - _LENGTH_BYTES:
        raise _Refused(
            f"not a safetensors file: header length {length} is larger than the file ({size} bytes)"
        )
    if length > MAX_HEADER_BYTES:
        raise _Refused(
            f"not a safetensors file: header length {length} is absurdly large"
            f" (the limit is {MAX_HEADER_BYTES} bytes)"
        )
    if length == 0:
        raise _Refused("not a safetensors file: header length is 0")
    data_length = size - _LENGTH_BYTES - length
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
    except _Refused as refused:
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
