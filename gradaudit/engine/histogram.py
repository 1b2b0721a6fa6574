"""Device side of the exponent histogram for the eager and Triton engines and GPU tensors:
one extra pass per tensor, nothing read back (the native kernel counts in its one read).

Opt-in (``scan --precision``, ``PendingStats(histograms=True)``): the default
stats row and its kernels are untouched. For positive floats the order of the
int32 bit patterns is the order of the values, so the bin of ``|x|`` is a
binary search of ``bits & 0x7FFFFFFF`` in the layout's sorted boundary bits
(``torch.bucketize``), and the counts are an ``index_add_`` of ones: torch ops
on the bits, the same on every device, with no host read (``bincount`` would
read its maximum back on CUDA). Half, bfloat16 and fp8 count their 2**15 (or
2**7) magnitude patterns instead and map them to bins. Large tensors go in chunks; chunk histograms
add up.

This is the histogram of every engine but the native one, and the reference the native
kernel is tested against: CPU tensors the native kernel reads get theirs counted in the
same read as the stats row (``_native.c``, through
:func:`gradaudit.engine.native_rows.rows_and_histograms`).
"""

from __future__ import annotations

import torch

from gradaudit.precision.formats import layout

#: Elements binned at once: the bucketize indices of a chunk are 4 bytes each.
HISTOGRAM_CHUNK_ELEMENTS = 1 << 22

_boundaries: dict[torch.device, torch.Tensor] = {}
_pattern_tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _boundary_tensor(device: torch.device) -> torch.Tensor:
    table = _boundaries.get(device)
    if table is None:
        table = _to_device(torch.tensor(layout().boundaries, dtype=torch.int32), device)
        _boundaries[device] = table
    return table


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host table copied to ``device`` without a sync: a plain copy to a CUDA device
    waits for the stream, and the first histogram of a training step would wait for
    its backward pass. From pinned memory the copy is queued; the pinned allocator keeps
    the host block until the copy has run."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def _pattern_bins(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The layout bin of every magnitude bit pattern of a 16- or 8-bit float dtype."""
    key = (dtype, device)
    table = _pattern_tables.get(key)
    if table is None:
        bits = 8 * torch.empty((), dtype=dtype).element_size()
        int_type = torch.int16 if bits == 16 else torch.int8
        patterns = torch.arange(1 << (bits - 1), dtype=torch.int32).to(int_type)
        values = patterns.view(dtype).to(torch.float32).view(torch.int32)
        table = torch.bucketize(values, _boundary_tensor(torch.device("cpu")), right=True)
        table = _to_device(table, device)
        _pattern_tables[key] = table
    return table


def exponent_histogram(
    tensor: torch.Tensor, chunk_elements: int = HISTOGRAM_CHUNK_ELEMENTS
) -> torch.Tensor:
    """Counts per bin of :func:`gradaudit.precision.layout` (int64, on ``tensor``'s device).

    16- and 8-bit floats have few bit patterns: their magnitudes' patterns are
    counted directly and mapped to bins through a table made once (no float32
    copy, no search). float32 is searched in the boundaries; float64 is
    rounded to float32 first, as the casts to the narrow formats do (non-zero
    values below float32's range count in its lowest binade, 2**-149).
    """
    device = tensor.device
    counts = torch.zeros(layout().bins, dtype=torch.int64, device=device)
    flat = tensor.detach().reshape(-1)
    ones = torch.ones(1, dtype=torch.int64, device=device)
    if flat.element_size() <= 2:
        bits = 8 * flat.element_size()
        int_type = torch.int16 if bits == 16 else torch.int8
        patterns = torch.zeros(1 << (bits - 1), dtype=torch.int64, device=device)
        for start in range(0, flat.numel(), chunk_elements):
            piece = flat[start : start + chunk_elements].view(int_type)
            index = (piece & ((1 << (bits - 1)) - 1)).to(torch.int32)
            patterns.index_add_(0, index, ones.expand(index.numel()))
        return counts.index_add_(0, _pattern_bins(flat.dtype, device), patterns)
    table = _boundary_tensor(device)
    for start in range(0, flat.numel(), chunk_elements):
        piece = flat[start : start + chunk_elements]
        narrow = piece if piece.dtype == torch.float32 else piece.to(torch.float32)
        bits32 = narrow.view(torch.int32) & 0x7FFFFFFF
        if piece.dtype == torch.float64:
            # Non-zero doubles below float32's range: the lowest bin, flushed in every format.
            bits32 = torch.where((bits32 == 0) & (piece != 0), 1, bits32)
        index = torch.bucketize(bits32, table, right=True, out_int32=True)
        counts.index_add_(0, index, ones.expand(index.numel()))
    return counts
