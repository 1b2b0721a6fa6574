"""A memory-mapped input that shrinks while it is read becomes an input error, not a SIGBUS.

Readers map their files (zero copies); when a file is truncated under a map, a read of
a page past its new end raises SIGBUS, whose default action kills the process without
a word. The C helper ``gradaudit.io._mapguard`` installs a SIGBUS handler that, for an
address inside a range registered here, maps zero pages over the rest of that range and
sets the range's flag, so every reader (the native kernel's threads, torch's, zlib's)
simply carries on. :meth:`MapGuard.changed` is asked before the file's results are
kept; the zeros are never reported. Every registration re-installs the handler if the
host replaced it since (a long-lived process may install its own after the first scan),
chaining to the one it found.

Without the helper (no C compiler at install time, or a platform without ``mmap``
semantics like Linux's) a guard is inert and a truncation still kills the process, as
it would in any program that maps files; docs/inputs.md says so.
"""

from __future__ import annotations

import os
import weakref
from types import ModuleType

from gradaudit.errors import InputError
from gradaudit.io.files import FileIdentity

#: The causes a reader gives for a file that changed while it was read.
CHANGED_SIZE = (
    "the file changed size while being read (truncated or rewritten during the scan); "
    "nothing from it is reported"
)
CHANGED = (
    "the file changed while being read (modified or replaced during the scan); "
    "nothing from it is reported"
)


def _load() -> ModuleType | None:
    try:
        from gradaudit.io import _mapguard  # type: ignore[attr-defined]  # optional build
    except ImportError:
        return None
    module: ModuleType = _mapguard
    return module


_module = _load()


def available() -> bool:
    """Whether truncated maps are survived (the helper was built and loads)."""
    return _module is not None


class MapGuard:
    """Guards the pages of one mapped range until :meth:`release` (or ``owner`` is freed).

    ``owner`` is the object whose lifetime is the mapping's (the ``mmap``, or the
    source holding it): the range is released when it is collected, so a range is never
    left registered for memory that has been unmapped and reused.
    """

    def __init__(self, address: int, length: int, owner: object | None = None) -> None:
        self._slot: int | None = None
        self._faulted = False
        self._finalizer: weakref.finalize[..., object] | None = None
        if _module is not None and address and length:
            self._slot = _module.register(address, length)
            if owner is not None:
                # Runs at most once, whichever comes first: release() or owner freed.
                self._finalizer = weakref.finalize(owner, _module.unregister, self._slot)

    def changed(self) -> bool:
        """Whether a page of the range was read past the end of the file (it shrank)."""
        if self._slot is not None and _module is not None:
            self._faulted = self._faulted or bool(_module.faulted(self._slot))
        return self._faulted

    def release(self) -> None:
        """Stop guarding (the answer of :meth:`changed` is kept)."""
        if self._slot is not None and _module is not None:
            self.changed()
            if self._finalizer is not None:
                self._finalizer()
            else:
                _module.unregister(self._slot)
            self._slot = None


def same_file(path: str, identity: FileIdentity | None, info: os.stat_result) -> None:
    """Raise :class:`InputError` unless ``info`` describes the file ``identity`` was taken of."""
    if identity is None:
        return
    now = FileIdentity.of(info)
    if now.size != identity.size:
        raise InputError(path, CHANGED_SIZE)
    if now != identity:
        raise InputError(path, CHANGED)


def check_path(path: str, identity: FileIdentity | None) -> None:
    """:func:`same_file` for what ``path`` names now (a vanished file has changed too)."""
    try:
        info = os.stat(path)
    except OSError:
        raise InputError(path, CHANGED) from None
    same_file(path, identity, info)


def release_and_check(path: str, guard: MapGuard | None, identity: FileIdentity | None) -> None:
    """End a guarded read of ``path``: release its guard, then raise :class:`InputError`
    if a page was read past a new end (the guard's flag) or the file behind the path is
    no longer the one that was checked (size, modification time, inode)."""
    if guard is not None:
        guard.release()
        if guard.changed():
            raise InputError(path, CHANGED_SIZE)
    check_path(path, identity)
