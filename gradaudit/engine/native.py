"""The single-pass CPU kernel (``gradaudit/engine/_native.c``), when it was built.

It reads each element once and writes the engine's stats row straight into a
float64 tensor, for contiguous CPU tensors of every audited dtype (float32,
float64, float16, bfloat16, fp8 e4m3fn and e5m2). Other devices and a missing
build go to the eager kernel, which computes the same row.

The extension is optional: ``pip install`` builds it when a C compiler is
there and carries on without it otherwise. :func:`available` says which.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from gradaudit.engine import native_rows, torch_shim

_module = native_rows.module()

_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): code for name, code in native_rows.codes_by_name().items()
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
#: A CPU tensor, for the C shim's number of the CPU device.
_CPU_PROBE = torch.empty(0)


def available() -> bool:
    """Whether the extension was built and loads (asked of :mod:`~gradaudit.engine.native_rows`,
    which the torch-free scan asks too)."""
    return native_rows.available()


def supports(tensor: torch.Tensor) -> bool:
    """Whether the native kernel reduces ``tensor`` once it is contiguous."""
    return _module is not None and tensor.is_cpu and tensor.dtype in _CODES


def handles(tensor: torch.Tensor) -> bool:
    """Whether the native kernel takes ``tensor`` as it is (no copy, no fallback)."""
    return supports(tensor) and tensor.is_contiguous()


def tensor_row(tensor: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """Write the stats row of ``tensor`` (see :func:`handles`) into ``out``: 7 float64."""
    if _module is None or not handles(tensor):
        raise ValueError("the native kernel takes contiguous CPU tensors of the audited dtypes")
    if out.dtype != torch.float64 or not out.is_contiguous() or out.numel() != 7:
        raise ValueError("the row must be 7 contiguous float64")
    _module.stats(tensor.data_ptr(), tensor.numel(), _CODES[tensor.dtype], out.data_ptr(), threads)


def batch_rows(tensors: Sequence[torch.Tensor], threads: int) -> torch.Tensor:
    """Stats rows ``[len(tensors), 7]`` of small tensors, all computed in one native call.

    One call for many tensors is what makes thousands of tiny parameters cheap:
    the per-tensor cost is a few attribute reads in Python, not an op dispatch.
    """
    if _module is None or not all(handles(t) for t in tensors):
        raise ValueError("the native kernel takes contiguous CPU tensors of the audited dtypes")
    pointers = array.array("Q", [t.data_ptr() for t in tensors])
    counts = array.array("Q", [t.numel() for t in tensors])
    codes = array.array("i", [_CODES[t.dtype] for t in tensors])
    return rows_of_pointers(pointers, counts, codes, threads)


def code(dtype: torch.dtype) -> int:
    """The extension's code for a dtype it takes (see :func:`supports`)."""
    return _CODES[dtype]


def codes() -> Mapping[torch.dtype, int]:
    """Every dtype the extension takes, with its code; empty when it is not built.

    For the collector's per-tensor path: one dictionary lookup answers both
    "does native take this dtype" and "with which code".
    """
    return MappingProxyType(_CODES)


def rows_of_pointers(
    pointers: array.array[int], counts: array.array[int], codes: array.array[int], threads: int
) -> torch.Tensor:
    """Stats rows of tensors given by address, element count and :func:`code`.

    For the collector, which checked :func:`handles` when each tensor came in
    and keeps the tensors alive until this returns; everyone else should call
    :func:`batch_rows`, which checks.
    """
    return torch.from_numpy(native_rows.rows_of_pointers(pointers, counts, codes, threads))


def tensor_facts(
    tensors: list[torch.Tensor], codes: Mapping[torch.dtype, int], plain: tuple[type, ...]
) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes, int]:
    """The kernel's columns for a list of in-memory tensors, read in one pass.

    ``(ok, pointers, counts, codes, ranks, dims, nbytes)``: ``ok`` holds 1 for each
    tensor the kernel reads as it is (of an exact type in ``plain``, a dtype in
    ``codes``, on the CPU, contiguous, strided) and 0 for the others, whose other
    columns hold nothing (rank 0); pointers and counts are uint64, codes int32,
    ranks int64, dims the ok tensors' shapes back to back (int64); ``nbytes`` the ok
    tensors' bytes in all. See :mod:`gradaudit.engine.bulk`.
    """
    if _module is None:
        raise ValueError("the native kernel is not built")
    # Through torch's C shim where it is bound (no Python per tensor: 5,000 tiny tensors'
    # facts in 0.6 instead of 2.4 ms, 100,000 in 6.5 instead of 49), else through the binding.
    shim = torch_shim.code_table(codes)
    cpu = None if shim is None else torch_shim.device_numbers(_CPU_PROBE)
    facts: tuple[bytes, bytes, bytes, bytes, bytes, bytes, int] = (
        _module.tensor_facts(tensors, dict(codes), plain)
        if shim is None or cpu is None
        else _module.tensor_facts(tensors, {}, plain, shim, *cpu)
    )
    return facts


def device_columns(
    tensors: list[torch.Tensor], plain: tuple[type, ...]
) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes, int] | None:
    """:func:`tensor_facts` of a list on the first tensor's device (any device: ``ok`` is 0
    for a tensor elsewhere), with every dtype the extension has a code for; through torch's
    C shim only, ``None`` where it is not bound. For planning a flush on a GPU from one C
    pass (:mod:`~gradaudit.engine.triton_plan`)."""
    if _module is None or not tensors:
        return None
    shim = torch_shim.code_table(_CODES)
    where = None if shim is None else torch_shim.device_numbers(tensors[0])
    if shim is None or where is None:
        return None
    facts: tuple[bytes, bytes, bytes, bytes, bytes, bytes, int] = _module.tensor_facts(
        tensors, {}, plain, shim, *where
    )
    return facts


def dtype_of(code: int) -> torch.dtype:
    """The dtype of an extension's code (see :func:`code`)."""
    return _DTYPES[code]


def planned_pointers(
    tensors: list[torch.Tensor],
    plain: tuple[type, ...],
    dtypes: list[torch.dtype],
    shapes: list[torch.Size],
    devices: list[int],
) -> bytes | None:
    """Every tensor's address (int64, native order), when each is of an exact type in
    ``plain`` and has ``dtypes[i]``, ``shapes[i]``, device index ``devices[i]`` and is
    contiguous; ``None`` at the first that differs. One pass over the list, through torch's
    own accessors (see :mod:`gradaudit.engine.triton_plan`)."""
    if _module is None:
        raise ValueError("the native kernel is not built")
    found: bytes | None = _module.planned_pointers(
        tensors,
        plain,
        dtypes,
        shapes,
        devices,
        torch.Tensor.get_device,
        torch.Tensor.is_contiguous,
        torch.Tensor.data_ptr,
    )
    return found


#: The extension's code paths, narrowest first (see :func:`paths`).
PATHS = ("portable", "avx2", "avx512")


def set_path(name: str) -> str:
    """Choose the extension's code path (one of :func:`paths`); returns the previous one.

    The widest path the CPU has is chosen at import. For tests, which check every path
    against the same reference, and benchmarks, which time each one.
    """
    if _module is None:
        raise ValueError("the native kernel is not built")
    previous: str = _module.set_path(name)
    return previous


def path() -> str:
    """The extension's code path in use: ``"avx512"``, ``"avx2"`` or ``"portable"``."""
    if _module is None:
        raise ValueError("the native kernel is not built")
    name: str = _module.path()
    return name


def paths() -> tuple[str, ...]:
    """The code paths this build runs on this CPU, narrowest first: ``"portable"`` always,
    then ``"avx2"`` and ``"avx512"`` where the CPU has them; empty when it is not built."""
    if _module is None:
        return ()
    names: tuple[str, ...] = _module.paths()
    return names
