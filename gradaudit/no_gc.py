"""One context manager: the cyclic garbage collector paused while many acyclic objects are built.

A million-entry header or a 100,000-tensor report makes millions of containers
(entries, host rows, ``TensorStats``) that form no cycle; every generation-2
collection set off meanwhile walks all of them again, and the caller's tensors
too. Measured: half of ``materialize`` on 100,000 tensors (400 ms -> 210 ms), and
several times the parse of a million-entry safetensors header.
"""

from __future__ import annotations

import gc
from types import TracebackType


class _PausedGc:
    """The context manager :func:`paused_gc` returns: a class rather than a
    ``@contextmanager`` generator, which cost ~1 us per block where a report enters
    several blocks on every step of a training loop (issue 28 item 9)."""

    __slots__ = ("_enabled",)

    def __enter__(self) -> None:
        self._enabled = gc.isenabled()
        gc.disable()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._enabled:
            gc.enable()


def paused_gc() -> _PausedGc:
    """No cyclic collection inside the block; the collector's previous state after it."""
    return _PausedGc()
