"""The host-side facts of many in-memory tensors, read in one pass, kept as columns.

``audit`` of 100,000 tiny gradients spent more time in per-tensor Python than
torch spends summing them: a ``torch.sum`` of a tensor of a few hundred elements
is one op dispatch (~1.5 µs here), and every attribute a Python loop reads from a
tensor (``.dtype``, ``.shape``, ``.data_ptr()`` ...) costs a few tenths of that —
most of it waiting on memory, as each tensor's objects are a few cache misses away
from the previous one's. So the five facts the native kernel needs are read in one
pass over the list by the native extension (``tensor_facts`` in ``_native.c``: through
torch's C shim where :mod:`~gradaudit.engine.torch_shim` binds it, with no Python per
tensor, else through torch's public attributes; no torch headers), straight into the columns
the kernel and the results take: address, element count, kernel code, rank and
dimensions. Every decision is then taken once per *segment*, a run of tensors the
kernel reads as they are (plain, contiguous CPU tensors of its dtypes: nearly every
state dict and gradient list is one segment), as torch's foreach ops group tensors
by device and dtype; only the odd tensor out (another device, strided, sparse,
complex, a subclass such as DTensor) takes the per-tensor path.

Without the native build there is no kernel to hand columns to, and every tensor
takes the per-tensor path. Nothing here reads a tensor's values; the kernel does,
later, in one call.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradaudit.engine import native, torch_shim
from gradaudit.no_gc import paused_gc


@dataclass(frozen=True)
class Segment:
    """Tensors ``start`` to ``stop`` of the list, all plain contiguous CPU tensors the native
    kernel reads as they are, as columns: their addresses, element counts and kernel codes
    (for the kernel), and their shapes as ranks and dimensions back to back."""

    start: int
    stop: int
    pointers: array.array[int]
    counts: array.array[int]
    codes: array.array[int]
    ranks: array.array[int]
    dims: array.array[int]
    #: Bytes of all of them.
    nbytes: int


def native_segments(
    tensors: Sequence[torch.Tensor], codes: Mapping[torch.dtype, int]
) -> tuple[list[Segment], list[int]]:
    """Cut ``tensors`` into :class:`Segment` s the native kernel takes as they are, and the
    indices of the others (in order), which take the per-tensor path.

    ``codes`` is the native kernel's dtype -> code table (empty: every tensor is "other").
    The cyclic GC is paused meanwhile: a collection set off by the objects made here
    would walk every tensor of the list again (it doubled the time on 100,000 tensors).
    """
    count = len(tensors)
    if not count or not codes or not native.available():
        return [], list(range(count))
    with paused_gc():
        facts = native.tensor_facts(list(tensors), codes, torch_shim.PLAIN)
    ok, pointers, counts, kinds, ranks, dims, nbytes = facts
    if ok.count(1) == count:  # the common case: one segment, the columns as they came
        return [_segment(0, count, pointers, counts, kinds, ranks, dims, nbytes)], []
    taken = np.frombuffer(ok, dtype=np.uint8).astype(bool)
    others = np.flatnonzero(~taken).tolist()
    edges = np.flatnonzero(np.diff(taken.astype(np.int8), prepend=0, append=0))
    rank_column = np.frombuffer(ranks, dtype=np.int64)
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(rank_column, out=starts[1:])
    sizes = (
        np.frombuffer(counts, dtype=np.uint64)
        * _itemsizes(codes)[np.frombuffer(kinds, dtype=np.int32)]
    )
    segments = [
        _segment(
            start,
            stop,
            pointers[8 * start : 8 * stop],
            counts[8 * start : 8 * stop],
            kinds[4 * start : 4 * stop],
            ranks[8 * start : 8 * stop],
            dims[8 * int(starts[start]) : 8 * int(starts[stop])],
            int(sizes[start:stop].sum()),
        )
        for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True)
    ]
    return segments, others


def _itemsizes(codes: Mapping[torch.dtype, int]) -> np.ndarray:
    """Bytes per element, indexed by kernel code."""
    table = np.zeros(max(codes.values()) + 1, dtype=np.uint64)
    for dtype, code in codes.items():
        table[code] = dtype.itemsize
    return table


def _segment(
    start: int,
    stop: int,
    pointers: bytes,
    counts: bytes,
    codes: bytes,
    ranks: bytes,
    dims: bytes,
    nbytes: int,
) -> Segment:
    return Segment(
        start,
        stop,
        _column("Q", pointers),
        _column("Q", counts),
        _column("i", codes),
        _column("q", ranks),
        _column("q", dims),
        nbytes,
    )


def _column(typecode: str, data: bytes) -> array.array[int]:
    column = array.array(typecode)
    column.frombytes(data)
    return column
