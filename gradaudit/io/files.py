"""File helpers every reader shares: refuse what is not a regular file, open without
blocking, describe an OS error in one line, quote a name from a file for a message.

Every reader must refuse the same inputs the same way (a FIFO would block forever, a
device node can have side effects on open), so these live here once; they were part of
the safetensors validator, which was the first reader to need them.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO

from gradaudit.errors import InputError

#: How many characters of a name from a file a message shows.
SHOW_LIMIT = 60


@dataclass(frozen=True)
class FileIdentity:
    """Which file, in which state: compared before a file's results are kept.

    Device and inode say the path still names the file that was validated (an
    ``os.replace`` swaps the inode); size and modification time say it was not
    rewritten in place.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def show(text: str, limit: int = SHOW_LIMIT) -> str:
    """Quote a string from the file for a one-line message, cut at ``limit`` characters.

    Names come from a possibly hostile file: a megabyte-long name must not make a
    megabyte-long message. Control characters and bidi overrides are left as they
    are: the message is data (JSON carries the exact name), and every renderer
    escapes it once, at render time, with :func:`gradaudit.report.text.printable`.
    Escaping here as well showed ``bad\\\\x1bname`` on stderr.
    """
    shown = text[:limit]
    return f'"{shown}..."' if len(text) > limit else f'"{shown}"'


def describe_os_error(error: OSError) -> str:
    """One plain-English line for an OSError, without paths or tracebacks."""
    known = {
        errno.ENOENT: "no such file",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ELOOP: "symlink loop (too many levels of symbolic links)",
        errno.EISDIR: "is a directory",
        errno.ENOTDIR: "a component of the path is not a directory",
        errno.ENAMETOOLONG: "file name too long",
        errno.EIO: "I/O error while reading",
    }
    if error.errno in known:
        return known[error.errno]
    reason = (error.strerror or type(error).__name__).strip().splitlines()
    return reason[0].lower() if reason else "cannot read the file"


def _file_type(mode: int) -> str | None:
    """Name a non-regular file type for the message, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown file type"


def check_regular_file(path: str | os.PathLike[str]) -> os.stat_result:
    """Check with ``lstat``/``stat`` only that ``path`` is a non-empty, readable regular file.

    Nothing is opened: opening a FIFO blocks until a writer appears and opening a device
    can have side effects, so the file type is settled from metadata first. Shared with the
    other readers (PyTorch pickles), which must refuse the same inputs.

    Returns the ``stat`` result of the target (symlinks followed). Raises
    :class:`InputError` for a missing file, a dangling symlink, a symlink loop, a
    directory, a FIFO, socket or device, a file that cannot be read, or an empty file.
    """
    path = os.fspath(path)
    try:
        info = os.lstat(path)
    except OSError as error:
        raise InputError(path, describe_os_error(error)) from None
    except ValueError:  # an embedded NUL: no file can have that name
        raise InputError(path, "invalid path (it contains a NUL byte)") from None
    if stat.S_ISLNK(info.st_mode):
        try:
            info = os.stat(path)
        except FileNotFoundError:
            try:
                target = f" (its target {show(os.readlink(path), limit=400)} does not exist)"
            except (OSError, ValueError):
                target = ""
            raise InputError(path, f"dangling symlink{target}") from None
        except OSError as error:
            raise InputError(path, describe_os_error(error)) from None
    kind = _file_type(info.st_mode)
    if kind == "directory":
        raise InputError(path, "is a directory, not a file")
    if kind is not None:
        raise InputError(path, f"not a regular file ({kind})")
    if not os.access(path, os.R_OK):
        raise InputError(path, "permission denied")
    if info.st_size == 0:
        raise InputError(path, "empty file (0 bytes)")
    return info


def open_checked(path: str) -> tuple[BinaryIO, int]:
    """Open a file that :func:`check_regular_file` accepted; return it and its size.

    ``O_NONBLOCK`` and the ``fstat`` re-check close the race in which the path is swapped
    for a FIFO between the ``stat`` and the ``open``: the open cannot block and the
    descriptor, not the path, is what gets read. The size comes from the descriptor too.
    """
    path = os.fspath(path)
    check_regular_file(path)
    flags = os.O_RDONLY
    for name in ("O_NONBLOCK", "O_NOCTTY", "O_CLOEXEC", "O_BINARY"):
        flags |= getattr(os, name, 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        raise InputError(path, describe_os_error(error)) from None
    try:
        info = os.fstat(fd)
        kind = _file_type(info.st_mode)
        if kind is not None:
            raise InputError(path, f"not a regular file ({kind}); it changed while being opened")
        return os.fdopen(fd, "rb"), info.st_size
    except InputError:
        os.close(fd)
        raise
    except OSError as error:
        os.close(fd)
        raise InputError(path, describe_os_error(error)) from None


def read_at(path: str, offset: int, count: int) -> bytes:
    """Up to ``count`` bytes of ``path`` from ``offset``; an OS error is the input's."""
    handle, _ = open_checked(path)
    with handle:
        try:
            handle.seek(offset)
            return handle.read(count)
        except OSError as error:
            raise InputError(path, describe_os_error(error)) from None


class FileRange(io.RawIOBase):
    """A read-only, seekable window ``[start, start + length)`` of an open file.

    A DCP ``.distcp`` file holds one ``torch.save`` archive per chunk at a byte
    offset: zipfile and ``torch.load`` each see one archive through this window,
    as they would a file of its own.
    """

    def __init__(self, handle: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._handle: Any = handle  # a buffered file: it has readinto
        self._start, self._length, self._pos = start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self._length - self._pos))
        if not count:
            return 0
        self._handle.seek(self._start + self._pos)
        got = self._handle.readinto(view[:count])
        self._pos += got or 0
        return got or 0


def plain_number(value: object) -> float | None:
    """``value`` as a float when a file stores a plain number there, else ``None``: a
    ``bool`` is no number, and an integer too large for a float (``10**400``) is none
    either, rather than an OverflowError that would end the run."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None
