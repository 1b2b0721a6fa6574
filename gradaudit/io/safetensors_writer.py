"""Write a safetensors file tensor by tensor, atomically, without the safetensors library.

``safetensors.torch.save_file`` wants every tensor on the host at once (it builds
one bytes object per tensor, then the file). A gradient dump of a large model
on a GPU must not need that much host memory, so this module writes the format
itself: the header first (it needs only names, dtypes and shapes), then each
tensor's bytes, moved to the host in blocks of at most ``chunk_bytes``.

The bytes go to the file in pieces cut at multiples of :data:`WRITE_ALIGNMENT` of the
file (:class:`_AlignedWriter`), so that the page cache holds a fresh dump in 2 MiB folios,
which a scan right after maps with one page-table entry each (docs/performance.md,
"Reading a file").

The file appears under its final name only when complete: it is written to a
temporary file in the same directory, flushed and fsynced, renamed over the
target with ``os.replace`` (atomic on POSIX), and the directory is fsynced so
the rename survives a power cut. A crash leaves the old file or none, never a
truncated one; the temporary file is removed when the write fails.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO

import torch

from gradaudit.io.safetensors_source import TORCH_DTYPES

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SAFETENSORS_NAMES",
    "build_header",
    "layout_order",
    "write_safetensors",
]

#: torch dtype -> safetensors spelling: exactly the dtypes gradaudit's reader maps back.
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}

#: Bytes of one tensor moved to the host at once.
DEFAULT_CHUNK_BYTES = 64 << 20
#: Writes end at multiples of this many bytes of the file (the last one aside): the size
#: of a huge page, the largest folio Linux's page cache makes for a write that covers it.
WRITE_ALIGNMENT = 2 << 20

_METADATA_KEY = "__metadata__"
_ALIGNMENT = 8

#: A tensor to write: its name, and the tensor (or a stand-in ``fetch`` turns into one).
NamedTensor = tuple[str, torch.Tensor]


def layout_order(tensors: Sequence[NamedTensor]) -> list[NamedTensor]:
    """The order tensors are stored in: larger elements first, otherwise as given.

    The data section starts 8-byte aligned; storing 8-byte elements before
    4-, 2- and 1-byte ones keeps every tensor aligned to its element size
    without padding (the format allows no gaps), as the safetensors library does.
    """
    return sorted(tensors, key=lambda item: -item[1].element_size())


def build_header(ordered: Sequence[NamedTensor], metadata: Mapping[str, str] | None) -> bytes:
    """The header bytes for tensors stored in this order, padded to a multiple of 8.

    Validates everything the format requires before any file is touched:
    string names, unique, not ``__metadata__``, encodable as UTF-8; dtypes the
    format knows; strided tensors; string-to-string metadata.
    """
    header: dict[str, object] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"safetensors metadata must map strings to strings; got {key!r}: {value!r}"
                )
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for name, tensor in ordered:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be strings; got {name!r}")
        if name == _METADATA_KEY:
            raise ValueError(f"{_METADATA_KEY!r} is reserved by the format; rename the tensor")
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"tensor name {name!r} is not valid Unicode text") from None
        if tensor.layout is not torch.strided:
            raise TypeError(f"tensor {name!r}: {tensor.layout} tensors cannot be written")
        dtype = SAFETENSORS_NAMES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors spelling")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return text + b" " * (-len(text) % _ALIGNMENT)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[NamedTensor],
    *,
    metadata: Mapping[str, str] | None = None,
    fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Path:
    """Write ``tensors`` to ``path`` atomically; at most ``chunk_bytes`` of a tensor on the host.

    ``fetch``, when given, is called on each tensor just before its bytes are
    written, one tensor at a time, in :func:`layout_order` (used to gather a
    DTensor's shards); it must return a tensor of the same shape and dtype.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors is little-endian; big-endian hosts are unsupported")
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be >= 1")
    target = Path(path)
    ordered = layout_order(tensors)
    header = build_header(ordered, metadata)
    directory = target.parent
    handle, temporary = _create_temporary(directory, target.name)
    try:
        with handle:
            writer = _AlignedWriter(handle.fileno())
            writer.write(struct.pack("<Q", len(header)))
            writer.write(header)
            for name, tensor in ordered:
                data = tensor if fetch is None else fetch(tensor)
                if data.shape != tensor.shape or data.dtype != tensor.dtype:
                    raise RuntimeError(
                        f"tensor {name!r} changed from {tuple(tensor.shape)} {tensor.dtype} to "
                        f"{tuple(data.shape)} {data.dtype} while being written"
                    )
                _write_bytes(writer, data, chunk_bytes)
            writer.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)
    return target


def _create_temporary(directory: Path, name: str) -> tuple[BinaryIO, Path]:
    """A new file next to the target, created exclusively, with the usual permissions.

    ``tempfile.mkstemp`` would make it 0600; ``os.open`` with 0666 lets the
    umask decide, so the dump gets the permissions any other new file would.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_BINARY", 0)
    for _ in range(100):
        temporary = directory / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(temporary, flags, 0o666)
        except FileExistsError:
            continue
        return os.fdopen(fd, "wb"), temporary
    raise FileExistsError(f"could not create a temporary file in {directory}")


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable. Some file systems cannot fsync a directory; that is not an error."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


class _AlignedWriter:
    """Bytes to a file descriptor in writes that end at multiples of :data:`WRITE_ALIGNMENT`.

    Why: Linux sizes the page-cache folios a write creates by the write's length and its
    offset's alignment. Python's buffered file wrote each large piece as it came and small
    ones in 8 KiB lots, after a header of any length: folios of 4 KiB up to a few hundred,
    which a scan right after must map a 4 KiB page at a time (bench_peers' moe-like, 385 MiB
    in 256 KiB tensors: ~4,600 page faults a scan, 2.3x a sum pass; written so, ~210 and
    0.9x). Small pieces are gathered up to the next multiple (at most that many bytes
    held); a large one is written from where it lies, whole multiples at once. The file's
    bytes are the same.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = bytearray()
        #: Bytes written to the file so far (its offset: it was created empty).
        self._written = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        room = WRITE_ALIGNMENT - (self._written + len(self._pending)) % WRITE_ALIGNMENT
        if len(view) < room:
            self._pending += view
            return
        self._pending += view[:room]
        self.flush()
        view = view[room:]
        whole = len(view) - len(view) % WRITE_ALIGNMENT
        self._write_all(view[:whole])
        self._pending += view[whole:]

    def flush(self) -> None:
        """Write what is held (at the end of the file: the last, shorter piece)."""
        self._write_all(memoryview(self._pending))
        self._pending = bytearray()

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            count = os.write(self._fd, view)
            self._written += count
            view = view[count:]


def _write_bytes(handle: _AlignedWriter, tensor: torch.Tensor, chunk_bytes: int) -> None:
    """The tensor's bytes in row-major order, one host block at a time."""
    data = tensor.detach().resolve_conj().resolve_neg()
    if data.numel() == 0:
        return
    step = max(1, chunk_bytes // data.element_size())
    for piece in _blocks(data, step):
        host = piece.to("cpu")
        if host.stride(0) != 1:  # also a 1-element piece of a strided tensor
            host = host.clone(memory_format=torch.contiguous_format)
        handle.write(host.view(torch.uint8).numpy().data)


def _blocks(tensor: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    """1-D pieces of at most ``step`` elements (or one innermost row), in row-major order.

    A contiguous tensor is sliced without copying. A non-contiguous one is cut
    along dim 0 into blocks of whole rows that are made contiguous one at a
    time; a single row larger than ``step`` is cut the same way, recursively.
    """
    if tensor.dim() == 0:
        yield tensor.reshape(1)
        return
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]
        return
    rows = tensor.shape[0]
    row_elements = tensor.numel() // rows
    if row_elements > step and tensor.dim() > 1:
        for index in range(rows):
            yield from _blocks(tensor[index], step)
        return
    per_block = max(1, step // max(row_elements, 1))
    for start in range(0, rows, per_block):
        yield tensor[start : start + per_block].reshape(-1)
