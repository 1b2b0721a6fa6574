"""The Triton source of the exponent histogram (see :mod:`gradaudit.engine.triton_histogram`).

A module of its own, imported on first use only, as ``_triton_rows.py`` is (importing it
imports Triton, and ``triton.jit`` reads ``TRITON_INTERPRET`` then).

One launch per tensor. Each program walks blocks of ``BLOCK`` elements a grid apart,
gives every element its bin of :func:`gradaudit.precision.layout`, counts them into a
program-local histogram (``tl.histogram``: in shared memory on a GPU) and adds that to the
tensor's counts with one vector of atomic additions at the end: the grid is a few
programs per SM, so a tensor's counts take a few hundred atomic vectors, not one per
element (``index_add_`` of ones, the torch path, adds every element to one of ~300
addresses).

A bin, as ``torch.bucketize(bits, boundaries, right=True)`` gives it on the magnitude's
bits (the torch path and its reference): for 16-bit floats one load from the table of
every magnitude pattern's bin (2**15 entries, made once on the host); for float32 a binary
search of the sorted boundary bits, ``STEPS`` halvings. Lanes past the tensor's end count
in the padding bin ``BINS - 1``, which the host drops.
"""

import triton
import triton.language as tl


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
):
    """Add the bins of ``x_ptr[0:n]`` to ``out_ptr[0:BINS]`` (int64). ``KIND`` 0: float32
    (its bits as int32, ``table_ptr`` the ``BOUNDARIES`` sorted boundary bits); 1: a 16-bit
    float (its bits as int16, ``table_ptr`` the bin of each of the 2**15 magnitude
    patterns)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    start = pid.to(tl.int64) * BLOCK
    stride = programs.to(tl.int64) * BLOCK
    while start < n:
        offsets = start + lanes
        inside = offsets < n
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
        bins = tl.where(inside, bins, BINS - 1)
        counts += tl.histogram(bins, BINS)
        start += stride
    tl.atomic_add(out_ptr + tl.arange(0, BINS), counts.to(tl.int64))
