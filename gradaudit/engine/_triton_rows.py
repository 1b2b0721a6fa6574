"""The Triton source of the single-pass kernels (see :mod:`gradaudit.engine.triton_kernel`).

A module of its own, imported on first use only (importing it imports Triton,
and ``triton.jit`` reads ``TRITON_INTERPRET`` then). The kernels are at module
level because older Triton versions look a kernel's names up in its module's
globals only, not in an enclosing function.

Two kernels per flush and device (the multi-tensor-apply pattern of
``torch._foreach_*``): :func:`table_rows` reduces every span of every tensor
of one dtype in one launch, reading its work from a table, and
:func:`merge_partials` merges each tensor's partial rows into its stats row,
for every dtype at once.

The table (int64, one row of ``TABLE_WIDTH`` per tensor, plus a sentinel row)::

    [first program, element offset from x_ptr, length, span]

Program ``p`` finds its tensor by a binary search over the first column
(``first[t] <= p < first[t + 1]``; the sentinel's first is the program
count), then reduces elements ``[j * span, min((j + 1) * span, length))``
of that tensor, ``j = p - first[t]``. Every tensor is addressed from the one
``x_ptr`` (the first tensor of the group) by an element offset, so a
tensor's address needs no pointer cast and Triton keeps ``x_ptr``'s 16-byte
alignment: the inner loop starts on a multiple of ``VEC`` elements (16
bytes) and has no mask, which is what makes its loads 128 bits wide. A
masked step before (at most ``VEC - 1`` elements) and one after (less than
``BLOCK``) take the edges.
"""

import triton
import triton.language as tl

#: int64 columns of a table row.
TABLE_WIDTH = 4


@triton.jit
def _two_sum(total, error, value):  # type: ignore[no-untyped-def]
    """``total + value`` with its rounding error added to ``error`` (Knuth's TwoSum)."""
    rounded = total + value
    back = rounded - total
    error += (total - (rounded - back)) + (value - back)
    return rounded, error


@triton.jit  # type: ignore[untyped-decorator]
def _squares(  # type: ignore[no-untyped-def]
    finite,
    ssq,
    mid,
    mid_err,
    huge,
    huge_err,
    tiny,
    tiny_err,
    FP32_ACC: tl.constexpr,
    KIND: tl.constexpr,
):
    """Add the squares of finite magnitudes (float32 bits) to the running sums.

    FP64 (``FP32_ACC`` off): every float32 square is exact in float64 and
    cannot overflow it. ``FP32_ACC`` (GPUs with slow float64, 2-byte dtypes
    only): a float16 or bfloat16 square is exact in float32 when it is in
    range, and compensated sums (TwoSum) keep what rounding drops. Float16
    squares are always in range; bfloat16 magnitudes are split in three
    classes, each scaled by a power of two (exact) into float32's normal
    range with room for 130 squares per lane: [2^-63, 2^60) unscaled,
    [2^60, 2^128) times 2^-68, below 2^-63 times 2^88.
    """
    if FP32_ACC:
        value = finite.to(tl.float32, bitcast=True)
        if KIND == 1:
            is_huge = finite >= 0x5D800000  # 2^60
            is_tiny = finite < 0x20000000  # 2^-63
            scale = tl.where(is_huge, 2.0**-68, tl.where(is_tiny, 2.0**88, 1.0))
            scaled = value * scale
            square = scaled * scaled
            zero = tl.zeros_like(square)
            mid, mid_err = _two_sum(mid, mid_err, tl.where(is_huge | is_tiny, zero, square))
            huge, huge_err = _two_sum(huge, huge_err, tl.where(is_huge, square, zero))
            tiny, tiny_err = _two_sum(tiny, tiny_err, tl.where(is_tiny, square, zero))
        else:
            mid, mid_err = _two_sum(mid, mid_err, value * value)
    else:
        wide = finite.to(tl.float32, bitcast=True).to(tl.float64)
        ssq += wide * wide
    return ssq, mid, mid_err, huge, huge_err, tiny, tiny_err


@triton.jit  # type: ignore[untyped-decorator]
def _classify(  # type: ignore[no-untyped-def]
    bits, inside, packed, peak, MASKED: tl.constexpr
):
    """Add one vector of float32 bit patterns to the running per-lane counts and maximum;
    returns them and the finite magnitudes (bits; 0 for NaN and ±Inf).

    Classified on the bits, as the native kernel does: IEEE magnitudes order
    like integers, and no flush-to-zero mode can touch an integer compare.
    The four counts share one int32 per lane, a byte each (nan, +inf, -inf,
    zeros): a lane sees at most ``MAX_STEPS`` elements per program, so no
    byte carries into the next.
    """
    magnitude = bits & 0x7FFFFFFF
    special = magnitude >= 0x7F800000
    infinite = magnitude == 0x7F800000
    code = tl.where(infinite, tl.where(bits < 0, 0x10000, 0x100), 1)
    is_zero = magnitude == 0
    if MASKED:
        # Masked lanes read 0: they must not count as zeros.
        is_zero = is_zero & inside
    code = tl.where(special, code, tl.where(is_zero, 0x1000000, 0))
    packed += code
    finite = tl.where(special, 0, magnitude)
    peak = tl.maximum(peak, finite)
    return packed, peak, finite


@triton.jit  # type: ignore[untyped-decorator]
def _bits(ptr, index, inside, MASKED: tl.constexpr, KIND: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 bit patterns of the elements at ``ptr + index``.

    KIND 0: float32. KIND 1: bfloat16 read as its int16 bits; shifted, they
    are the float32 bits of the same value (a conversion might flush
    subnormals). KIND 2: float16, whose conversion to float32 is exact (its
    subnormals are float32 normals).
    """
    if MASKED:  # noqa: SIM108 (a constexpr branch: only one load is compiled)
        raw = tl.load(ptr + index, mask=inside, other=0)
    else:
        raw = tl.load(ptr + index)
    if KIND == 1:
        bits = raw.to(tl.int32) << 16
    elif KIND == 2:
        bits = raw.to(tl.float32).to(tl.int32, bitcast=True)
    else:
        bits = raw.to(tl.int32, bitcast=True)
    return bits


# Counts and offsets are not specialised on (Triton would compile a variant
# for values divisible by 16, or equal to 1): one compilation per dtype.
@triton.jit(do_not_specialize=["program_base", "tensors", "search_steps"])  # type: ignore[untyped-decorator]
def table_rows(  # type: ignore[no-untyped-def]
    x_ptr,
    table_ptr,
    out_ptr,
    program_base,
    tensors,
    search_steps,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    KIND: tl.constexpr,
    FP32_ACC: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64) + program_base
    # Binary search: first[low] <= program < first[high].
    low = tl.zeros([], dtype=tl.int64)
    high = tensors.to(tl.int64)
    for _ in range(search_steps):
        middle = (low + high) // 2
        below = tl.load(table_ptr + middle * 4) <= program
        low = tl.where(below, middle, low)
        high = tl.where(below, high, middle)
    row = table_ptr + low * 4
    first = tl.load(row)
    offset = tl.load(row + 1)
    length = tl.load(row + 2)
    span = tl.load(row + 3)
    start = offset + (program - first) * span
    end = offset + tl.minimum((program - first + 1) * span, length)
    # [start, aligned) takes the elements before the first 16-byte boundary,
    # [aligned, body_end) whole unmasked steps, [body_end, end) the rest.
    # (``aligned`` may pass ``end`` in a short span: then the head takes it all.)
    aligned = (start + VEC - 1) // VEC * VEC
    steps = tl.maximum(end - aligned, 0) // BLOCK
    body_end = aligned + steps * BLOCK
    lanes = tl.arange(0, BLOCK)
    packed = tl.zeros([BLOCK], dtype=tl.int32)
    peak = tl.zeros([BLOCK], dtype=tl.int32)
    ssq = tl.zeros([BLOCK], dtype=tl.float64)
    # The float32 sums (FP32_ACC only; otherwise unused and compiled away).
    mid = tl.zeros([BLOCK], dtype=tl.float32)
    mid_err = tl.zeros([BLOCK], dtype=tl.float32)
    huge = tl.zeros([BLOCK], dtype=tl.float32)
    huge_err = tl.zeros([BLOCK], dtype=tl.float32)
    tiny = tl.zeros([BLOCK], dtype=tl.float32)
    tiny_err = tl.zeros([BLOCK], dtype=tl.float32)
    index = start + lanes
    inside = index < tl.minimum(aligned, end)
    bits = _bits(x_ptr, index, inside, True, KIND)
    packed, peak, finite = _classify(bits, inside, packed, peak, True)
    ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _squares(
        finite, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND
    )
    for step in range(0, steps):
        index = aligned + step * BLOCK + lanes
        bits = _bits(x_ptr, index, inside, False, KIND)
        packed, peak, finite = _classify(bits, inside, packed, peak, False)
        ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _squares(
            finite, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND
        )
    index = body_end + lanes
    inside = index < end
    bits = _bits(x_ptr, index, inside, True, KIND)
    packed, peak, finite = _classify(bits, inside, packed, peak, True)
    ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _squares(
        finite, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND
    )
    if FP32_ACC:
        # Widened once per program: each class's sum and error, scaled back, in float64.
        ssq = mid.to(tl.float64) + mid_err.to(tl.float64)
        if KIND == 1:
            ssq += (huge.to(tl.float64) + huge_err.to(tl.float64)) * 2.0**136
            ssq += (tiny.to(tl.float64) + tiny_err.to(tl.float64)) * 2.0**-176
    out = out_ptr + program * 7
    tl.store(out + 0, tl.sum(packed & 0xFF, axis=0).to(tl.float64))
    tl.store(out + 1, tl.sum((packed >> 8) & 0xFF, axis=0).to(tl.float64))
    tl.store(out + 2, tl.sum((packed >> 16) & 0xFF, axis=0).to(tl.float64))
    tl.store(out + 3, tl.sum((packed >> 24) & 0xFF, axis=0).to(tl.float64))
    tl.store(out + 4, tl.max(peak, axis=0).to(tl.float32, bitcast=True).to(tl.float64))
    tl.store(out + 5, 1.0)
    tl.store(out + 6, tl.sum(ssq, axis=0))


@triton.jit(do_not_specialize=["tensors"])  # type: ignore[untyped-decorator]
def merge_partials(  # type: ignore[no-untyped-def]
    partial_ptr, first_ptr, out_ptr, tensors, PARTS: tl.constexpr
):
    """Row ``t`` of ``out`` from partial rows ``[first[t], first[t + 1])``: counts
    and sums of squares add, maxima take the max (the merge rule, scale 1)."""
    tensor = tl.program_id(0).to(tl.int64)
    begin = tl.load(first_ptr + tensor * 4)
    finish = tl.load(first_ptr + tensor * 4 + 4)
    lanes = tl.arange(0, PARTS)
    nan = tl.zeros([PARTS], dtype=tl.float64)
    pos_inf = tl.zeros([PARTS], dtype=tl.float64)
    neg_inf = tl.zeros([PARTS], dtype=tl.float64)
    zeros = tl.zeros([PARTS], dtype=tl.float64)
    peak = tl.zeros([PARTS], dtype=tl.float64)
    ssq = tl.zeros([PARTS], dtype=tl.float64)
    for part in range(begin, finish, PARTS):
        index = part + lanes
        inside = index < finish
        rows = partial_ptr + index * 7
        nan += tl.load(rows + 0, mask=inside, other=0.0)
        pos_inf += tl.load(rows + 1, mask=inside, other=0.0)
        neg_inf += tl.load(rows + 2, mask=inside, other=0.0)
        zeros += tl.load(rows + 3, mask=inside, other=0.0)
        peak = tl.maximum(peak, tl.load(rows + 4, mask=inside, other=0.0))
        ssq += tl.load(rows + 6, mask=inside, other=0.0)
    out = out_ptr + tensor * 7
    tl.store(out + 0, tl.sum(nan, axis=0))
    tl.store(out + 1, tl.sum(pos_inf, axis=0))
    tl.store(out + 2, tl.sum(neg_inf, axis=0))
    tl.store(out + 3, tl.sum(zeros, axis=0))
    tl.store(out + 4, tl.max(peak, axis=0))
    tl.store(out + 5, 1.0)
    tl.store(out + 6, tl.sum(ssq, axis=0))
