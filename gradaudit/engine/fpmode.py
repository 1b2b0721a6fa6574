"""The calling thread's floating-point mode: gradaudit computes in IEEE mode, whatever the host set.

x86 threads can flush subnormals to zero (MXCSR's FTZ and DAZ bits). A library built with
``-ffast-math`` turns that on when it is loaded - torch 2.4's inductor CPU kernels do - and
from then on every subnormal reads as 0 in that thread: a gradient of 1e-310 would report
max |x| 0 and norm 0. The native kernel guards its own threads in C; :func:`ieee_mode`
guards the host-side arithmetic (the rows' norms, the report's numpy work) and puts the
host's mode back afterwards.
"""

from __future__ import annotations

from types import TracebackType

import torch

__all__ = ["ieee_mode", "subnormals_survive"]

# Module globals, so the product below is computed at run time, in the calling thread's
# floating-point mode, never folded by the compiler.
_SMALLEST_SUBNORMAL = 5e-324
_ONE = 1.0


def subnormals_survive() -> bool:
    """False while the calling thread flushes subnormals to zero (x86's FTZ/DAZ)."""
    return _SMALLEST_SUBNORMAL * _ONE != 0.0


class _IeeeMode:
    """The context manager :func:`ieee_mode` returns (a class: a ``@contextmanager``
    generator cost ~1 us per block, on every step of a training loop's monitor)."""

    __slots__ = ("_flushing",)

    def __enter__(self) -> None:
        self._flushing = not subnormals_survive()
        if self._flushing:
            torch.set_flush_denormal(False)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._flushing:
            torch.set_flush_denormal(True)


def ieee_mode() -> _IeeeMode:
    """IEEE mode inside, the host's mode back after; ~0.1 µs when the host is in IEEE mode."""
    return _IeeeMode()
