"""The host-side facts of many in-memory tensors, read column by column.

``audit`` of 100,000 tiny gradients spent more time in per-tensor Python than
torch spends summing them: a ``torch.sum`` of a tensor of a few hundred elements
is one op dispatch (~2 µs), and every attribute a Python loop reads from a
tensor (``.dtype``, ``.shape``, ``.data_ptr()`` ...) costs a few tenths of that.
So each fact is read once per tensor, by ``map`` over the whole list (no Python
frame per tensor), and every decision is taken once per *group* of tensors,
as torch's foreach ops group tensors by device and dtype: a list of plain,
contiguous CPU tensors of the native kernel's dtypes — nearly every state dict
and gradient list — becomes address and size columns for one native batch,
and only the odd tensor out (another device, strided, sparse, complex, a
DTensor) takes the per-tensor path.

Nothing here reads a tensor's values; the kernel does, later, in one call.
"""

from __future__ import annotations

import array
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

_dtype = operator.attrgetter("dtype")
_is_cpu = operator.attrgetter("is_cpu")
_shape = operator.attrgetter("shape")
_itemsize = operator.attrgetter("itemsize")
#: Exact types whose instances are plain tensors (a subclass such as DTensor may not be).
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


@dataclass(frozen=True)
class Segment:
    """Tensors ``start`` to ``stop`` of the list, all plain contiguous CPU tensors the native
    kernel reads as they are: their addresses, element counts, kernel codes and shapes."""

    start: int
    stop: int
    pointers: array.array[int]
    counts: array.array[int]
    codes: array.array[int]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    #: Bytes of all of them.
    nbytes: int


def native_segments(
    tensors: Sequence[torch.Tensor], codes: Mapping[torch.dtype, int]
) -> tuple[list[Segment], list[int]]:
    """Cut ``tensors`` into :class:`Segment` s the native kernel takes as they are, and the
    indices of the others (in order), which take the per-tensor path.

    ``codes`` is the native kernel's dtype -> code table (empty: every tensor is "other").
    """
    count = len(tensors)
    if not count or not codes or not set(map(type, tensors)) <= _PLAIN:
        return [], list(range(count))
    dtypes = list(map(_dtype, tensors))
    kinds = set(dtypes)
    if kinds <= codes.keys() and set(map(_is_cpu, tensors)) == {True}:
        # The common case: one segment, and no pass over the layouts. Of the other
        # layouts a CPU tensor can have, sparse COO is not contiguous, the compressed
        # sparse ones raise in is_contiguous() and mkldnn in data_ptr(): each sends the
        # list the careful way below (tests/test_bulk.py holds one of each).
        try:
            if all(map(torch.Tensor.is_contiguous, tensors)):
                return [_segment(tensors, dtypes, codes, kinds, 0, count)], []
        except RuntimeError:
            pass
    # Whether each tensor is the native kernel's as it is.
    take = [
        dtype in codes and t.is_cpu and t.layout is torch.strided and t.is_contiguous()
        for dtype, t in zip(dtypes, tensors, strict=True)
    ]
    segments: list[Segment] = []
    others: list[int] = []
    start = None
    for index, ok in enumerate(take):
        if ok:
            if start is None:
                start = index
            continue
        others.append(index)
        if start is not None:
            segments.append(_segment(tensors, dtypes, codes, None, start, index))
            start = None
    if start is not None:
        segments.append(_segment(tensors, dtypes, codes, None, start, count))
    return segments, others


def _segment(
    tensors: Sequence[torch.Tensor],
    dtypes: list[torch.dtype],
    codes: Mapping[torch.dtype, int],
    kinds: set[torch.dtype] | None,
    start: int,
    stop: int,
) -> Segment:
    part = tensors[start:stop] if start or stop != len(tensors) else tensors
    part_dtypes = dtypes[start:stop] if start or stop != len(dtypes) else dtypes
    if kinds is None:
        kinds = set(part_dtypes)
    shapes = list(map(tuple, map(_shape, part)))
    # From the shapes already read: a C-level product is a tenth of a numel() call.
    counts = array.array("Q", map(math.prod, shapes))
    if len(kinds) == 1:
        kind = next(iter(kinds))
        kind_codes = array.array("i", [codes[kind]]) * len(part)
        nbytes = sum(counts) * kind.itemsize
    else:
        kind_codes = array.array("i", map(codes.__getitem__, part_dtypes))
        nbytes = sum(map(operator.mul, counts, map(_itemsize, part_dtypes)))
    return Segment(
        start,
        stop,
        array.array("Q", map(torch.Tensor.data_ptr, part)),
        counts,
        kind_codes,
        shapes,
        part_dtypes,
        nbytes,
    )
