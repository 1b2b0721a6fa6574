"""The host-side facts of many in-memory tensors, read in one pass, kept as columns.

``audit`` of 100,000 tiny gradients spent more time in per-tensor Python than
torch spends summing them: a ``torch.sum`` of a tensor of a few hundred elements
is one op dispatch (~1.5 µs here), and every attribute a Python loop reads from a
tensor (``.dtype``, ``.shape``, ``.data_ptr()`` ...) costs a few tenths of that.
So the five facts the native kernel needs are read in one pass over the list,
each tensor's while its objects are in the cache (five passes of one fact each
cost 1.7× as much on 100,000 tensors: each pass walked 40 MB of tensor objects
again), and every decision is taken once per *group* of tensors, as torch's
foreach ops group tensors by device and dtype: a list of plain, contiguous CPU
tensors of the native kernel's dtypes — nearly every state dict and gradient
list — becomes address and size columns for one native batch, and only the odd
tensor out (another device, strided, sparse, complex, a DTensor) takes the
per-tensor path.

Nothing here reads a tensor's values; the kernel does, later, in one call.
"""

from __future__ import annotations

import array
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gradaudit.no_gc import paused_gc

_itemsize = operator.attrgetter("itemsize")
#: Exact types whose instances are plain tensors (a subclass such as DTensor may not be).
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})

#: What is read of each tensor: dtype, on the CPU, contiguous, address, shape.
_Facts = tuple[torch.dtype, bool, bool, int, torch.Size]


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
    The cyclic GC is paused meanwhile: a collection set off by the facts' tuples would walk
    every tensor of the list again (it doubled the time on 100,000 tensors).
    """
    with paused_gc():
        return _segments(tensors, codes)


def _segments(
    tensors: Sequence[torch.Tensor], codes: Mapping[torch.dtype, int]
) -> tuple[list[Segment], list[int]]:
    count = len(tensors)
    if not count or not codes or not set(map(type, tensors)) <= _PLAIN:
        return [], list(range(count))
    facts: Sequence[_Facts | None]
    try:
        # No layout is read in the common case: of the layouts a tensor can have besides
        # strided, sparse COO and mkldnn raise in data_ptr() and the compressed sparse
        # ones in is_contiguous() (tests/test_bulk.py holds one of each), which sends
        # the list the careful way.
        plain: list[_Facts] = [
            (t.dtype, t.is_cpu, t.is_contiguous(), t.data_ptr(), t.shape) for t in tensors
        ]
    except RuntimeError:
        facts = [_careful_facts(t) for t in tensors]
    else:
        dtypes, on_cpu, contiguous, _, _ = zip(*plain, strict=True)
        kinds = set(dtypes)
        if kinds <= codes.keys() and all(on_cpu) and all(contiguous):
            return [_segment(plain, codes, kinds, 0, count)], []
        facts = plain
    segments: list[Segment] = []
    others: list[int] = []
    start = None
    for index, fact in enumerate(facts):
        if fact is not None and fact[0] in codes and fact[1] and fact[2]:
            if start is None:
                start = index
            continue
        others.append(index)
        if start is not None:
            segments.append(_segment(_known(facts, start, index), codes, None, start, index))
            start = None
    if start is not None:
        segments.append(_segment(_known(facts, start, count), codes, None, start, count))
    return segments, others


def _known(facts: Sequence[_Facts | None], start: int, stop: int) -> list[_Facts]:
    return [fact for fact in facts[start:stop] if fact is not None]


def _careful_facts(tensor: torch.Tensor) -> _Facts | None:
    """The facts of a strided CPU tensor, layout asked first; ``None`` for any other."""
    if not (tensor.is_cpu and tensor.layout is torch.strided):
        return None
    return tensor.dtype, True, tensor.is_contiguous(), tensor.data_ptr(), tensor.shape


def _segment(
    facts: Sequence[_Facts],
    codes: Mapping[torch.dtype, int],
    kinds: set[torch.dtype] | None,
    start: int,
    stop: int,
) -> Segment:
    dtypes, _, _, pointers, sizes = zip(*facts, strict=True)
    part_dtypes: list[torch.dtype] = list(dtypes)
    if kinds is None:
        kinds = set(part_dtypes)
    shapes = list(map(tuple, sizes))
    # From the shapes already read: a C-level product is a tenth of a numel() call.
    counts = array.array("Q", map(math.prod, shapes))
    if len(kinds) == 1:
        kind = next(iter(kinds))
        kind_codes = array.array("i", [codes[kind]]) * len(part_dtypes)
        nbytes = sum(counts) * kind.itemsize
    else:
        kind_codes = array.array("i", map(codes.__getitem__, part_dtypes))
        nbytes = sum(map(operator.mul, counts, map(_itemsize, part_dtypes)))
    return Segment(
        start,
        stop,
        array.array("Q", pointers),
        counts,
        kind_codes,
        shapes,
        part_dtypes,
        nbytes,
    )
