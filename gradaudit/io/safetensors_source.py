"""Safetensors dumps: our own header check, then zero-copy views of a memory map."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np
import torch

from gradaudit.engine.dtypes import dtype_skip_reason, hides_values
from gradaudit.io.base import Excluded, RunItem, Select, SourceItem, TensorRun
from gradaudit.io.safetensors_header import SafetensorsHeader
from gradaudit.io.safetensors_map import RUN_MAX_ELEMENTS as RUN_MAX_ELEMENTS
from gradaudit.io.safetensors_map import RUN_TENSORS as RUN_TENSORS
from gradaudit.io.safetensors_map import TORCH_NAMES, MappedSafetensors, ReadAhead
from gradaudit.io.safetensors_table import DTYPE_NAMES
from gradaudit.results import Skipped

#: safetensors dtype spelling -> torch dtype, for the dtypes this torch knows.
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attribute)
    for name, attribute in TORCH_NAMES.items()
    if hasattr(torch, attribute)
}

#: Header dtypes that hold floating-point or complex values (a tensor of one of them
#: that cannot be read could hide a NaN).
_FLOATING_CODES = ("F", "BF", "C")


class SafetensorsSource(MappedSafetensors):
    """One ``.safetensors`` file, as zero-copy tensor views of its map.

    The header check, the guarded map and :meth:`check_unchanged` are
    :class:`~gradaudit.io.safetensors_map.MappedSafetensors`'. With the header
    already checked, ``safe_open`` would only add its own per-tensor cost (about
    10 µs each, which dominated a dump of thousands of small tensors), so the
    views are made here, at the validated offsets.
    """

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        mapping = self.map()
        each = _Each(self.path, mapping, self.header)
        for index, name in enumerate(self.header.tensors.names):
            if select is not None and not select(name):
                yield Excluded(name)
                continue
            yield each.item(index)

    def runs(self) -> Iterator[RunItem]:
        """:meth:`items` without a selection; small tensors come as :class:`TensorRun` columns.

        Consecutive tensors (in file order) of one audited dtype, each at most
        :data:`RUN_MAX_ELEMENTS` and empty or aligned to its element size, form a run of
        at most :data:`RUN_TENSORS`; every other tensor comes on its own.
        """
        mapping = self.map()
        each = _Each(self.path, mapping, self.header)
        table = self.header.tensors
        count = len(table)
        if mapping is None or count == 0:
            for index in range(count):
                yield each.item(index)
            return
        data_start = self.data_start
        numel = self.element_counts()
        for first, stop, code in self.run_bounds(_RUNNABLE_CODES):
            if code < 0:
                for index in range(first, stop):
                    yield each.item(index)
                continue
            pointers, counts, ranks, dims = self.run_columns(first, stop, numel)
            low = data_start + int(table.begins[first])
            high = data_start + int(table.ends[stop - 1])
            # A run of empty tensors lies in no bytes (and frombuffer refuses a count of 0).
            data = (
                torch.frombuffer(mapping, dtype=torch.uint8, count=high - low, offset=low)
                if high > low
                else torch.empty(0, dtype=torch.uint8)
            )
            yield TensorRun(
                names=table.names[first:stop],
                dtype=TORCH_DTYPES[DTYPE_NAMES[code]],
                ranks=ranks,
                dims=dims,
                pointers=pointers,
                counts=counts,
                data=data,
            )


#: Per dtype code: whether its tensors are audited (so they may form runs).
_RUNNABLE_CODES = np.array(
    [name in TORCH_DTYPES and dtype_skip_reason(TORCH_DTYPES[name]) is None for name in DTYPE_NAMES]
)


class _Each:
    """One tensor of the file at a time: a view at its offsets, or why it is skipped."""

    def __init__(self, path: str, mapping: mmap.mmap | None, header: SafetensorsHeader) -> None:
        self.path = path
        self.mapping = mapping
        self.table = header.tensors
        self.data_start = 8 + header.header_length
        self.read_ahead = ReadAhead(mapping, self.data_start, self.table)

    def item(self, index: int) -> SourceItem:
        table = self.table
        name = table.names[index]
        dtype_text = DTYPE_NAMES[table.codes[index]]
        dtype = TORCH_DTYPES.get(dtype_text)
        reason = (
            f"dtype {dtype_text} is not supported by this PyTorch; not audited"
            if dtype is None
            else dtype_skip_reason(dtype)
        )
        if dtype is None or reason is not None:
            unread = (
                dtype_text.startswith(_FLOATING_CODES) if dtype is None else hides_values(dtype)
            )
            return Skipped(name, reason or "not audited", self.path, unread)
        self.read_ahead.next_after(index)
        begin = int(table.begins[index])
        nbytes = int(table.ends[index]) - begin
        tensor = _view(self.mapping, self.data_start + begin, nbytes, dtype)
        return name, tensor.view(table.shape(index))


def _view(mapping: mmap.mmap | None, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor over ``nbytes`` of the mapping at ``offset``, copying only if misaligned."""
    itemsize = dtype.itemsize
    if nbytes == 0 or mapping is None:
        return torch.empty(0, dtype=dtype)
    if offset % itemsize:
        # The format does not promise aligned tensors; a copy of this one is.
        return torch.frombuffer(bytearray(mapping[offset : offset + nbytes]), dtype=dtype)
    return torch.frombuffer(mapping, dtype=dtype, count=nbytes // itemsize, offset=offset)
