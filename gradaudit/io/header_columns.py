"""A safetensors header read straight into columns, without a Python object per entry.

A file of a million tiny tensors (LoRA adapters, MoE experts) has a 74 MB header.
``json.loads`` made a tuple, two lists and a handful of ints and strings per entry
(~550 bytes, 1.1 GB at the peak) and took seconds. The writers of the format
(the safetensors library, and everyone who calls it) all write one form::

    {"__metadata__":{"format":"pt"},"name":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},...}

This module reads exactly that form (JSON whitespace allowed between tokens, keys
in that order, ``__metadata__`` first or absent) into columns: the names, one dtype
code per tensor, and int64 arrays of ranks, dimensions and offsets. It only reads
the grammar; whether the entries make a valid file (sizes, tiling, duplicates) is
:func:`gradaudit.io.safetensors_table.from_columns`' job, shared with the JSON path.

Anything else - an escape in a name, another key order, a negative, fractional or
huge number, an unknown dtype, a non-UTF-8 name - returns ``None``: the full JSON
parser in :mod:`gradaudit.io.safetensors_header` then takes the header and names
the problem if there is one, so every refusal has one wording whichever way the
header was read. There are two readers of the form that accept exactly the same
texts: the native one (``gradaudit/engine/_native.c``, when it was built: ~0.2 s for a
million entries) and a pure-Python one that walks the text with one regular
expression a megabyte at a time (~3 s, and the same bounded memory).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress
from operator import methodcaller
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["HeaderColumns", "native_columns", "python_columns", "read_columns"]


@dataclass(frozen=True)
class HeaderColumns:
    """The entries of a header in the common form, in header order, not yet validated."""

    names: list[str]
    #: One byte per tensor: its dtype's index in the ``dtypes`` the reader was given.
    codes: bytes
    #: Dimensions per tensor (int64), and every shape's dimensions end to end.
    ranks: np.ndarray
    dims: np.ndarray
    #: ``data_offsets`` (int64).
    begins: np.ndarray
    ends: np.ndarray
    #: ``(start, end)`` of the ``__metadata__`` object's text in the header, if present.
    metadata: tuple[int, int] | None


def _load_native() -> Callable[..., Any] | None:
    try:
        from gradaudit.engine import _native  # type: ignore[attr-defined]  # optional build
    except ImportError:
        return None
    module: ModuleType = _native
    reader: Callable[..., Any] | None = getattr(module, "header_columns", None)
    return reader


_NATIVE = _load_native()


def native_available() -> bool:
    """Whether the native reader was built (an older build of the extension lacks it)."""
    return _NATIVE is not None


def native_columns(header: bytes, dtypes: tuple[str, ...]) -> HeaderColumns | None:
    """The native reader; ``None`` when the text is not in the common form.

    Raises :class:`RuntimeError` when the extension lacks it (see :func:`native_available`).
    """
    if _NATIVE is None:
        raise RuntimeError("the native header reader is not built")
    found = _NATIVE(header, dtypes)
    if found is None:
        return None
    names, codes, ranks, dims, offsets, metadata = found
    pairs = np.frombuffer(offsets, dtype=np.int64).reshape(-1, 2)
    return HeaderColumns(
        names,
        codes,
        np.frombuffer(ranks, dtype=np.int64),
        np.frombuffer(dims, dtype=np.int64),
        pairs[:, 0],
        pairs[:, 1],
        metadata,
    )


# The same grammar as the native reader, token for token.
_WS = rb"[ \t\n\r]*"
_STRING = rb'"(?:[^"\\\x00-\x1f]|\\[\x00-\xff])*"'
_PLAIN = rb'"([^"\\\x00-\x1f]*)"'
_NUMBER = rb"(?:0|[1-9][0-9]*)"
_OPEN = re.compile(_WS + rb"\{" + _WS)
_SKIP_WS = re.compile(_WS)
_METADATA = re.compile(
    rb'"__metadata__"' + _WS + rb":" + _WS
    + rb"(\{" + _WS
    + rb"(?:" + _STRING + _WS + rb":" + _WS + _STRING + _WS
    + rb"(?:," + _WS + _STRING + _WS + rb":" + _WS + _STRING + _WS + rb")*)?"
    + rb"\})" + _WS + rb"," + _WS
)  # fmt: skip
_ENTRY = re.compile(
    _PLAIN + _WS + rb":" + _WS + rb"\{" + _WS
    + rb'"dtype"' + _WS + rb":" + _WS + _PLAIN + _WS + rb"," + _WS
    + rb'"shape"' + _WS + rb":" + _WS + rb"\[" + _WS
    + rb"((?:" + _NUMBER + _WS + rb"," + _WS + rb")*" + _NUMBER + rb")?" + _WS + rb"\]"
    + _WS + rb"," + _WS
    + rb'"data_offsets"' + _WS + rb":" + _WS + rb"\[" + _WS
    + rb"(" + _NUMBER + rb")" + _WS + rb"," + _WS + rb"(" + _NUMBER + rb")" + _WS + rb"\]"
    + _WS + rb"\}" + _WS + rb"([,}])" + _WS
)  # fmt: skip
#: Bytes of text matched per step: bounds the per-entry objects alive at once.
_STEP = 1 << 20
_INT64_MAX = 2**63 - 1
_COMMAS = methodcaller("count", b",")


def python_columns(header: bytes, dtypes: tuple[str, ...]) -> HeaderColumns | None:
    """The pure-Python reader: the native one's result, from a regular expression.

    Entries are matched a megabyte of text at a time and turned into columns
    before the next step, so the per-entry match objects never pile up.
    """
    start = _OPEN.match(header)
    if start is None:
        return None
    pos = start.end()
    metadata = None
    if header.startswith(b'"__metadata__"', pos):
        found = _METADATA.match(header, pos)
        if found is None:
            return None  # not string to string, or not followed by a tensor
        metadata = found.span(1)
        pos = found.end()
    code_of = {name.encode(): code for code, name in enumerate(dtypes)}
    names: list[str] = []
    codes = bytearray()
    ranks: list[np.ndarray] = []
    dims: list[np.ndarray] = []
    bounds: list[np.ndarray] = []
    end = len(header)
    closed = False
    while not closed:
        if pos >= end:
            return None
        groups = []
        for match in _ENTRY.finditer(header, pos, min(end, pos + _STEP)):
            if match.start() != pos or closed:
                return None  # a gap the grammar does not cover, or text after the end
            pos = match.end()
            groups.append(match.groups(b""))
            closed = match.group(6) == b"}"
        if not groups:
            # An entry longer than a step (a huge name): one more try over the rest.
            whole = _ENTRY.match(header, pos)
            if whole is None:
                return None
            pos = whole.end()
            groups.append(whole.groups(b""))
            closed = whole.group(6) == b"}"
        raw_names, raw_dtypes, shapes, raw_begins, raw_ends, _ = zip(*groups, strict=True)
        del groups
        try:
            names += map(bytes.decode, raw_names)
            codes += bytes(map(code_of.__getitem__, raw_dtypes))
            present = list(map(bool, shapes))
            counts = np.fromiter(map(_COMMAS, shapes), dtype=np.int64, count=len(shapes))
            ranks.append(counts + np.array(present, dtype=np.int64))
            joined = b",".join(compress(shapes, present))
            numbers = list(map(int, joined.split(b","))) if joined else []
            numbers += map(int, raw_begins)
            numbers += map(int, raw_ends)
            if numbers and max(numbers) > _INT64_MAX:
                return None
            values = np.array(numbers, dtype=np.int64)
        except (UnicodeDecodeError, KeyError):
            return None
        count = len(raw_begins)
        # A step may end inside the whitespace after an entry.
        pos = _SKIP_WS.match(header, pos).end()  # type: ignore[union-attr]
        dims.append(values[: len(values) - 2 * count])
        bounds.append(values[len(values) - 2 * count :].reshape(2, count))
    if pos != end:
        return None
    both = np.concatenate(bounds, axis=1)
    return HeaderColumns(
        names,
        bytes(codes),
        np.concatenate(ranks),
        np.concatenate(dims),
        both[0],
        both[1],
        metadata,
    )


def read_columns(
    header: bytes, dtypes: tuple[str, ...], *, native: bool | None = None
) -> HeaderColumns | None:
    """The header's columns by the native reader when built (``native=None``), else Python.

    ``native`` forces one reader (tests check that both give the same answer).
    """
    use_native = native_available() if native is None else native
    if use_native:
        return native_columns(header, dtypes)
    return python_columns(header, dtypes)
