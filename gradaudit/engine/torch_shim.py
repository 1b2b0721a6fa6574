"""A list of tensors' facts read in C through torch's C shim, with no Python per tensor.

A training loop's planned flush (:mod:`~gradaudit.engine.triton_plan`) must check every
step that each gradient still has the plan's dtype, shape and device and is contiguous,
and read its address. Through torch's Python binding that is five calls a tensor, 0.3-0.7
µs: 3-7 ms a step for 10,000 gradients, more than the kernels take to read them. torch
answers the same questions in C: the ``aoti_torch_*`` functions AOTInductor's compiled
models call (``extern "C"``, exported by libtorch for code built against another
version), given an ``at::Tensor *``. The native extension calls them; this module hands it
their addresses (``ctypes``, so the extension needs no torch headers) and where a tensor's
``at::Tensor`` lives in its Python object.

That place is torch's private layout: right after the object's header in the torch
versions where ``THPVariable`` holds an ``at::Tensor`` (2.13, the pinned one, does; older
ones held a ``MaybeOwned`` there). So nothing is bound until it is checked: the word
after the header must be the tensor's ``TensorImpl`` address (``Tensor._cdata``) on
probe tensors, and the shim's answers through it must be torch's own (dtype, device,
layout, shape, contiguity, address) on probes of every kind the loops meet, sparse
included. Anything else, and :func:`bound` is ``False``: callers take the binding's path,
as without the native build.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gradaudit.engine import native_rows

#: The shim's functions the native loops call, in the order ``bind_shim`` takes them.
FUNCTIONS = (
    "aoti_torch_get_data_ptr",
    "aoti_torch_get_dim",
    "aoti_torch_get_sizes",
    "aoti_torch_get_dtype",
    "aoti_torch_get_device_type",
    "aoti_torch_get_device_index",
    "aoti_torch_get_layout",
    "aoti_torch_is_contiguous",
)

#: Exact types whose instances are plain tensors (a subclass such as DTensor may not be).
PLAIN = (torch.Tensor, torch.nn.Parameter)


def _probes() -> list[torch.Tensor]:
    """Tensors of the kinds a list can hold: dtypes, ranks (7: past the 5 sizes torch keeps
    inline), views, a transpose, a Parameter, empty ones, one on the current CUDA device
    where CUDA is in use, and a sparse one (which the shim must decline)."""
    in_use = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = [torch.zeros(2, 3, device="cuda")[:, 1:]] if in_use else []
    return [
        *cuda,
        torch.arange(15.0).reshape(3, 5),
        torch.zeros(2, 1, 3, 1, 2, 1, 2),
        torch.zeros(9, dtype=torch.bfloat16)[2:],
        torch.zeros(4, 6, dtype=torch.float64).t(),
        torch.tensor(2.0, dtype=torch.float16),
        torch.nn.Parameter(torch.zeros(2, 3, 4, dtype=torch.float16)),
        torch.empty(0, 3),
        torch.zeros(7, 1, 5)[:, :, 1:4],
        torch.zeros(2, 2).to_sparse(),
    ]


def _word_after_header(tensor: torch.Tensor) -> int | None:
    """The pointer-sized word right after ``tensor``'s Python object header."""
    value: int | None = ctypes.c_void_p.from_address(id(tensor) + object.__basicsize__).value
    return value


def _answers_as_torch(module: Any, library: ctypes.CDLL, strided: int) -> bool:
    """Whether the bound shim gives torch's own facts of every probe."""
    codes = {}
    for name in ("float32", "bfloat16", "float16", "float64"):
        function = getattr(library, f"aoti_torch_dtype_{name}")
        function.restype = ctypes.c_int32
        codes[getattr(torch, name)] = function()
    device_types = {}
    for name in ("cpu", "cuda"):
        function = getattr(library, f"aoti_torch_device_type_{name}")
        function.restype = ctypes.c_int32
        device_types[name] = function()
    for probe in _probes():
        facts = module.shim_facts(probe)
        if probe.layout != torch.strided:
            if facts is not None:
                return False
            continue
        expected = (
            codes[probe.dtype],
            device_types[probe.device.type],
            probe.get_device(),
            strided,
            probe.is_contiguous(),
            tuple(probe.shape),
            probe.data_ptr(),
        )
        if facts != expected:
            return False
    return True


_binding = threading.Lock()


@functools.cache
def bound() -> bool:
    """Whether the native loops read tensors' facts through the shim (bound and checked on
    the first call, see the module doc). One thread binds and checks; another asking
    meanwhile waits for its answer rather than use a binding not yet checked."""
    with _binding:
        return _bind()


def _bind() -> bool:
    module = native_rows.module()
    if module is None or not hasattr(module, "bind_shim"):
        return False
    try:
        library = ctypes.CDLL(torch._C.__file__)
        addresses = [
            ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in FUNCTIONS
        ]
        layout_strided = library.aoti_torch_layout_strided
        layout_strided.restype = ctypes.c_int32
        strided = int(layout_strided())
        probes = [torch.zeros(3), torch.nn.Parameter(torch.ones(2, 2)), torch.empty(0)]
        # The at::Tensor must be where this module expects it before the shim is given it.
        if all(_word_after_header(probe) == probe._cdata for probe in probes):
            module.bind_shim(object.__basicsize__, strided, *addresses)
            if _answers_as_torch(module, library, strided):
                return True
    except (OSError, AttributeError, TypeError, ValueError):
        pass
    module.bind_shim(0, 0, *[0] * len(FUNCTIONS))  # a binding of an earlier check undone
    return False


def signature(tensors: Sequence[torch.Tensor]) -> bytes | None:
    """What :func:`pointers` checks a later list against (each tensor's dtype, device and
    shape), or ``None`` when the shim is not bound or a tensor is not plain, contiguous
    and strided."""
    if not bound():
        return None
    module = native_rows.module()
    assert module is not None
    found: bytes | None = module.shim_signature(list(tensors), PLAIN)
    return found


def pointers(tensors: Sequence[torch.Tensor], expected: bytes) -> np.ndarray | None:
    """The addresses of ``tensors`` (int64, in list order) when the list has the
    ``expected`` :func:`signature` and each is of a plain type and contiguous, else
    ``None``. One C loop, no Python per tensor."""
    module = native_rows.module()
    assert module is not None
    assert bound()
    found: bytes | None = module.shim_pointers(
        tensors if isinstance(tensors, list) else list(tensors), PLAIN, expected
    )
    return None if found is None else np.frombuffer(found, dtype=np.int64)


def code_table(codes: Mapping[torch.dtype, int]) -> bytes | None:
    """For ``tensor_facts`` through the shim: the native kernel's code of each torch scalar
    type (int32, indexed by the shim's dtype number; -1 where ``codes`` has none); ``None``
    when the shim is not bound."""
    return _code_table(tuple(codes.items()))


@functools.cache
def _code_table(codes: tuple[tuple[torch.dtype, int], ...]) -> bytes | None:
    module = native_rows.module()
    if module is None or not bound():
        return None
    numbers = {}
    for dtype, code in codes:
        facts = module.shim_facts(torch.empty(0, dtype=dtype))
        if facts is None:
            return None
        numbers[facts[0]] = code
    table = np.full(max(numbers, default=-1) + 1, -1, dtype=np.int32)
    for number, code in numbers.items():
        table[number] = code
    return table.tobytes()


def device_numbers(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``tensor``'s device as the shim numbers it (device type, index: the CPU's is -1), or
    ``None`` when the shim is not bound or has no facts of ``tensor``."""
    module = native_rows.module()
    if module is None or not bound() or type(tensor) not in PLAIN:
        return None
    facts = module.shim_facts(tensor)
    return None if facts is None else (int(facts[1]), int(facts[2]))
