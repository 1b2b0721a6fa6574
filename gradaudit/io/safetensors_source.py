"""Safetensors dumps: our own header check, then zero-copy views of a memory map."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

import torch

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Select, SourceItem
from gradaudit.io.safetensors_header import SafetensorsHeader, describe_os_error, read_header
from gradaudit.results import Skipped
from gradaudit.stats import dtype_skip_reason, hides_values

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

    The data is then read through our own memory map of the file, as zero-copy
    tensor views at the validated offsets: with the header already checked,
    ``safe_open`` would only add its own per-tensor cost (about 10 µs each,
    which dominated a dump of thousands of small tensors). The mapping is
    private (copy-on-write), so nothing can ever write to the file.
    """

    def __init__(self, path: str, header: SafetensorsHeader | None = None) -> None:
        """Validate ``path``; a shard whose header was already validated passes it in."""
        self.path = path
        self.header: SafetensorsHeader = read_header(path) if header is None else header

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        mapping = _map(self.path, self.header.file_size)
        data_start = 8 + self.header.header_length
        read_ahead = _ReadAhead(mapping, data_start, self.header)
        for index, entry in enumerate(self.header.tensors):
            if select is not None and not select(entry.name):
                yield Excluded(entry.name)
                continue
            dtype = TORCH_DTYPES.get(entry.dtype)
            reason = (
                f"dtype {entry.dtype} is not supported by this PyTorch; not audited"
                if dtype is None
                else dtype_skip_reason(dtype)
            )
            if dtype is None or reason is not None:
                unread = (
                    entry.dtype.startswith(_FLOATING_CODES)
                    if dtype is None
                    else hides_values(dtype)
                )
                yield Skipped(entry.name, reason or "not audited", self.path, unread)
                continue
            read_ahead.next_after(index)
            tensor = _view(mapping, data_start + entry.begin, entry.end - entry.begin, dtype)
            yield entry.name, tensor.view(entry.shape)


def _map(path: str, expected_size: int) -> mmap.mmap | None:
    """A private, read-only-in-effect mapping of the whole file (``None`` for an empty one).

    The size is checked again against the validated header: a file replaced or
    truncated in between is refused instead of read past its end.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except OSError as error:
        raise InputError(path, describe_os_error(error)) from None
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise InputError(path, "the file changed while being read (its size is different)")
        # ACCESS_COPY: writable views for torch (no read-only buffer warning), and a
        # write would go to private copies of the pages, never to the file.
        return mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else None
    except (OSError, ValueError) as error:
        raise InputError(path, f"cannot map the file for reading ({error})") from None
    finally:
        os.close(fd)


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

    def __init__(self, mapping: mmap.mmap | None, data_start: int, header: SafetensorsHeader):
        self._mapping = mapping if hasattr(mmap, "MADV_WILLNEED") else None
        self._data_start = data_start
        self._entries = header.tensors

    def next_after(self, index: int) -> None:
        if self._mapping is None or index + 1 >= len(self._entries):
            return
        entry = self._entries[index + 1]
        length = entry.end - entry.begin
        if length < self.MIN_BYTES:
            return
        start = self._data_start + entry.begin
        aligned = start - start % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            self._mapping.madvise(mmap.MADV_WILLNEED, aligned, length + start - aligned)
