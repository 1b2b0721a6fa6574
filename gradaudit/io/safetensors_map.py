"""A safetensors file's validated header and a guarded, private map of its bytes, without torch.

:class:`~gradaudit.io.safetensors_source.SafetensorsSource` (tensor views, for torch) and
the torch-free scan (:mod:`gradaudit.scan.torch_free`: addresses, for the native kernel)
both read a file through :class:`MappedSafetensors`: one header check, one map made from
the descriptor the header was read from, one SIGBUS guard, one :meth:`check_unchanged`,
and one way of cutting the file into runs of small tensors (:meth:`run_bounds`).
"""

from __future__ import annotations

import array
import contextlib
import itertools
import mmap
import os
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from gradaudit.errors import InputError
from gradaudit.io.files import open_checked
from gradaudit.io.mapguard import CHANGED_SIZE, MapGuard, check_path, same_file
from gradaudit.io.safetensors_header import SafetensorsHeader, read_header_open
from gradaudit.io.safetensors_table import SIZES_BY_CODE, TensorTable

#: safetensors dtype spelling -> torch's name of the dtype (what every output prints).
TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}

#: Tensors up to this many elements may travel in a run (as in a bucket).
RUN_MAX_ELEMENTS = 1 << 16
#: Tensors in one run at most: bounds the columns made at once.
RUN_TENSORS = 1 << 15


class MappedSafetensors:
    """One ``.safetensors`` file: its validated header, then a guarded private map.

    The header is validated from the raw bytes first (duplicate names, offsets,
    sizes, trailing bytes): the safetensors library silently keeps the last of
    two tensors with the same name, which could hide a NaN tensor.

    The data is then read through our own memory map of the same open file. The
    mapping is private (copy-on-write), so nothing can ever write to the file.

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
        #: Address of the map's first byte, once :meth:`map` made it.
        self.address = 0

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

    @property
    def data_start(self) -> int:
        """Offset of the data in the file (after the length and the header)."""
        return 8 + self.header.header_length

    def map(self) -> mmap.mmap | None:
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
        self.address = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
        self._guard = MapGuard(self.address, size, owner=mapping)
        return mapping

    def element_counts(self) -> np.ndarray:
        """Elements of each tensor, in header order (int64)."""
        table = self.header.tensors
        sizes = SIZES_BY_CODE[np.frombuffer(table.codes, dtype=np.uint8)]
        counts: np.ndarray = (table.ends - table.begins) // sizes
        return counts

    def run_bounds(self, runnable: np.ndarray) -> Iterator[tuple[int, int, int]]:
        """How the tensors are read, in file order: ``(first, stop, code)`` per group.

        ``code >= 0``: tensors ``first..stop-1`` form one run of that dtype code
        (consecutive tensors of one dtype for which ``runnable[code]`` holds, each at
        most :data:`RUN_MAX_ELEMENTS` and empty or aligned to its element size; at most
        :data:`RUN_TENSORS` of them). ``code == -1``: each of them on its own.
        """
        table = self.header.tensors
        count = len(table)
        if not count:
            return
        codes = np.frombuffer(table.codes, dtype=np.uint8)
        sizes = SIZES_BY_CODE[codes]
        numel = self.element_counts()
        # An empty tensor reads no byte, so its alignment does not matter: it joins the
        # run (1.75 M empty tensors, the most a header allows, cost a Python call each).
        fits = (
            runnable[codes]
            & (numel <= RUN_MAX_ELEMENTS)
            & ((numel == 0) | ((self.data_start + table.begins) % sizes == 0))
        )
        key = np.where(fits, codes.astype(np.int64), -1)
        edges = [0, *(np.flatnonzero(np.diff(key)) + 1).tolist(), count]
        for first, stop in itertools.pairwise(edges):
            code = int(key[first])
            if code < 0:
                yield first, stop, -1
                continue
            for start in range(first, stop, RUN_TENSORS):
                yield start, min(stop, start + RUN_TENSORS), code

    def run_columns(
        self, start: int, end: int, numel: np.ndarray
    ) -> tuple[array.array[int], array.array[int], array.array[int], array.array[int]]:
        """The kernel's and the results' columns of tensors ``start..end-1`` of a run:
        addresses and element counts (uint64), ranks and dimensions (int64)."""
        table = self.header.tensors
        base = self.address + self.data_start
        pointers = array.array("Q")
        pointers.frombytes((table.begins[start:end] + base).astype(np.uint64).tobytes())
        counts = array.array("Q")
        counts.frombytes(numel[start:end].astype(np.uint64).tobytes())
        first_dim, end_dim = int(table.starts[start]), int(table.starts[end])
        ranks = array.array("q")
        ranks.frombytes(np.diff(table.starts[start : end + 1]).astype(np.int64).tobytes())
        dims = array.array("q")
        dims.frombytes(table.dims[first_dim:end_dim].astype(np.int64).tobytes())
        return pointers, counts, ranks, dims

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


class ReadAhead:
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
