"""Safetensors dumps, read lazily through ``safe_open`` after our own header check."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Select, SourceItem
from gradaudit.io.safetensors_header import SafetensorsHeader, read_header
from gradaudit.results import Skipped
from gradaudit.stats import dtype_skip_reason

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
}


class SafetensorsSource:
    """One ``.safetensors`` file.

    The header is validated from the raw bytes first (duplicate names, offsets,
    sizes, trailing bytes): the safetensors library silently keeps the last of
    two tensors with the same name, which could hide a NaN tensor.
    """

    def __init__(self, path: str, header: SafetensorsHeader | None = None) -> None:
        """Validate ``path``; a shard whose header was already validated passes it in."""
        self.path = path
        self.header: SafetensorsHeader = read_header(path) if header is None else header

    def items(self, device: torch.device, select: Select | None = None) -> Iterator[SourceItem]:
        try:
            with (
                safe_open(self.path, framework="pt", device=str(device)) as handle,
                _ReadAhead(self.path, self.header) as read_ahead,
            ):
                for index, entry in enumerate(self.header.tensors):
                    if select is not None and not select(entry.name):
                        yield Excluded(entry.name)
                        continue
                    read_ahead.next_after(index)
                    dtype = TORCH_DTYPES.get(entry.dtype)
                    reason = (
                        f"dtype {entry.dtype} is not supported by this PyTorch; not audited"
                        if dtype is None
                        else dtype_skip_reason(dtype)
                    )
                    if reason is not None:
                        yield Skipped(entry.name, reason, self.path)
                        continue
                    yield entry.name, handle.get_tensor(entry.name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as error:
            raise InputError(self.path, f"cannot read safetensors data: {error}") from None


class _ReadAhead:
    """Asks the kernel to start reading the next tensor while the current one is reduced.

    On a cold page cache this overlaps disk reads with the reduction, for one
    ``posix_fadvise`` call per tensor; it never changes what is read, and
    platforms without ``posix_fadvise`` skip it.
    """

    def __init__(self, path: str, header: SafetensorsHeader) -> None:
        self._path = path
        self._entries = header.tensors
        self._data_start = 8 + header.header_length
        self._fd: int | None = None

    def __enter__(self) -> _ReadAhead:
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def next_after(self, index: int) -> None:
        if self._fd is None or index + 1 >= len(self._entries):
            return
        entry = self._entries[index + 1]
        with contextlib.suppress(OSError):
            os.posix_fadvise(
                self._fd,
                self._data_start + entry.begin,
                entry.end - entry.begin,
                os.POSIX_FADV_WILLNEED,
            )
