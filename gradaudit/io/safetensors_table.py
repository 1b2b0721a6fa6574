"""A safetensors header's tensors as columns, and the fast way to build and check them.

:class:`TensorTable` holds names, a dtype code, offsets and shapes as arrays, not an
object per tensor (a file can declare a million tiny ones). The builders here check a
header in the common form column by column, with C-level passes, and answer ``None``
whenever they are not certain it is valid: the entry-by-entry validator
(:mod:`gradaudit.io.safetensors_header`) then decides and names the problem, so every
refusal has one wording whichever way the header was read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from gradaudit.io.header_columns import read_columns
from gradaudit.io.safetensors_json import (
    METADATA_KEY,
    JsonObject,
    Refused,
    parse_json,
    parse_metadata,
)
from gradaudit.results.column_view import ColumnView

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

TENSOR_KEYS = ("dtype", "shape", "data_offsets")
TENSOR_KEY_SET = frozenset(TENSOR_KEYS)


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
DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(DTYPE_NAMES)}


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
            bytes(DTYPE_CODES[e.dtype] for e in entries),
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


#: Bytes per element, by :class:`TensorTable` dtype code.
SIZES_BY_CODE = np.array(list(SAFETENSORS_DTYPE_SIZES.values()), dtype=np.int64)


def fast_table(document: JsonObject, data_length: int) -> TensorTable | None:
    """Validate a well-formed header column by column, or return ``None``.

    The same rules as the validator's ``_parse_entry`` and ``_check_tiling``, checked
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
    if METADATA_KEY in names:
        where = names.index(METADATA_KEY)
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
        if set(map(type, values)) != {JsonObject} or set(map(len, values)) != {3}:
            return None
        # Entries as one flat run of (key, value) pairs; a file written by a library
        # uses one key order throughout, and then every third pair is the same field.
        flat_pairs = list(chain.from_iterable(values))
        keys = list(map(itemgetter(0), flat_pairs))
        fields = list(map(itemgetter(1), flat_pairs))
        del flat_pairs, values
        order = keys[:3]
        if set(order) != TENSOR_KEY_SET or any(
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
    codes = bytes(map(DTYPE_CODES.__getitem__, dtypes))
    return columns_table(
        names, codes, lengths, dim_array, bounds[:, 0], bounds[:, 1], data_length, numel
    )


def columns_table(
    names: list[str],
    codes: bytes,
    lengths: np.ndarray,
    dims: np.ndarray,
    begins: np.ndarray,
    ends: np.ndarray,
    data_length: int,
    numel: np.ndarray,
) -> TensorTable | None:
    """The checks of the validator's ``_parse_entry`` and ``_check_tiling`` on columns, or ``None``.

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


def from_columns(header: bytes, data_length: int) -> tuple[dict[str, str], TensorTable] | None:
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
    if count == 0 or len(set(names)) != count or METADATA_KEY in names:
        return None
    metadata: dict[str, str] = {}
    if columns.metadata is not None:
        start, end = columns.metadata
        try:
            metadata = parse_metadata(parse_json(header[start:end].decode("utf-8")))
        except (Refused, UnicodeDecodeError):
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
    table = columns_table(
        names, columns.codes, lengths, dims, columns.begins, columns.ends, data_length, numel
    )
    return None if table is None else (metadata, table)
