"""Safetensors dumps: our own header check, then zero-copy views of a memory map."""

from __future__ import annotations

import array
import contextlib
import itertools
import mmap
import os
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np
import torch

from gradaudit.engine.stats import dtype_skip_reason, hides_values
from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, RunItem, Select, SourceItem, TensorRun
from gradaudit.io.files import open_checked
from gradaudit.io.mapguard import CHANGED_SIZE, MapGuard, check_path, same_file
from gradaudit.io.safetensors_header import (
    DTYPE_NAMES,
    SIZES_BY_CODE,
    SafetensorsHeader,
    TensorTable,
    read_header_open,
)
from gradaudit.results import Skipped

#: safetensors dtype spelling -> torch dtype, for the dtypes this torch knows.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
    **{
        name: getattr(torch, attribute)
        for name, attribute in (
            ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
            ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
            ("F8_E8M0", "float8_e8m0fnu"),
        )
        if hasattr(torch, attribute)
    },
}

#: Header dtypes that hold floating-point or complex values (a tensor of one of them
#: that cannot be read could hide a NaN).
_FLOATING_CODES = ("F", "BF", "C")


class SafetensorsSource:
    """One ``.safetensors`` file.

    The header is validated from the raw bytes first (duplicate names, offsets,
    sizes, trailing bytes): the safetensors library silently keeps the last of
    two tensors with the same name, which could hide a NaN tensor.

    The data is then read through our own memory map of the same open file, as
    zero-copy tensor views at the validated offsets: with the header already
    checked, ``safe_open`` would only add its own per-tensor cost (about 10 µs
    each, which dominated a dump of thousands of small tensors). The mapping is
    private (copy-on-write), so nothing can ever write to the file.

    A file that changes while it is read is refused by :meth:`check_unchanged`,
    which the caller asks before keeping anything read from it: the map is
    guarded (:mod:`gradaudit.io.mapguard`), so a truncation reads zeros instead
    of killing the process, and the file's identity is compared with the one
    its header was read from.
    """

    def __init__(self, path: str, header: SafetensorsHeader | None = None) -> None:
        """Validate ``path``; a shard whose header was already validated passes it in."""
        self.path = path
        self._handle: BinaryIO | None = None
        if header is None:
            header, self._handle = read_header_open(path)
        self.header: SafetensorsHeader = header
        self._guard: MapGuard | None = None
        self._address = 0

    def __del__(self) -> None:
        # A source used for its header only (``trend`` orders dumps by their metadata)
        # never maps the file: its descriptor is closed here, quietly.
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()

    @property
    def metadata(self) -> dict[str, str]:
        """The file's ``__metadata__``: it may say what the file holds (:mod:`gradaudit.roles`)."""
        return self.header.metadata

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        mapping = self._map()
        each = _Each(self.path, mapping, self.header)
        for index, name in enumerate(self.header.tensors.names):
            if select is not None and not select(name):
                yield Excluded(name)
                continue
            yield each.item(index)

    def runs(self) -> Iterator[RunItem]:
        """:meth:`items` without a selection; small tensors come as :class:`TensorRun` columns.

        Consecutive tensors (in file order) of one audited dtype, each at most
        :data:`RUN_MAX_ELEMENTS` and aligned to its element size, form a run of
        at most :data:`RUN_TENSORS`; every other tensor comes on its own.
        """
        mapping = self._map()
        each = _Each(self.path, mapping, self.header)
        table = self.header.tensors
        count = len(table)
        if mapping is None or count == 0:
            for index in range(count):
                yield each.item(index)
            return
        data_start = 8 + self.header.header_length
        codes = np.frombuffer(table.codes, dtype=np.uint8)
        sizes = SIZES_BY_CODE[codes]
        numel = (table.ends - table.begins) // sizes
        runnable = (
            _RUNNABLE_CODES[codes]
            & (numel > 0)
            & (numel <= RUN_MAX_ELEMENTS)
            & ((data_start + table.begins) % sizes == 0)
        )
        key = np.where(runnable, codes.astype(np.int64), -1)
        edges = [0, *(np.flatnonzero(np.diff(key)) + 1).tolist(), count]
        base = self._address + data_start
        for first, stop in itertools.pairwise(edges):
            code = int(key[first])
            if code < 0:
                for index in range(first, stop):
                    yield each.item(index)
                continue
            dtype = TORCH_DTYPES[DTYPE_NAMES[code]]
            for start in range(first, stop, RUN_TENSORS):
                end = min(stop, start + RUN_TENSORS)
                pointers = array.array("Q")
                pointers.frombytes((table.begins[start:end] + base).astype(np.uint64).tobytes())
                counts = array.array("Q")
                counts.frombytes(numel[start:end].astype(np.uint64).tobytes())
                low = data_start + int(table.begins[start])
                high = data_start + int(table.ends[end - 1])
                first_dim, end_dim = int(table.starts[start]), int(table.starts[end])
                ranks = array.array("q")
                ranks.frombytes(np.diff(table.starts[start : end + 1]).astype(np.int64).tobytes())
                dims = array.array("q")
                dims.frombytes(table.dims[first_dim:end_dim].astype(np.int64).tobytes())
                yield TensorRun(
                    names=table.names[start:end],
                    dtype=dtype,
                    ranks=ranks,
                    dims=dims,
                    pointers=pointers,
                    counts=counts,
                    data=torch.frombuffer(mapping, dtype=torch.uint8, count=high - low, offset=low),
                )

    def _map(self) -> mmap.mmap | None:
        """A private, read-only-in-effect, guarded mapping of the whole file (``None`` if empty).

        The mapping is made from the descriptor the header was read from; a shard
        whose header was read earlier is reopened, and must still be that file.
        """
        handle = self._handle
        if handle is None:
            handle, _ = open_checked(self.path)
            try:
                same_file(self.path, self.header.identity, os.fstat(handle.fileno()))
            except BaseException:
                handle.close()
                raise
        try:
            size = os.fstat(handle.fileno()).st_size
            if size != self.header.file_size:
                raise InputError(self.path, CHANGED_SIZE)
            if not size:
                return None
            # ACCESS_COPY: writable views for torch (no read-only buffer warning), and a
            # write would go to private copies of the pages, never to the file.
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as error:
            raise InputError(self.path, f"cannot map the file for reading ({error})") from None
        finally:
            handle.close()
            self._handle = None
        self._address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        self._guard = MapGuard(self._address, size, owner=mapping)
        return mapping

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if the file changed since its header was read.

        Called once everything read from the file has been reduced, before its
        results are kept: a page read past a new end (the guard's flag), or a
        different size, modification time or inode behind the path.
        """
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.release()
            if guard.changed():
                raise InputError(self.path, CHANGED_SIZE)
        check_path(self.path, self.header.identity)


#: Tensors up to this many elements may travel in a :class:`TensorRun` (as in a bucket).
RUN_MAX_ELEMENTS = 1 << 16
#: Tensors in one run at most: bounds the columns made at once.
RUN_TENSORS = 1 << 15

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
        self.read_ahead = _ReadAhead(mapping, self.data_start, self.table)

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


class _ReadAhead:
    """Asks the kernel to start reading the next large tensor while the current one is reduced.

    On a cold page cache this overlaps disk reads with the reduction; it never
    changes what is read. Small tensors are left to the kernel's own
    read-ahead (a call per tensor would cost more than it saves), and
    platforms without ``madvise`` skip it.
    """

    #: Tensors smaller than this are not worth a system call.
    MIN_BYTES = 1 << 20

    def __init__(self, mapping: mmap.mmap | None, data_start: int, table: TensorTable):
        self._mapping = mapping if hasattr(mmap, "MADV_WILLNEED") else None
        self._data_start = data_start
        lengths = table.ends - table.begins
        #: Index -> data offset of each tensor large enough to be worth the call.
        self._large = {
            int(i): int(table.begins[i]) for i in (lengths >= self.MIN_BYTES).nonzero()[0]
        }
        self._lengths = lengths

    def next_after(self, index: int) -> None:
        if self._mapping is None:
            return
        begin = self._large.get(index + 1)
        if begin is None:
            return
        length = int(self._lengths[index + 1])
        start = self._data_start + begin
        aligned = start - start % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self._mapping.madvise(mmap.MADV_WILLNEED, aligned, length + start - aligned)
