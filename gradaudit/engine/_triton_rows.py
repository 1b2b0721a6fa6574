"""The Triton source of the single-pass kernels (see :mod:`gradaudit.engine.triton_kernel`).

A module of its own, imported on first use only (importing it imports Triton,
and ``triton.jit`` reads ``TRITON_INTERPRET`` then). The kernels are at module
level because older Triton versions look a kernel's names up in its module's
globals only, not in an enclosing function.

Two kernels per flush and device (the multi-tensor-apply pattern of
``torch._foreach_*``): :func:`table_rows` reduces every span of every tensor
of one dtype in one launch, reading its work from a table, and
:func:`merge_partials` merges each tensor's partial rows into its stats row,
for every dtype at once. A flush whose every tensor is one program (tensors
shorter than a span: a small model, many tiny tensors) has nothing to merge:
``table_rows`` then writes each stats row itself (``DIRECT``) and the merge is
not launched (its launch and its read of every row were a sixth of such a
flush on the H200, docs/gpu.md).

The table (int64, one row of ``TABLE_WIDTH`` per tensor, plus a sentinel row)::

    [first program, element offset from x_ptr, length, span]

Program ``p`` finds its tensor's row in a map (``rows[p]``, built on the host
with the table and copied with it), then reduces elements
``[j * span, min((j + 1) * span, length))`` of that tensor, ``j = p - first[t]``.
Every tensor is addressed from the one ``x_ptr`` (the first tensor of the group)
by an element offset, so a tensor's address needs no pointer cast and Triton keeps
``x_ptr``'s 16-byte alignment: the inner loop starts on a multiple of ``VEC``
elements (16 bytes) and has no mask, which is what makes its loads 128 bits wide.
Each iteration loads two vectors of ``BLOCK`` elements before it uses either.
A masked head (at most ``VEC - 1`` elements, only a view's program has one) and
a masked tail (at most two vectors, only a tensor's last program) take the edges,
each behind a scalar branch.

Two paths (docs/gpu.md, "The fast path and the exact path"): the fast path counts
zeros, keeps the maximum of every magnitude and adds every square, with no
per-element test for NaN or ±Inf; a program whose maximum shows one (the bits of
an infinity order above every finite magnitude, NaN's above those) reduces its
span again on the exact path (``_exact``), which counts NaN, +Inf and -Inf and
keeps the finite maximum. A healthy flush never takes it; a program that holds
a NaN reads its span twice.
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
    cannot overflow it. ``FP32_ACC`` (GPUs with slow float64): a float16 or
    bfloat16 square is exact in float32 when it is in
    range, and compensated sums (TwoSum) keep what rounding drops. Float16
    squares are always in range; bfloat16 magnitudes are split in three
    classes, each scaled by a power of two (exact) into float32's normal
    range: [2^-63, 2^59) unscaled, [2^59, 2^128) times 2^-69, below 2^-63
    times 2^88. Every square is then below 2^118, so a lane's sum has room for
    512 of them: a fast-path bfloat16 lane is a word of two elements and adds up
    to 258 (two per vector, at most 129 vectors), the exact path's up to 130.
    (With 2^60 and 2^-68, as before words, 258 squares of the largest bfloat16
    came within 0.01 % of float32's overflow.)

    A float32 square is exact in float32 only as a sum: the scaled magnitude ``s``
    splits by a mask into a head ``h`` of its top 12 significant bits and the rest
    ``r = s - h`` (at most 12 bits, exact), and ``s² = h² + (2hr + r²)`` where ``h²``
    is exact and the second term is rounded once (``2hr`` is exact, ``r² < 2^-22 s²``):
    off by at most 2^-34 of ``s²``. Both go through TwoSum into one compensated sum
    per class. The classes put ``s`` in [2^-40, 2^59), where ``h²`` cannot overflow 130
    times over and ``r²``, when not 0, is a float32 normal (``r`` is at least an ulp
    of ``s``, 2^-63): [2^-70, 2^29) times 2^30, [2^29, 2^128) times 2^-69, below
    2^-70 (subnormals included: scaled, they are normals) times 2^109. Every term is
    then a multiple of 2^-126, so no sum or error term is subnormal and a
    flush-to-zero mode changes nothing. The head is cut on the bits, not with
    Dekker's split, so fused multiply-adds cannot change it (every product here is
    exact, so a fused one gives the same value).
    """
    if FP32_ACC:
        value = finite.to(tl.float32, bitcast=True)
        if KIND == 0:
            is_huge = finite >= 0x4E000000  # 2^29
            is_tiny = finite < 0x1C800000  # 2^-70
            scale = tl.where(is_huge, 2.0**-69, tl.where(is_tiny, 2.0**109, 2.0**30))
            scaled = value * scale
            head = (scaled.to(tl.int32, bitcast=True) & -4096).to(tl.float32, bitcast=True)
            rest = scaled - head
            square = head * head
            cross = (head + head) * rest + rest * rest
            zero = tl.zeros_like(square)
            is_mid = ~(is_huge | is_tiny)
            mid, mid_err = _two_sum(mid, mid_err, tl.where(is_mid, square, zero))
            mid, mid_err = _two_sum(mid, mid_err, tl.where(is_mid, cross, zero))
            huge, huge_err = _two_sum(huge, huge_err, tl.where(is_huge, square, zero))
            huge, huge_err = _two_sum(huge, huge_err, tl.where(is_huge, cross, zero))
            tiny, tiny_err = _two_sum(tiny, tiny_err, tl.where(is_tiny, square, zero))
            tiny, tiny_err = _two_sum(tiny, tiny_err, tl.where(is_tiny, cross, zero))
        elif KIND == 1:
            is_huge = finite >= 0x5D000000  # 2^59
            is_tiny = finite < 0x20000000  # 2^-63
            scale = tl.where(is_huge, 2.0**-69, tl.where(is_tiny, 2.0**88, 1.0))
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


@triton.jit  # type: ignore[untyped-decorator]
def _sum_of_squares(  # type: ignore[no-untyped-def]
    ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC: tl.constexpr, KIND: tl.constexpr
):
    """The program's sum of squares (float64), from its per-lane sums."""
    if FP32_ACC:
        # Widened once per program: each class's sum and error, scaled back, in float64.
        ssq = mid.to(tl.float64) + mid_err.to(tl.float64)
        if KIND == 0:
            ssq *= 2.0**-60
            ssq += (huge.to(tl.float64) + huge_err.to(tl.float64)) * 2.0**138
            ssq += (tiny.to(tl.float64) + tiny_err.to(tl.float64)) * 2.0**-218
        if KIND == 1:
            ssq += (huge.to(tl.float64) + huge_err.to(tl.float64)) * 2.0**138
            ssq += (tiny.to(tl.float64) + tiny_err.to(tl.float64)) * 2.0**-176
    return tl.sum(ssq, axis=0)


@triton.jit  # type: ignore[untyped-decorator]
def _lanes(  # type: ignore[no-untyped-def]
    ptr, lane, inside, lane_start, lane_end, MASKED: tl.constexpr, KIND: tl.constexpr
):
    """The fast path's load: float32 bits of one element per lane, or for bfloat16 a
    32-bit word per lane holding two elements (a 16-byte load is then four words, eight
    elements, and each half is taken apart with one mask, not a shift and a mask).

    Masked (an edge): lanes outside read 0, and a bfloat16 word's half outside
    ``[lane_start, lane_end)`` (elements, not lanes) is cleared: a zero adds nothing to
    the maximum and the squares, and counts as a zero, which the program takes off once
    (every vector holds ``BLOCK`` elements, read or cleared; see ``table_rows``).
    """
    if KIND == 1:
        words = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if MASKED:
            raw = tl.load(words + lane, mask=inside, other=0)
            low = 2 * lane
            raw = tl.where((low >= lane_start) & (low < lane_end), raw, raw & -65536)
            raw = tl.where((low + 1 >= lane_start) & (low + 1 < lane_end), raw, raw & 0xFFFF)
        else:
            raw = tl.load(words + lane)
        return raw
    else:
        return _bits(ptr, lane, inside, MASKED, KIND)


@triton.jit  # type: ignore[untyped-decorator]
def _fast(  # type: ignore[no-untyped-def]
    raw,
    minus_zeros,
    top,
    top_low,
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
    """The fast path's arithmetic on one vector: zeros counted negatively
    (``(m - 1) >> 31`` is -1 for a zero magnitude and 0 for any other: a subtract and a
    shift-add, where a compare costs a predicate test, an add and a select), the running
    maximum of every magnitude (NaN and ±Inf included: their bits order above every
    finite one), the squares added.

    bfloat16: ``raw`` is a word of two elements; the high one's magnitude is the word
    masked (already float32 bits), the low one's maximum is kept on its 15 low bits
    (``top_low``, shifted once per program) and only its square needs the shift.
    """
    if KIND == 1:
        high = raw & 0x7FFF0000
        low = raw & 0x7FFF
        minus_zeros += ((high - 1) >> 31) + ((low - 1) >> 31)
        top = tl.maximum(top, high)
        top_low = tl.maximum(top_low, low)
        ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _squares(
            high, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND
        )
        ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _squares(
            low << 16, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND
        )
    else:
        magnitude = raw & 0x7FFFFFFF
        minus_zeros += (magnitude - 1) >> 31
        top = tl.maximum(top, magnitude)
        ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _squares(
            magnitude, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND
        )
    return minus_zeros, top, top_low, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err


@triton.jit  # type: ignore[untyped-decorator]
def _exact(  # type: ignore[no-untyped-def]
    x_ptr,
    start,
    end,
    aligned,
    BLOCK: tl.constexpr,
    KIND: tl.constexpr,
    FP32_ACC: tl.constexpr,
):
    """Every statistic of ``[start, end)`` with NaN and ±Inf counted: the path a program
    takes again, over its own span, only when the fast path saw a NaN or an infinity.

    One vector per step, a masked head and tail: a lane sees at most ``MAX_STEPS`` + 2
    elements, so its four byte-wide counters (see ``_classify``) cannot carry.
    """
    steps = tl.maximum(end - aligned, 0) // BLOCK
    body_end = aligned + steps * BLOCK
    lanes = tl.arange(0, BLOCK)
    packed = tl.zeros([BLOCK], dtype=tl.int32)
    peak = tl.zeros([BLOCK], dtype=tl.int32)
    ssq = tl.zeros([BLOCK], dtype=tl.float64)
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
    total = _sum_of_squares(ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND)
    return (
        tl.sum(packed & 0xFF, axis=0).to(tl.float64),
        tl.sum((packed >> 8) & 0xFF, axis=0).to(tl.float64),
        tl.sum((packed >> 16) & 0xFF, axis=0).to(tl.float64),
        tl.sum((packed >> 24) & 0xFF, axis=0).to(tl.float64),
        tl.max(peak, axis=0),
        total,
    )


# The program base is not specialised on (Triton would compile a variant for values
# divisible by 16, or equal to 1): one compilation per dtype.
@triton.jit(do_not_specialize=["program_base"])  # type: ignore[untyped-decorator]
def table_rows(  # type: ignore[no-untyped-def]
    x_ptr,
    table_ptr,
    rows_ptr,
    out_ptr,
    program_base,
    BLOCK: tl.constexpr,
    LANES: tl.constexpr,
    VEC: tl.constexpr,
    KIND: tl.constexpr,
    FP32_ACC: tl.constexpr,
    STAGES: tl.constexpr = 1,
    DIRECT: tl.constexpr = False,
):
    program = tl.program_id(0).to(tl.int64) + program_base
    # The program's table row: one load from the program -> row map (a search would be
    # a chain of dependent loads, ~16 instructions per probe).
    local = tl.load(rows_ptr + program)
    row = table_ptr + local * 4
    first = tl.load(row)
    offset = tl.load(row + 1)
    length = tl.load(row + 2)
    span = tl.load(row + 3)
    start = offset + (program - first) * span
    end = offset + tl.minimum((program - first + 1) * span, length)
    # [start, aligned) takes the elements before the first 16-byte boundary,
    # [aligned, body_end) whole unmasked double steps (two vectors of BLOCK elements,
    # loaded together), [body_end, end) the rest: at most two masked vectors. (``aligned``
    # may pass ``end`` in a short span: then the head takes it all.) Only a view's program
    # has a head and only a tensor's last program a tail: a scalar branch skips each
    # where there is none. Lanes are elements, or words of two for bfloat16 (PER = 2).
    PER: tl.constexpr = BLOCK // LANES
    # Element -> lane by a shift, not ``//``: a tensor may sit below the group's base
    # (a negative offset), and integer division truncates toward zero (-13 // 2 is -6,
    # whose word starts at element -12: element -13 would be lost); a shift floors.
    SHIFT: tl.constexpr = PER // 2
    aligned = (start + VEC - 1) // VEC * VEC
    aligned_lane = (start + VEC - 1) // VEC * (VEC // PER)
    pairs = tl.maximum(end - aligned, 0) // (2 * BLOCK)
    body_end = aligned + pairs * (2 * BLOCK)
    lanes = tl.arange(0, LANES)
    # The fast path: zeros (negated), the maximum of every magnitude and the sum of
    # squares. NaN and ±Inf are not told apart from finite values here (their squares
    # spoil the sum and their magnitudes the maximum), so a program that met one (its
    # maximum reaches the infinity's bits) reduces its span again on the exact path.
    minus_zeros = tl.zeros([LANES], dtype=tl.int32)
    top = tl.zeros([LANES], dtype=tl.int32)
    top_low = tl.zeros([LANES], dtype=tl.int32)
    ssq = tl.zeros([LANES], dtype=tl.float64)
    # The float32 sums (FP32_ACC only; otherwise unused and compiled away).
    mid = tl.zeros([LANES], dtype=tl.float32)
    mid_err = tl.zeros([LANES], dtype=tl.float32)
    huge = tl.zeros([LANES], dtype=tl.float32)
    huge_err = tl.zeros([LANES], dtype=tl.float32)
    tiny = tl.zeros([LANES], dtype=tl.float32)
    tiny_err = tl.zeros([LANES], dtype=tl.float32)
    if start < aligned:
        head_end = tl.minimum(aligned, end)
        lane = (start >> SHIFT) + lanes
        inside = lane < ((head_end + PER - 1) >> SHIFT)
        raw = _lanes(x_ptr, lane, inside, start, head_end, True, KIND)
        minus_zeros, top, top_low, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _fast(
            raw,
            minus_zeros,
            top,
            top_low,
            ssq,
            mid,
            mid_err,
            huge,
            huge_err,
            tiny,
            tiny_err,
            FP32_ACC,
            KIND,
        )
    # STAGES > 1: the next iterations' vectors are copied into shared memory while this
    # one is reduced (more bytes in flight per program); 1 is a plain loop.
    for pair in tl.range(0, pairs, num_stages=STAGES):
        lane = aligned_lane + pair * (2 * LANES) + lanes
        one = _lanes(x_ptr, lane, lanes, 0, 0, False, KIND)
        two = _lanes(x_ptr, lane + LANES, lanes, 0, 0, False, KIND)
        minus_zeros, top, top_low, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _fast(
            one,
            minus_zeros,
            top,
            top_low,
            ssq,
            mid,
            mid_err,
            huge,
            huge_err,
            tiny,
            tiny_err,
            FP32_ACC,
            KIND,
        )
        minus_zeros, top, top_low, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _fast(
            two,
            minus_zeros,
            top,
            top_low,
            ssq,
            mid,
            mid_err,
            huge,
            huge_err,
            tiny,
            tiny_err,
            FP32_ACC,
            KIND,
        )
    if body_end < end:
        for half in range(0, 2):
            lane = (body_end >> SHIFT) + half * LANES + lanes
            inside = lane < ((end + PER - 1) >> SHIFT)
            raw = _lanes(x_ptr, lane, inside, body_end, end, True, KIND)
            minus_zeros, top, top_low, ssq, mid, mid_err, huge, huge_err, tiny, tiny_err = _fast(
                raw,
                minus_zeros,
                top,
                top_low,
                ssq,
                mid,
                mid_err,
                huge,
                huge_err,
                tiny,
                tiny_err,
                FP32_ACC,
                KIND,
            )
    if KIND == 1:
        top = tl.maximum(top, top_low << 16)
    peak = tl.max(top, axis=0)
    if peak >= 0x7F800000:
        nan, pos_inf, neg_inf, zero_count, peak, total = _exact(
            x_ptr, start, end, aligned, BLOCK, KIND, FP32_ACC
        )
    else:
        nan = tl.zeros([], dtype=tl.float64)
        pos_inf = nan
        neg_inf = nan
        # Every vector counted BLOCK elements; those outside the span read as zeros.
        vectors = 2 * pairs + (start < aligned).to(tl.int64) + 2 * (body_end < end).to(tl.int64)
        outside = vectors * BLOCK - (end - start)
        zero_count = (-tl.sum(minus_zeros, axis=0) - outside).to(tl.float64)
        total = _sum_of_squares(ssq, mid, mid_err, huge, huge_err, tiny, tiny_err, FP32_ACC, KIND)
    # DIRECT (every tensor of the flush is one program): the partial row is the tensor's
    # stats row, written where merge_partials would have put it (``out_ptr`` is then the
    # group's first stats row), and the merge is not launched.
    out = out_ptr + (local if DIRECT else program) * 7
    tl.store(out + 0, nan)
    tl.store(out + 1, pos_inf)
    tl.store(out + 2, neg_inf)
    tl.store(out + 3, zero_count)
    tl.store(out + 4, peak.to(tl.float32, bitcast=True).to(tl.float64))
    tl.store(out + 5, 1.0)
    tl.store(out + 6, total)


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
