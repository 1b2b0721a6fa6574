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


def installed() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA builds)."""
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
    """The compiled Triton function, built once (after ``TRITON_INTERPRET`` is known)."""
    import triton
    import triton.language as tl

    # Sizes are not specialised on (Triton would compile a variant for lengths
    # divisible by 16, or equal to 1): one compilation per dtype is enough.
    @triton.jit(do_not_specialize=["row_length", "programs_per_row"])  # type: ignore[untyped-decorator]
    def partial_rows(  # type: ignore[no-untyped-def]
        x_ptr,
        out_ptr,
        row_length,
        programs_per_row,
        BLOCK: tl.constexpr,
        SPAN: tl.constexpr,
        BFLOAT16_BITS: tl.constexpr,
    ):
        program = tl.program_id(0).to(tl.int64)
        row = program // programs_per_row
        start = (program % programs_per_row) * SPAN
        end = tl.minimum(start + SPAN, row_length)
        base = x_ptr + row * row_length
        lanes = tl.arange(0, BLOCK)
        nan = tl.zeros([BLOCK], dtype=tl.int32)
        pos_inf = tl.zeros([BLOCK], dtype=tl.int32)
        neg_inf = tl.zeros([BLOCK], dtype=tl.int32)
        zeros = tl.zeros([BLOCK], dtype=tl.int32)
        peak = tl.zeros([BLOCK], dtype=tl.int32)
        ssq = tl.zeros([BLOCK], dtype=tl.float64)
        for offset in range(start, end, BLOCK):
            index = offset + lanes
            inside = index < end
            # Lanes past the end read 0: they count as a zero (masked out
            # below) and add nothing to the maximum or the sum of squares.
            if BFLOAT16_BITS:
                # bfloat16 arrives as its int16 bits: shifted, they are the float32
                # bits of the same value (a conversion might flush subnormals).
                bits = tl.load(base + index, mask=inside, other=0).to(tl.int32) << 16
            else:
                # float16 -> float32 is exact: its subnormals are float32 normals.
                bits = tl.load(base + index, mask=inside, other=0.0).to(tl.float32)
                bits = bits.to(tl.int32, bitcast=True)
            # Classified on the bits, as the native kernel does: IEEE magnitudes
            # order like integers, and no flush-to-zero mode can touch a compare.
            magnitude = bits & 0x7FFFFFFF
            infinite = magnitude == 0x7F800000
            nan += (magnitude > 0x7F800000).to(tl.int32)
            pos_inf += (infinite & (bits > 0)).to(tl.int32)
            neg_inf += (infinite & (bits < 0)).to(tl.int32)
            zeros += ((magnitude == 0) & inside).to(tl.int32)
            finite = tl.where(magnitude < 0x7F800000, magnitude, 0)
            peak = tl.maximum(peak, finite)
            wide = finite.to(tl.float32, bitcast=True).to(tl.float64)
            ssq += wide * wide
        out = out_ptr + program * 7
        tl.store(out + 0, tl.sum(nan, axis=0).to(tl.float64))
        tl.store(out + 1, tl.sum(pos_inf, axis=0).to(tl.float64))
        tl.store(out + 2, tl.sum(neg_inf, axis=0).to(tl.float64))
        tl.store(out + 3, tl.sum(zeros, axis=0).to(tl.float64))
        tl.store(out + 4, tl.max(peak, axis=0).to(tl.float32, bitcast=True).to(tl.float64))
        tl.store(out + 5, 1.0)
        tl.store(out + 6, tl.sum(ssq, axis=0))

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
