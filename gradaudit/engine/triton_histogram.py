"""The exponent histogram of a float32, bfloat16 or float16 tensor by one Triton launch.

``scan --precision`` and a monitor's ``precision=`` count each tensor's exponent histogram
(:func:`gradaudit.precision.layout`'s bins). The native kernel counts it in the same read
as the stats row on the CPU; every other tensor had the torch path
(:func:`gradaudit.engine.histogram.exponent_histogram`): a handful of torch ops per chunk of
4 M elements, the last an ``index_add_`` of ones into ~300 addresses, which on a GPU is
every element's atomic addition to a few of them, 15-130x a sum pass. Where the Triton
route takes the tensor, one launch counts it instead (``_triton_histogram.py``): each
program counts its blocks in a local histogram and adds it to the tensor's counts once.

The same bins as the torch path, bit for bit (the tests compare them through Triton's
interpreter): a 16-bit float's from the torch path's own table of every magnitude
pattern's bin, a float32's by a binary search of the same sorted boundary bits that
``torch.bucketize`` searches. float64 and fp8 keep the torch path.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch

from gradaudit.engine import histogram, triton_kernel
from gradaudit.precision.formats import layout

#: Bins a program counts: the layout's (293) and a padding bin for the lanes past the end,
#: rounded up to a power of two (``tl.histogram``'s and ``tl.arange``'s rule).
PADDED_BINS = 512
#: Elements a program bins at once.
BLOCK = 1024
#: Programs per SM: enough to hide a load's latency; each adds its counts once.
PROGRAMS_PER_SM = 4
#: Bins a program counts in its window (the last position pads), 0 for none
#: (``_triton_histogram.py``): a tensor's non-zero finite values fill a few dozen bins, and
#: 63 are 50-60 binades of float32. On an H200, gradient-like 256 MiB tensors took 11.2x
#: (float32), 9.1x (bfloat16) and 8.7x (float16) a sum pass with it, 12.3x, 13.5x and 14.7x
#: without; a window of 32 was no faster (10.1x, 12.4x, 12.2x).
WINDOW = 64

_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 1}
_bin_tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
#: Why this kernel could not run, once per process (``None``: it has not failed). Its own:
#: the stats kernels may still run where this one does not compile.
_failure: str | None = None


def takes(tensor: torch.Tensor) -> bool:
    """Whether :func:`counts` takes ``tensor`` (a float32, bfloat16 or float16 tensor on a
    device the Triton kernels run on, contiguous), neither kernel having failed."""
    return (
        tensor.dtype in _KINDS
        and _failure is None
        and triton_kernel.runs_on(tensor.device)
        and triton_kernel.failure() is None
        and tensor.is_contiguous()
    )


def record_failure(error: BaseException) -> None:
    """Remember that this kernel failed: every later histogram takes torch's ops."""
    global _failure
    _failure = f"{type(error).__name__}: {error}"


def reset_failure() -> None:
    """Forget a failure (for tests)."""
    global _failure
    _failure = None


def counts(tensor: torch.Tensor) -> torch.Tensor:
    """The exponent histogram of ``tensor`` (see :func:`takes`): int64 counts per bin of
    :func:`~gradaudit.precision.layout`, on its device, queued, nothing read back."""
    bins = layout().bins
    # A window's positions end at its largest bin or at WINDOW - 2, whichever is higher.
    assert max(bins, WINDOW) < PADDED_BINS, "the layout outgrew the padded histogram"
    device = tensor.device
    out = torch.zeros(PADDED_BINS, dtype=torch.int64, device=device)
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return out[:bins]
    kind = _KINDS[tensor.dtype]
    if kind == 0:
        data = flat.view(torch.int32)
        table = histogram._boundary_tensor(device)
    else:
        data = flat.view(torch.int16)
        table = _bin_table(tensor.dtype, device)
    boundaries = len(layout().boundaries)
    programs = min(-(-n // BLOCK), triton_kernel.sms_of(device) * PROGRAMS_PER_SM)
    context: Any = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    with context:
        _kernel()[(programs,)](
            data,
            n,
            table,
            out,
            BLOCK=BLOCK,
            BINS=PADDED_BINS,
            BOUNDARIES=boundaries,
            STEPS=max(1, math.ceil(math.log2(boundaries + 1))),
            KIND=kind,
            WINDOW=WINDOW,
            LAST=bins - 1,
            **triton_kernel.LAUNCH_OPTIONS,
        )
    return out[:bins]


def _bin_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The torch path's bin of every magnitude pattern of a 16-bit float, as int32."""
    key = (dtype, device)
    table = _bin_tables.get(key)
    if table is None:
        table = histogram._pattern_bins(dtype, device).to(torch.int32)
        _bin_tables[key] = table
    return table


def _kernel() -> Any:
    from gradaudit.engine._triton_histogram import tensor_histogram  # needs triton

    return tensor_histogram
