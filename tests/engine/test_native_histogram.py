"""The native kernel's exponent histogram (``--precision``), read in the same pass as the row.

Its reference is :func:`gradaudit.engine.histogram.exponent_histogram`, itself checked
against NumPy float64 exponents and torch's casts in ``tests/scan/test_precision.py``; here
every path the CPU runs, thread splits inside tensors, and the row left bit for bit as it is.
"""

from __future__ import annotations

import array
import functools
import math

import numpy as np
import pytest
import torch

from gradaudit.engine import native, native_rows
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.precision.formats import layout
from gradaudit.scan.pending import PendingStats
from tests.engine.test_native import PATHS, on_path

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel is not built")


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 16- or 8-bit float dtype, both signs."""
    if dtype.itemsize == 2:
        return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).view(dtype)


def _near_boundaries() -> torch.Tensor:
    bits = torch.tensor(layout().boundaries[:-1], dtype=torch.int64)
    around = torch.cat([bits + k for k in range(-3, 4)]).clamp(0, 0x7F7FFFFF)
    values = around.to(torch.int32).view(torch.float32)
    return torch.cat([values, -values])


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (150_001,), generator=gen)
    float32 = torch.cat([random_bits.to(torch.int32).view(torch.float32), _near_boundaries()])
    # float64 halfway between float32 neighbours (double rounding), beyond float32's range,
    # and below it (non-zero values that round to zero count in the lowest binade).
    near = _near_boundaries().to(torch.float64)
    ulp = torch.nextafter(near.float(), torch.tensor(math.inf)).double() - near
    float64 = torch.cat(
        [near + ulp * f for f in (0.4999, 0.5, 0.5001, -0.5)]
        + [torch.tensor([1e300, -1e300, 1e-300, -1e-310, 0.0, math.nan, math.inf])]
    )
    tensors = [float32, float64]
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        tensors.append(_patterns(dtype))
    # Gradient-like values around the sizes where the kernel changes how it counts
    # (1024: straight to the output; 4096: one block), with NaN and Inf in some blocks.
    for i, size in enumerate((1, 1023, 1024, 4095, 4097, 3 * 4096 + 5, 100_003)):
        values = torch.randn(size, generator=gen, dtype=torch.float64) * 1e-3
        values[size // 2] = [math.nan, math.inf, 0.0, 1e9][i % 4]
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            tensors.append(values.to(dtype))
    tensors.append(torch.empty(0))
    return tensors


def _columns(tensors: list[torch.Tensor]) -> tuple[array.array[int], ...]:
    return (
        array.array("Q", [t.data_ptr() for t in tensors]),
        array.array("Q", [t.numel() for t in tensors]),
        array.array("i", [native.code(t.dtype) for t in tensors]),
    )


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("threads", [1, 3])
def test_histograms_match_the_reference_and_leave_the_rows_alone(name: str, threads: int) -> None:
    if name not in native.paths():
        pytest.skip(f"this CPU has no {name} path")
    tensors = _tensors()
    columns = _columns(tensors)
    with on_path(name):
        rows, histograms = native_rows.rows_and_histograms(*columns, threads)
        plain = native_rows.rows_of_pointers(*columns, threads)
    # The same bits, NaN included: counting pieces must not change how the row is read.
    assert rows.view(np.int64).tolist() == plain.view(np.int64).tolist()
    assert histograms.shape == (len(tensors), layout().bins)
    for tensor, counts in zip(tensors, histograms.tolist(), strict=True):
        assert counts == exponent_histogram(tensor).tolist(), (tensor.dtype, tensor.numel())


def test_threads_split_inside_a_tensor_and_counts_add_up() -> None:
    """Thread boundaries fall inside the tensors: each tensor's counts are still its own."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=gen) for n in (3, 1_000_001, 5, 777_777, 2)]
    columns = _columns(tensors)
    _, alone = native_rows.rows_and_histograms(*columns, 1)
    for threads in (2, 3, 8):
        _, split = native_rows.rows_and_histograms(*columns, threads)
        assert split.tolist() == alone.tolist()
    assert alone.sum(axis=1).tolist() == [t.numel() for t in tensors]


def test_the_layout_is_the_one_of_precision_and_set_once() -> None:
    module = native_rows.module()
    assert module is not None
    assert native_rows.histogram_bins() == layout().bins
    assert native_rows.histogram_bins() == layout().bins  # the same layout again: accepted
    other = array.array("I", [1, 2, 0x7F800000]).tobytes()
    with pytest.raises(ValueError, match="set already"):
        module.set_layout(other)
    with pytest.raises(ValueError, match="sorted"):
        module.set_layout(array.array("I", [5, 3, 0x7F800000]).tobytes())


def _collected_histograms(engine: str, tensors: dict[str, torch.Tensor]) -> list[list[int]]:
    pending = PendingStats(engine=engine, histograms=True)
    pending.add_all(tensors)
    report = pending.materialize()
    return [list(h.counts) for h in report.histograms if h is not None]


def test_native_and_eager_collections_give_the_same_histograms() -> None:
    """Tiny tensors (one native call for many), a large one, a strided one, every dtype."""
    gen = torch.Generator().manual_seed(5)
    tensors = {f"tiny.{i}": torch.randn(i + 1, generator=gen) * 1e-4 for i in range(50)}
    tensors["large"] = torch.randn(300_000, generator=gen).to(torch.bfloat16)
    tensors["strided"] = torch.randn(64, 48, generator=gen).t()
    tensors["double"] = torch.randn(1000, generator=gen, dtype=torch.float64) * 1e-40
    tensors["fp8"] = _patterns(torch.float8_e5m2)
    native_counts = _collected_histograms("native", tensors)
    assert len(native_counts) == len(tensors)
    assert native_counts == _collected_histograms("eager", tensors)


# ---- the AVX-512 window path: elements counted in vector registers ---------------------
# It counts a window of ~30 bins around the values of the block that chose it; what falls
# outside (zeros aside) is found by a per-block total and counted one by one. These tensors
# put values on every side of that: edges, moves, every bin, every rounding boundary.

BLOCK = 4096


def _numpy_counts(tensor: torch.Tensor) -> list[int]:
    """The oracle: float32 bit patterns of |x| searched in the layout's boundaries."""
    bits = tensor.float().abs().numpy().view(np.uint32)
    bounds = np.array(layout().boundaries, dtype=np.uint32)
    index = np.searchsorted(bounds, bits, side="right")
    return np.bincount(index, minlength=layout().bins).tolist()


def _gradient_block(gen: torch.Generator, scale: float, size: int = BLOCK) -> torch.Tensor:
    return torch.randn(size, generator=gen) * scale


def _window_cases() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    bounds = torch.tensor(layout().boundaries[:-1], dtype=torch.int64)
    cases: dict[str, torch.Tensor] = {}
    # Every rounding boundary and one and two ulps either side, each inside a gradient-like
    # block whose window holds it (the block's scale is the boundary's), both signs.
    cuts = [b for b in layout().boundaries[:-1] if b & 0x7FFFFF and b >> 23 not in (0, 254)]
    blocks = []
    for cut in cuts:
        near = torch.tensor([cut + k for k in (-2, -1, 0, 1, 2)], dtype=torch.int64)
        values = near.to(torch.int32).view(torch.float32)
        block = _gradient_block(gen, float(values[2]))
        block[:: BLOCK // 10][:10] = torch.cat([values, -values])
        blocks.append(block)
    cases["cuts"] = torch.cat(blocks)
    # Every bin: one value per boundary (and its neighbour below) scattered through blocks of
    # gradients, so most sit outside the window that the gradients chose.
    spread = torch.cat([bounds, (bounds - 1).clamp(min=0)]).to(torch.int32).view(torch.float32)
    base = _gradient_block(gen, 1e-3, 8 * BLOCK)
    base[torch.randperm(base.numel(), generator=gen)[: spread.numel()]] = spread
    base[7] = math.nan
    base[BLOCK + 3] = math.inf
    base[2 * BLOCK + 5] = -math.inf
    cases["every bin"] = base
    # Values that move: scales jump up and down block by block (the window follows), some
    # blocks straddle two scales, some are mostly zeros (ReLU) or all zeros or subnormal.
    parts = []
    for i, scale in enumerate([1e-3, 1e3, 1e-3, 1e-30, 1e30, 3e-39, 1.0, 1e-3]):
        block = _gradient_block(gen, scale)
        if i % 2:
            block[BLOCK // 2 :] *= 2.0**-20
        parts.append(block)
    parts.append(torch.zeros(BLOCK))
    relu = _gradient_block(gen, 1e-2)
    relu[relu < 0] = 0.0
    parts.append(relu)
    parts.append(torch.full((BLOCK,), 1e-45))
    cases["moving"] = torch.cat(parts)
    # Values that drift (x2.8 a block): the window is chosen again and again, its counts
    # flushed to the bins each time.
    drift = [_gradient_block(gen, 1e-12 * 2.0 ** (1.5 * i)) for i in range(32)]
    cases["drifting"] = torch.cat(drift)
    # A block of every magnitude (mostly outside any window: the next blocks are counted by
    # the tables), then gradients long enough for the window to be tried again.
    wide = torch.randint(-(1 << 31), (1 << 31) - 1, (BLOCK,), generator=gen)
    wide = wide.to(torch.int32).view(torch.float32).nan_to_num(0.0, 0.0, 0.0).clamp(-1e38, 1e38)
    cases["wide then narrow"] = torch.cat([wide, _gradient_block(gen, 1e-3, 20 * BLOCK), wide])
    # Tails: a last block of fewer elements than a vector, a word pair, a window round.
    for size in (1024, 1025, BLOCK + 1, BLOCK + 15, BLOCK + 17, 2 * BLOCK + 255, 3 * BLOCK + 31):
        cases[f"tail {size}"] = _gradient_block(gen, 1e-4, size)
    return cases


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_window_edges_moves_and_boundaries_match_numpy(name: str, dtype: torch.dtype) -> None:
    if name not in native.paths():
        pytest.skip(f"this CPU has no {name} path")
    tensors = [t.to(dtype) for t in _window_cases().values()]
    columns = _columns(tensors)
    with on_path(name):
        rows, histograms = native_rows.rows_and_histograms(*columns, 1)
        plain = native_rows.rows_of_pointers(*columns, 1)
    assert rows.view(np.int64).tolist() == plain.view(np.int64).tolist()
    for label, tensor, counts in zip(_window_cases(), tensors, histograms.tolist(), strict=True):
        assert counts == _numpy_counts(tensor), (label, dtype)


def test_the_window_cases_reach_every_bin() -> None:
    """The oracle's counts themselves: every bin is populated, so every bin is checked."""
    counts = np.array(_numpy_counts(_window_cases()["every bin"]))
    assert (counts > 0).all()


# ---- values built against the window's arithmetic ---------------------------------------
# The window word finds a position by adding a table entry, looked up by the exponent field
# mod 32, to |x|: a carry out of the mantissa moves past a cut, and an exponent 32k binades
# from the window's lands 32k positions away, out of the word. These put, inside blocks whose
# window the gradients chose, every exponent field with the mantissas that carry or do not
# at every cut's distance, so a wrong entry, a carry in the wrong binade or an alias that
# stays in the word changes a count.


def _cut_mantissas() -> list[int]:
    """Mantissas at, one below and one above each cut's, plus the binade's ends."""
    cuts = {b & 0x7FFFFF for b in layout().boundaries[:-1] if b >> 23 not in (0, 255)}
    near = {(c + k) & 0x7FFFFF for c in cuts for k in (-1, 0, 1)}
    return sorted(near | {0, 1, 2, 0x400000, 0x7FFFFE, 0x7FFFFF})


def _sprinkled(values: torch.Tensor, scale: float, per_block: int = 48) -> torch.Tensor:
    """``values`` a few dozen a block into gradient-like blocks of ``values``' dtype.

    The first block is gradients alone, so the window is theirs; after it, blocks with few
    values outside it keep it (a block mostly outside would move it)."""
    gen = torch.Generator().manual_seed(13)
    blocks = [torch.randn(BLOCK, generator=gen) * scale]
    for start in range(0, values.numel(), per_block):
        block = torch.randn(BLOCK, generator=gen) * scale
        where = torch.randperm(BLOCK, generator=gen)[: values[start : start + per_block].numel()]
        block[where] = values[start : start + per_block].float()
        blocks.append(block)
    return torch.cat(blocks).to(values.dtype)


def _every_field_at_every_cut() -> torch.Tensor:
    fields = torch.arange(256, dtype=torch.int64)[:, None] << 23
    mantissas = torch.tensor(_cut_mantissas(), dtype=torch.int64)[None, :]
    bits = (fields | mantissas).reshape(-1)
    bits = torch.cat([bits, bits | (1 << 31), torch.tensor([0, 1 << 31, 0x7FFFFFFF, -1])])
    return bits.to(torch.int32).view(torch.float32)


def _aliasing_cases() -> dict[str, torch.Tensor]:
    values = _every_field_at_every_cut()
    cases = {}
    # Windows whose binades hold cuts (2**-10 with one, 2**-15 with two, 2**15 with two),
    # and one without any nearby.
    for scale in (1e-3, 3e-5, 3e4, 1e20):
        cases[f"float32 at {scale:g}"] = _sprinkled(values, scale)
    half = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for scale in (1e-3, 3e-5, 1e-6, 3e3):
        cases[f"float16 at {scale:g}"] = _sprinkled(half.view(torch.float16), scale)
        cases[f"bfloat16 at {scale:g}"] = _sprinkled(half.view(torch.bfloat16), scale)
    return cases


@functools.cache
def _aliasing_cases_and_counts() -> tuple[dict[str, torch.Tensor], tuple[list[int], ...]]:
    """The cases and their NumPy counts, made once for every path (1.4 s of the 1.7 s each
    path's test took)."""
    cases = _aliasing_cases()
    return cases, tuple(_numpy_counts(tensor) for tensor in cases.values())


@pytest.mark.parametrize("name", PATHS)
def test_every_exponent_field_and_cut_distance_inside_a_window_matches_numpy(name: str) -> None:
    if name not in native.paths():
        pytest.skip(f"this CPU has no {name} path")
    cases, expected = _aliasing_cases_and_counts()
    tensors = list(cases.values())
    with on_path(name):
        _, histograms = native_rows.rows_and_histograms(*_columns(tensors), 1)
    for label, counts, reference in zip(cases, histograms.tolist(), expected, strict=True):
        assert counts == reference, label


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_misaligned_starts_odd_lengths_and_long_runs_match_numpy(
    name: str, dtype: torch.dtype
) -> None:
    """Tensors that start 1-15 elements into a buffer (no vector alignment) and end anywhere,
    and one value repeated 2**20 times: each window position counts past 4096 per lane,
    where the adders' top carries out."""
    if name not in native.paths():
        pytest.skip(f"this CPU has no {name} path")
    gen = torch.Generator().manual_seed(17)
    buffer = (torch.randn(3 * BLOCK + 600, generator=gen) * 1e-3).to(dtype)
    tensors = [
        buffer[start : start + length]
        for start, length in [
            (1, BLOCK),
            (3, BLOCK + 1),
            (7, 2 * BLOCK + 511),
            (15, 3 * BLOCK + 17),
            (5, 1100),
        ]
    ]
    same = torch.full((1 << 20,), 1.5e-3, dtype=dtype)
    same[::3] = -(2.0**-10)  # an exact power of two: the lower bin of binade 2**-10's cut
    tensors.append(same)
    with on_path(name):
        _, histograms = native_rows.rows_and_histograms(*_columns(tensors), 1)
    for tensor, counts in zip(tensors, histograms.tolist(), strict=True):
        assert counts == _numpy_counts(tensor), (tensor.numel(), tensor.storage_offset())
