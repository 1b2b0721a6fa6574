"""stdout and stderr that may be closed, full or gone: every write failure is noted, none raises.

A CI job reads gradaudit's exit code. When the report or a message could not be
written (``>&-``, ``> /dev/full``, ``2>/dev/full``, a disk that filled up) the
code must say so, and must never be 1, which CI reads as "findings", nor 4, a
bug. So the console entry point (:func:`gradaudit.cli.run`) wraps both streams
in :class:`GuardedStream` before anything is written: a failed write or flush
is recorded, the stream is pointed at ``/dev/null`` so nothing else (Click's own
messages, the interpreter's final flush) fails again, and the run ends with
:attr:`~gradaudit.errors.ExitCode.OUTPUT_ERROR`.

A reader that went away (``gradaudit scan … | head``: a broken pipe) is not a
failure: whatever it did not read, it did not want, and the exit code stays the
verdict.

File descriptors 0–2 that were closed when the process started are opened on
``/dev/null`` first; otherwise the first file gradaudit opens (an input, the
``--output`` temporary file) would get descriptor 1 or 2, and anything writing
to "stdout" at the C level would write into it.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import TextIO

#: Streams that failed, by name ("stdout", "stderr"), with the cause; cleared per run.
_failures: dict[str, str] = {}


class GuardedStream(io.TextIOBase):
    """A text stream around ``sys.stdout`` or ``sys.stderr`` (or ``None``: closed at start)."""

    def __init__(self, name: str, stream: TextIO | None) -> None:
        super().__init__()
        self.name = name
        self._stream = stream
        self._silenced = False

    # Click and Rich look at these to decide how to write; a closed stream is plain UTF-8.
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "errors", None) or "strict"

    def writable(self) -> bool:
        return True

    @property
    def silenced(self) -> bool:
        """Whether writes now go nowhere: the reader left (``| head``) or the stream failed.

        A writer of many chunks stops rendering then, instead of rendering the rest of a
        million-tensor report into ``/dev/null``.
        """
        return self._silenced

    def isatty(self) -> bool:
        if self._stream is None or self._silenced:
            return False
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        if self._stream is None:
            raise io.UnsupportedOperation(f"{self.name} is closed")
        return self._stream.fileno()

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # Click probes with b"" for a binary stream
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if self._silenced or not text:
            return len(text)
        if self._stream is None:
            self._fail(OSError(errno.EBADF, "it is closed"))
            return len(text)
        try:
            self._stream.write(text)
            if self.name == "stderr":  # messages for people go out at once
                self._stream.flush()
        except OSError as error:
            self._fail(error)
        return len(text)

    def flush(self) -> None:
        if self._silenced or self._stream is None:
            return
        try:
            self._stream.flush()
        except OSError as error:
            self._fail(error)

    def _fail(self, error: OSError) -> None:
        """Note the failure (a broken pipe excepted) and send everything after it nowhere."""
        self._silenced = True
        if not isinstance(error, BrokenPipeError):
            _failures.setdefault(self.name, error.strerror or str(error))
        if self._stream is None:
            return
        # The wrapped stream may still hold unwritten text; pointed at /dev/null, its
        # final flush at exit succeeds instead of failing (or being reported) again.
        try:
            descriptor = self._stream.fileno()
        except (OSError, ValueError):
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, descriptor)
        except OSError:
            pass
        finally:
            os.close(devnull)


def guard() -> None:
    """Install :class:`GuardedStream` on ``sys.stdout``/``sys.stderr``; once per process run."""
    _failures.clear()
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != descriptor:
                os.dup2(opened, descriptor)
                os.close(opened)
    if not isinstance(sys.stdout, GuardedStream):
        sys.stdout = GuardedStream("stdout", sys.stdout)
    if not isinstance(sys.stderr, GuardedStream):
        sys.stderr = GuardedStream("stderr", sys.stderr)


def failures() -> dict[str, str]:
    """The streams that failed in this run (flushing both first), with the cause."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, GuardedStream):
            stream.flush()
    return dict(_failures)


def note(name: str, cause: str) -> None:
    """Record a failure seen elsewhere (an exception that escaped a writer)."""
    _failures.setdefault(name, cause)
