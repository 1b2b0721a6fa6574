"""The fused single-pass row kernel for CUDA, written in Triton.

On a GPU the eager kernel's dozen ops each read the data again, so its
throughput is a fraction of the memory bandwidth; this kernel reads every
element once and keeps all the statistics in registers: NaN, ±Inf and zero
counts, the finite max|x| and a float64 sum of squares (exact for every
float32/float16/bfloat16 square, so it cannot overflow). Each program reduces
a span of one row and writes a partial stats row; the partial rows of a row
are then merged on the device by a few torch reductions (no host read).

It takes float32, float16 and bfloat16 blocks. Float64 needs the scaled
sum of squares and fp8 conversions differ between GPU generations: those
stay with the eager kernel, as do blocks on devices Triton does not target.

Triton is imported on first use only (it costs an import of its own), and
``TRITON_INTERPRET=1`` runs the kernel through Triton's interpreter on CPU
tensors, which is how the CPU-only test suite checks it against float64.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Any

import torch

#: Elements loaded per vector step of a program (a power of two).
BLOCK = 1024
#: Elements of a row reduced by one program: enough work per program to hide
#: its start-up, few enough programs for even a 1 MiB row to fill a GPU.
SPAN = 16 * BLOCK
#: Block dtypes the kernel reads directly.
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@functools.cache
def installed() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA builds); looked up once."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` runs kernels on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether the kernel takes blocks on ``device``: CUDA, or the CPU under the interpreter."""
    if device.type == "cuda":
        return installed()
    return device.type == "cpu" and interpreting() and installed()


def takes(block: torch.Tensor) -> bool:
    """Whether a block can be reduced here (otherwise the eager kernel does it)."""
    return block.dtype in DTYPES and runs_on(block.device)


@functools.cache
def _partial_rows_kernel() -> Any:
    """The Triton function, imported once (after ``TRITON_INTERPRET`` is known)."""
    from gradaudit._triton_rows import partial_rows

    return partial_rows


class TritonKernel:
    """Stats rows ``[m, 7]`` of a contiguous float32/float16/bfloat16 block ``[m, L]``.

    One launch for the whole block, whatever ``m`` and ``L``: a large tensor is
    one row (no chunks, no scratch), a bucket of small tensors is many. The
    partial rows of one row are merged by torch reductions on the device;
    a row that fits in one program's span needs none.
    """

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        if not takes(block):
            raise TypeError(
                f"the Triton kernel takes float32/float16/bfloat16 blocks on CUDA, "
                f"not {block.dtype} on {block.device}"
            )
        rows, length = block.shape
        block = block.contiguous()
        bfloat16 = block.dtype == torch.bfloat16
        if bfloat16:
            block = block.view(torch.int16)
        programs_per_row = max(1, -(-length // SPAN))
        partial = torch.empty(
            (rows * programs_per_row, 7), dtype=torch.float64, device=block.device
        )
        launch = _partial_rows_kernel()[(rows * programs_per_row,)]
        # Triton launches on the current device's current stream.
        with torch.cuda.device(block.device) if block.is_cuda else contextlib.nullcontext():
            launch(
                block,
                partial,
                length,
                programs_per_row,
                BLOCK=BLOCK,
                SPAN=SPAN,
                BFLOAT16_BITS=bfloat16,
            )
        if programs_per_row == 1:
            return partial
        parts = partial.view(rows, programs_per_row, 7)
        return torch.cat(
            [
                parts[:, :, :4].sum(dim=1),
                parts[:, :, 4:6].amax(dim=1),
                parts[:, :, 6:].sum(dim=1),
            ],
            dim=1,
        )
