"""The Triton source of the single-pass kernel (see :mod:`gradaudit.triton_kernel`).

A module of its own, imported on first use only (importing it imports Triton,
and ``triton.jit`` reads ``TRITON_INTERPRET`` then). The kernel is at module
level because older Triton versions look a kernel's names up in its module's
globals only, not in an enclosing function.
"""

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
