"""The Triton source of the exponent histogram (see :mod:`gradaudit.engine.triton_histogram`).

A module of its own, imported on first use only, as ``_triton_rows.py`` is (importing it
imports Triton, and ``triton.jit`` reads ``TRITON_INTERPRET`` then).

One launch per tensor. Each program walks blocks of ``BLOCK`` elements a grid apart,
gives every element its bin of :func:`gradaudit.precision.layout`, counts them into a
program-local histogram (``tl.histogram``: shared-memory atomics on a GPU) and adds
that to the tensor's counts with one vector of atomic additions at the end: the grid is a
few programs per SM, so a tensor's counts take a few hundred atomic vectors, not one per
element (``index_add_`` of ones, the torch path, adds every element to one of ~300
addresses).

A bin, as ``torch.bucketize(bits, boundaries, right=True)`` gives it on the magnitude's
bits (the torch path and its reference): for 16-bit floats one load from the table of
every magnitude pattern's bin (2**15 entries, made once on the host); for float32 a binary
search of the sorted boundary bits, ``STEPS`` halvings.

Why a window: a tensor's non-zero finite values fill a few dozen bins, so with ``WINDOW`` > 0
each program counts ``WINDOW - 1`` consecutive bins ending at the largest bin of the first
block it reads with a non-zero finite value, zeros and NaN/Inf in per-lane counters (bins 0
and ``LAST``), and a block with any other value outside the window in the full histogram
instead (two block reductions a block say which). Lanes past the tensor's end, and in each
histogram the lanes the other one or a counter takes, count in a padding position that the
host (the full histogram's ``BINS - 1``) or the kernel (the window's last) drops. It was
built on a cost model of ``tl.histogram`` as warp ballots, whose cost grows with the bins;
the SASS that Triton 3.8 makes for sm_90 counts one shared-memory atomic increment per
element instead (``ATOMS.POPC.INC``), whatever the bins. Measured on an H200
(docs/gpu.md), the window still made gradient-like tensors 1.1-1.7x faster in one run,
for reasons a profiler on the next GPU should establish.
"""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _magnitudes_and_bins(  # type: ignore[no-untyped-def]
    x_ptr,
    offsets,
    inside,
    table_ptr,
    BLOCK: tl.constexpr,
    BOUNDARIES: tl.constexpr,
    STEPS: tl.constexpr,
    KIND: tl.constexpr,
):
    """The magnitude bits and the bin of each element at ``offsets`` (0 and bin 0 outside)."""
    if KIND == 1:
        bits = tl.load(x_ptr + offsets, mask=inside, other=0).to(tl.int32) & 0x7FFF
        bins = tl.load(table_ptr + bits).to(tl.int32)
    else:
        bits = tl.load(x_ptr + offsets, mask=inside, other=0) & 0x7FFFFFFF
        low = tl.zeros([BLOCK], dtype=tl.int32)
        high = tl.full([BLOCK], BOUNDARIES, dtype=tl.int32)
        for _ in tl.static_range(STEPS):
            open_ = low < high
            middle = (low + high) // 2
            bound = tl.load(table_ptr + middle, mask=open_, other=0)
            above = open_ & (bound <= bits)
            low = tl.where(above, middle + 1, low)
            high = tl.where(open_ & (bound > bits), middle, high)
        bins = low
    return bits, bins


# ``n`` is not specialised: a tensor whose length is not a multiple of 16 would compile
# another variant (Triton specialises integers on it), on a training step.
@triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
def tensor_histogram(  # type: ignore[no-untyped-def]
    x_ptr,
    n,
    table_ptr,
    out_ptr,
    BLOCK: tl.constexpr,
    BINS: tl.constexpr,
    BOUNDARIES: tl.constexpr,
    STEPS: tl.constexpr,
    KIND: tl.constexpr,
    WINDOW: tl.constexpr,
    LAST: tl.constexpr,
):
    """Add the bins of ``x_ptr[0:n]`` to ``out_ptr[0:BINS]`` (int64). ``KIND`` 0: float32
    (its bits as int32, ``table_ptr`` the ``BOUNDARIES`` sorted boundary bits); 1: a 16-bit
    float (its bits as int16, ``table_ptr`` the bin of each of the 2**15 magnitude
    patterns). ``WINDOW``: 0, every element in the full histogram; else the window's size,
    a power of two (see the module doc); ``LAST``: the bin of NaN and ±Inf (bin 0 is
    zero's)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    start = pid.to(tl.int64) * BLOCK
    stride = programs.to(tl.int64) * BLOCK
    if WINDOW == 0:
        while start < n:
            offsets = start + lanes
            inside = offsets < n
            bits, bins = _magnitudes_and_bins(
                x_ptr, offsets, inside, table_ptr, BLOCK, BOUNDARIES, STEPS, KIND
            )
            counts += tl.histogram(tl.where(inside, bins, BINS - 1), BINS)
            start += stride
    else:
        near = tl.zeros([WINDOW], dtype=tl.int32)
        zeros = tl.zeros([BLOCK], dtype=tl.int32)
        special = tl.zeros([BLOCK], dtype=tl.int32)
        lo = pid * 0  # the window's lowest bin; 0: not chosen yet (no non-zero finite value)
        while start < n:
            offsets = start + lanes
            inside = offsets < n
            bits, bins = _magnitudes_and_bins(
                x_ptr, offsets, inside, table_ptr, BLOCK, BOUNDARIES, STEPS, KIND
            )
            counted = inside & (bits != 0) & (bins != LAST)
            zeros += (inside & (bits == 0)).to(tl.int32)
            special += (inside & (bins == LAST)).to(tl.int32)
            top = tl.max(tl.where(counted, bins, 0), axis=0)
            low = tl.min(tl.where(counted, bins, BINS), axis=0)
            # Chosen at the first block with a value to count: its largest bin on top.
            lo = tl.where((lo == 0) & (top > 0), tl.maximum(top - (WINDOW - 2), 1), lo)
            if top > 0:
                if (low < lo) | (top > lo + (WINDOW - 2)):
                    counts += tl.histogram(tl.where(counted, bins, BINS - 1), BINS)
                else:
                    near += tl.histogram(tl.where(counted, bins - lo, WINDOW - 1), WINDOW)
            start += stride
        positions = tl.arange(0, WINDOW)
        tl.atomic_add(out_ptr + lo + positions, near.to(tl.int64), mask=positions < WINDOW - 1)
        tl.atomic_add(out_ptr, tl.sum(zeros, axis=0).to(tl.int64))
        tl.atomic_add(out_ptr + LAST, tl.sum(special, axis=0).to(tl.int64))
    tl.atomic_add(out_ptr + tl.arange(0, BINS), counts.to(tl.int64))
