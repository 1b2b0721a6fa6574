"""The exponent histogram by one Triton launch (``gradaudit.engine.triton_histogram``).

Through Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``), as the other Triton
tests run the kernels; on a GPU (``benchmarks/gpu_check.py``'s ``tests-kernel`` step) on
CUDA tensors. Against the torch path (``exponent_histogram``), which is itself checked
against NumPy and torch's casts (``tests/precision``) and is what the native kernel is
checked against: every 16-bit magnitude pattern, every boundary of the layout and its
neighbours, NaN, ±Inf, zeros, subnormals, random bits, tensors that take every program
several blocks, and the routing of a collection with histograms.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradaudit.engine import triton_histogram, triton_kernel
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.errors import UsageError
from gradaudit.precision.formats import layout
from tests.engine.interpreted import DEVICE, MARKS  # the interpreter, before a kernel is built
from tests.engine.test_native_histogram import _collected_histograms

pytestmark = MARKS


def assert_counts_match(tensor: torch.Tensor) -> None:
    assert triton_histogram.takes(tensor)
    got = triton_histogram.counts(tensor)
    assert got.dtype == torch.int64
    assert got.device == tensor.device
    assert got.tolist() == exponent_histogram(tensor).tolist()
    assert int(got.sum()) == tensor.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_has_the_torch_paths_bin(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    assert_counts_match(patterns.view(dtype).to(DEVICE))


def test_float32_boundaries_their_neighbours_and_special_values() -> None:
    bounds = torch.tensor(layout().boundaries, dtype=torch.int64)
    near = torch.cat([bounds - 1, bounds, bounds + 1]).clamp(0, 0x7FFFFFFF)
    special = torch.tensor([0, 1, 0x7FFFFF, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000])
    bits = torch.cat([near, special, torch.randint(0, 1 << 31, (20_000,))])
    signed = torch.cat([bits, bits | (1 << 31)])  # both signs: the magnitude is binned
    values = signed.to(torch.int64).to(torch.uint32).view(torch.int32).view(torch.float32)
    assert_counts_match(values.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_program_walks_several_blocks(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two programs over 11 blocks and a tail: each adds several blocks' counts, once."""
    monkeypatch.setattr(triton_histogram, "PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(triton_kernel, "sms_of", lambda device: 2)
    gen = torch.Generator().manual_seed(3)
    n = 11 * triton_histogram.BLOCK + 17
    values = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-20, 20, (n,), generator=gen)
    assert_counts_match(values.to(dtype).to(DEVICE))


def _gradient_like_blocks(dtype: torch.dtype) -> torch.Tensor:
    """Blocks of gradient-like values (one scale, a few dozen bins) and blocks that break a
    program's window in each way: all zeros first (no window yet), zeros, NaN and ±Inf
    among values in the window, one value far below it, one far above it, and a tail."""
    block = triton_histogram.BLOCK
    gen = torch.Generator().manual_seed(7)

    def values(scale: float) -> torch.Tensor:
        return torch.randn(block, generator=gen) * scale

    zeros_between = values(1e-3)
    zeros_between[::5] = 0.0
    specials = values(1e-3)
    specials[[3, 400, 1000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    below, above = values(1e-3), values(1e-3)
    below[17] = 1e-30 if dtype == torch.float32 else 1e-7
    above[900] = 1e30 if dtype == torch.float32 else 60_000.0
    blocks = [
        torch.zeros(block),
        values(1e-3),
        zeros_between,
        specials,
        values(1e-3),
        below,
        values(1e-3),
        above,
        values(1e-4),
        values(1e-3)[: block // 3],
    ]
    return torch.cat(blocks).to(dtype)


@pytest.mark.parametrize("window", [0, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_windowed_counts_equal_the_full_histograms(
    dtype: torch.dtype, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each program's window (or none, 0): blocks counted in it, blocks that fall back to the
    full histogram, zeros and NaN/Inf beside it, programs that choose it at their first,
    second or no block."""
    monkeypatch.setattr(triton_histogram, "WINDOW", window)
    values = _gradient_like_blocks(dtype).to(DEVICE)
    for programs in (1, 2, 3):
        monkeypatch.setattr(triton_histogram, "PROGRAMS_PER_SM", programs)
        monkeypatch.setattr(triton_kernel, "sms_of", lambda device: 1)
        assert_counts_match(values)
    assert_counts_match(torch.zeros(5_000, dtype=dtype, device=DEVICE))  # no window at all
    assert_counts_match(torch.full((700,), float("nan"), dtype=dtype, device=DEVICE))


def test_a_view_and_an_empty_tensor() -> None:
    base = torch.randn(5_000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert_counts_match(base[3:2_003])
    empty = torch.empty(0, device=DEVICE)
    assert triton_histogram.counts(empty).tolist() == [0] * layout().bins


def test_what_it_does_not_take() -> None:
    assert not triton_histogram.takes(torch.zeros(4, dtype=torch.float64, device=DEVICE))
    assert not triton_histogram.takes(torch.zeros(4, dtype=torch.float8_e5m2, device=DEVICE))
    assert not triton_histogram.takes(torch.zeros(4, 6, device=DEVICE).t())


def test_a_collection_with_histograms_counts_them_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's collection counts the histograms of the tensors it takes with this kernel
    (float64 and strided ones keep the torch path), the same counts as the eager engine's."""
    launched: list[torch.dtype] = []
    real = triton_histogram.counts

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        launched.append(tensor.dtype)
        return real(tensor)

    monkeypatch.setattr(triton_histogram, "counts", counted)
    gen = torch.Generator().manual_seed(6)
    tensors = {
        "w": torch.randn(3_000, generator=gen).to(DEVICE) * 1e-3,
        "b": torch.randn(40, generator=gen).to(torch.bfloat16).to(DEVICE),
        "h": torch.randn(700, generator=gen).to(torch.float16).to(DEVICE) * 1e-6,
        "d": torch.randn(50, generator=gen, dtype=torch.float64).to(DEVICE),
        "t": torch.randn(30, 20, generator=gen).to(DEVICE).t(),
    }
    got = _collected_histograms("triton", tensors)
    assert sorted(map(str, launched)) == ["torch.bfloat16", "torch.float16", "torch.float32"]
    launched.clear()
    assert got == _collected_histograms("eager", tensors)
    assert launched == []


def test_a_failed_launch_asked_for_by_name_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(tensor: torch.Tensor) -> Any:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(triton_histogram, "counts", broken)
    monkeypatch.setattr(triton_kernel, "_failure", None)
    try:
        with pytest.raises(UsageError, match="no compiler"):
            _collected_histograms("triton", {"w": torch.randn(100).to(DEVICE)})
    finally:
        triton_kernel.reset_failure()


def test_a_failure_of_this_kernel_leaves_the_stats_kernels_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once it failed, histograms take torch's ops; Triton's own failure stays unset."""
    tensor = torch.randn(100).to(DEVICE)
    assert triton_histogram.takes(tensor)
    triton_histogram.record_failure(RuntimeError("tl.histogram not supported"))
    try:
        assert not triton_histogram.takes(tensor)
        assert triton_kernel.failure() is None
    finally:
        triton_histogram.reset_failure()
    assert triton_histogram.takes(tensor)
