"""The engine against an independent float64 reference, and its no-sync guarantee."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit import TensorStats, audit, collect_async
from gradaudit.engine import native
from gradaudit.engine.dtypes import AUDITED_DTYPES
from gradaudit.engine.fpmode import subnormals_survive
from gradaudit.engine.host_read import read_blocks
from gradaudit.engine.kernels import CompiledKernel, fused_rows
from gradaudit.engine.stats import (
    NAN,
    ROW_WIDTH,
    SCALE,
    SSQ,
    ZEROS,
    StatsCollector,
    merge_rows,
)
from gradaudit.results.row import HostRow
from tests.reference import reference_stats

#: Real dtypes (complex ones have their own reference below).
FLOAT_DTYPES = sorted((d for d in AUDITED_DTYPES if d.is_floating_point), key=str)

# Largest magnitude worth planting per dtype: big enough that float32 squares
# (or float64 squares, for float64) overflow, small enough to stay finite.
HUGE = {
    dtype: value
    for name, value in (
        ("float64", 1e200),
        ("float32", 1e20),
        ("bfloat16", 1e30),
        ("float16", 6e4),
        ("float8_e4m3fn", 400.0),
        ("float8_e5m2", 5e4),
        ("float8_e4m3fnuz", 200.0),
        ("float8_e5m2fnuz", 5e4),
        ("float8_e8m0fnu", 1e38),  # torch >= 2.7: the dtypes this torch has
    )
    if (dtype := getattr(torch, name, None)) is not None
}

#: The engines that reduce CPU tensors here: native only where the install built it.
CPU_ENGINES = ["eager", "native"] if native.available() else ["eager"]


def stats_of(tensor: torch.Tensor, chunk_elements: int = 1 << 20, engine: str = "eager") -> HostRow:
    row = StatsCollector(chunk_elements, engine=engine).row(tensor)
    return HostRow.from_values(row.cpu().tolist())


def assert_matches_reference(tensor: torch.Tensor, got: HostRow | TensorStats) -> None:
    ref = reference_stats(tensor)
    assert (got.nan, got.pos_inf, got.neg_inf, got.zeros) == (
        ref.nan,
        ref.pos_inf,
        ref.neg_inf,
        ref.zeros,
    )
    assert got.max_abs == ref.max_abs
    assert math.isfinite(got.norm)
    assert got.norm == pytest.approx(ref.norm, rel=1e-6, abs=0.0)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
    numel = math.prod(shape)
    magnitude = draw(st.sampled_from([1e-25, 1e-3, 1.0, HUGE[dtype]]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen, dtype=torch.float64) * magnitude
    specials = draw(
        st.lists(
            st.tuples(
                st.integers(0, max(numel - 1, 0)),
                st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, HUGE[dtype]]),
            ),
            max_size=min(numel, 6),
        )
    )
    for index, value in specials:
        if numel:
            values[index] = value
    return values.to(dtype).reshape(shape)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    tensor=tensors(),
    chunk=st.sampled_from([1, 2, 3, 7, 64, 1 << 20]),
    engine=st.sampled_from(CPU_ENGINES),
)
def test_engine_matches_float64_reference(tensor: torch.Tensor, chunk: int, engine: str) -> None:
    assert_matches_reference(tensor, stats_of(tensor, chunk, engine))


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, 1e20),
        (torch.float32, 3e38),
        (torch.bfloat16, 1e30),
        (torch.float16, 300.0),
        (torch.float16, 60000.0),
        (torch.float64, 1e200),
        (torch.float64, 1e-300),
        (torch.float32, 1e-25),
        (torch.float64, 1e-25),
        (torch.float8_e4m3fn, 448.0),
        (torch.float8_e5m2, 57344.0),
    ],
)
def test_norm_never_overflows_or_underflows(dtype: torch.dtype, value: float) -> None:
    tensor = torch.full((1000,), value, dtype=torch.float64).to(dtype)
    got = stats_of(tensor, chunk_elements=256)
    assert_matches_reference(tensor, got)
    assert got.norm == pytest.approx(float(tensor[0].double()) * math.sqrt(1000), rel=1e-12)


def test_float64_norm_near_the_top_of_the_range() -> None:
    tensor = torch.tensor([1.7e308, -1e308, 0.0], dtype=torch.float64)
    got = stats_of(tensor)
    # The true norm (1.97e308) is still representable: it must come out finite and right.
    assert got.norm == pytest.approx(math.hypot(1.7e308, 1e308), rel=1e-12)


def test_subnormal_float64_values_keep_their_norm() -> None:
    tensor = torch.tensor([5e-324, 1e-320, -3e-310], dtype=torch.float64)
    assert stats_of(tensor).norm == pytest.approx(math.hypot(5e-324, 1e-320, 3e-310), rel=1e-3)


def test_chunking_does_not_change_the_result() -> None:
    gen = torch.Generator().manual_seed(1)
    tensor = torch.randn(10_007, generator=gen) * 1e19
    tensor[::997] = math.nan
    whole, chunked = stats_of(tensor), stats_of(tensor, chunk_elements=100)
    assert (whole.nan, whole.zeros, whole.max_abs) == (chunked.nan, chunked.zeros, chunked.max_abs)
    assert chunked.norm == pytest.approx(whole.norm, rel=1e-12)


def test_non_contiguous_tensor_matches_its_contiguous_copy() -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(64, 33, generator=gen)
    base[5, 7] = math.inf
    for view in (base.t(), base[:, ::2], base.t()[3:]):
        assert not view.is_contiguous()
        a, b = stats_of(view, chunk_elements=50), stats_of(view.contiguous(), chunk_elements=50)
        assert (a.nan, a.pos_inf, a.zeros, a.max_abs) == (b.nan, b.pos_inf, b.zeros, b.max_abs)
        assert a.norm == pytest.approx(b.norm, rel=1e-12)
        assert_matches_reference(view, a)


def test_merge_rule_is_order_independent_across_scales() -> None:
    collector = StatsCollector(chunk_elements=1 << 20)
    parts = [
        torch.tensor([1e200, -3e150], dtype=torch.float64),
        torch.tensor([1e20, math.nan], dtype=torch.float32),
        torch.tensor([1e-300, 0.0], dtype=torch.float64),
    ]
    rows = torch.stack([collector.row(p) for p in parts])
    forward, backward = merge_rows(rows), merge_rows(rows.flip(0))
    assert torch.equal(forward[: ZEROS + 1], backward[: ZEROS + 1])
    merged = HostRow.from_values(forward.tolist())
    assert merged.nan == 1
    assert merged.norm == pytest.approx(math.hypot(1e200, 3e150, 1e20), rel=1e-12)
    assert HostRow.from_values(backward.tolist()).norm == pytest.approx(merged.norm, rel=1e-15)
    assert forward[NAN] == 1
    assert forward[SCALE] > 1
    assert forward[SSQ] > 0


def test_merge_rule_is_one_code_for_host_arrays_and_device_tensors() -> None:
    """numpy rows (the host side, with or without torch) merge as the tensors do."""
    collector = StatsCollector(chunk_elements=1 << 20)
    parts = [
        torch.tensor([1e200, -3e150], dtype=torch.float64),
        torch.tensor([1e20, math.nan, math.inf], dtype=torch.float32),
        torch.tensor([1e-300, 0.0], dtype=torch.float64),
        torch.zeros(3),
    ]
    rows = torch.stack([collector.row(p) for p in parts])
    host = merge_rows(rows.numpy())
    assert isinstance(host, np.ndarray)
    assert host.dtype == np.float64
    assert host.shape == (ROW_WIDTH,)
    device = merge_rows(rows)
    assert isinstance(device, torch.Tensor)
    assert host.tolist() == pytest.approx(device.tolist(), rel=1e-15)
    merged = HostRow.from_values(host.tolist())
    assert (merged.nan, merged.pos_inf, merged.zeros) == (1, 1, 4)
    assert merged.norm == pytest.approx(math.hypot(1e200, 3e150, 1e20), rel=1e-12)
    # The identity of the merge: rows holding no sum of squares keep scale 1.
    zeros = merge_rows(np.stack([rows[3].numpy(), rows[3].numpy()]))
    assert zeros[SCALE] == 1.0
    assert zeros[SSQ] == 0.0


def test_zero_element_and_scalar_tensors() -> None:
    empty = stats_of(torch.empty(0, 5))
    assert (empty.nan, empty.zeros, empty.max_abs, empty.norm) == (0, 0, 0.0, 0.0)
    scalar = stats_of(torch.tensor(-3.0))
    assert (scalar.max_abs, scalar.norm) == (3.0, 3.0)


def test_global_norm_is_overflow_safe_across_tensors() -> None:
    report = audit(
        {
            "a": torch.full((4,), 1e20),
            "b": torch.full((4,), 1e200, dtype=torch.float64),
            "c": torch.tensor([3.0, 4.0]),
        }
    )
    expected = math.hypot(2e200, 2e20, 5.0)
    assert report.summary.global_norm == pytest.approx(expected, rel=1e-12)
    assert all(math.isfinite(t.norm) for t in report.tensors)


def test_rms_compares_layers_of_different_sizes() -> None:
    report = audit({"small": torch.full((10,), 2.0), "big": torch.full((1000,), 2.0)})
    assert [t.rms for t in report.tensors] == pytest.approx([2.0, 2.0])
    nan_only = audit({"x": torch.full((3,), math.nan)}).tensors[0]
    assert nan_only.rms is None
    assert nan_only.nan == 3


def test_non_float_tensors_are_skipped_with_a_reason() -> None:
    report = audit(
        {"w": torch.ones(3), "step": torch.tensor(7), "mask": torch.ones(2, dtype=torch.bool)}
    )
    assert [t.name for t in report.tensors] == ["w"]
    reasons = {s.name: s.reason for s in report.skipped}
    assert set(reasons) == {"step", "mask"}
    assert "int64" in reasons["step"]
    assert "not floating-point" in reasons["step"]


def test_tensors_that_require_grad_are_audited_without_building_a_graph() -> None:
    param = torch.ones(5, requires_grad=True)
    report = audit([("p", param * 2)])
    assert report.tensors[0].norm == pytest.approx(2 * math.sqrt(5))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_collection_never_reads_the_device(dtype: torch.dtype) -> None:
    """Any .item(), bool(), .tolist() or .cpu() raises on meta tensors."""
    tensors = {
        "big": torch.empty(3000, 7, device="meta", dtype=dtype),
        "odd": torch.empty(5, 9, device="meta", dtype=dtype).t(),
        "scalar": torch.empty((), device="meta", dtype=dtype),
        "empty": torch.empty(0, device="meta", dtype=dtype),
        "int": torch.empty(4, device="meta", dtype=torch.int32),
    }
    pending = collect_async(tensors, chunk_elements=1000)
    assert len(pending) == 4
    with pytest.raises((NotImplementedError, RuntimeError)):
        pending.materialize()


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    batch=st.lists(tensors(), min_size=1, max_size=12),
    engine=st.sampled_from(CPU_ENGINES),
)
def test_bucketed_collection_matches_reference(batch: list[torch.Tensor], engine: str) -> None:
    """Small tensors share zero-padded buckets (eager) or one native call; padding never shows."""
    report = audit({f"t{i}": t for i, t in enumerate(batch)}, engine=engine)
    assert [s.name for s in report.tensors] == [f"t{i}" for i in range(len(batch))]
    for tensor, got in zip(batch, report.tensors, strict=True):
        assert_matches_reference(tensor, got)


@pytest.mark.slow
def test_buckets_fill_up_and_flush_in_order() -> None:
    """More small tensors than one bucket holds, mixed with large ones, keep their order."""
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for i in range(700):
        size = [3, 64, 500, 5000, 70_000][i % 5]
        tensor = torch.randn(size, generator=gen)
        tensor[i % size] = [0.0, math.nan, math.inf, -math.inf, 1e20][i % 5]
        tensors[f"p{i}"] = tensor
    report = audit(tensors, engine="eager")
    for stats in report.tensors:
        assert_matches_reference(tensors[stats.name], stats)


@pytest.mark.slow
def test_compiled_kernel_matches_reference() -> None:
    """The fused torch.compile kernel against the same float64 reference as the eager one."""
    gen = torch.Generator().manual_seed(4)
    cases = {}
    for dtype in FLOAT_DTYPES:
        values = torch.randn(3000, generator=gen, dtype=torch.float64) * HUGE[dtype] / 4
        values[[5, 17, 99, 100]] = torch.tensor([math.nan, math.inf, -math.inf, 0.0]).double()
        cases[f"big-{dtype}"] = values.to(dtype)
        cases[f"small-{dtype}"] = values[:37].to(dtype)
    report = audit(cases, engine="compiled", chunk_elements=1024)
    assert report.engine == "compiled"
    for stats in report.tensors:
        assert_matches_reference(cases[stats.name], stats)


@pytest.mark.slow
def test_memory_budget_bounds_live_buckets_and_keeps_results_exact() -> None:
    """Many bucket size classes under a tiny budget: buckets are evicted, results stay exact."""
    budget = 2 * 1024 * 1024
    collector = StatsCollector(memory_budget=budget, engine="eager")
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(int(n), generator=gen) for n in torch.randint(1, 60_000, (300,))]
    tickets = [collector.submit(t) for t in tensors]
    blocks = collector.flush()
    assert collector.peak_bucket_bytes <= collector.bucket_budget <= budget
    host = collector.gather(tickets, read_blocks(blocks))
    for tensor, values in zip(tensors, host.tolist(), strict=True):
        assert_matches_reference(tensor, HostRow.from_values(values))
    # Any order and any subset of the tickets: each row is still its tensor's.
    picked = tickets[::-7]
    for ticket, values in zip(picked, collector.gather(picked, blocks).tolist(), strict=True):
        assert_matches_reference(tensors[ticket], HostRow.from_values(values))


def test_zero_rows_do_not_flush_tiny_float64_contributions() -> None:
    """An all-zero float32 tensor (row scale 1) next to float64 values of 1e-300."""
    report = audit(
        {
            "tiny": torch.tensor([1e-300, -1e-300], dtype=torch.float64),
            "zeros": torch.zeros(4),
            "empty": torch.empty(0),
        }
    )
    assert report.summary.global_norm == pytest.approx(math.sqrt(2) * 1e-300, rel=1e-12)


def test_chunks_are_cache_sized_on_the_cpu_and_budget_sized_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU pays a dozen launches per eager chunk, so its chunks are as large as the budget."""
    calls: list[tuple[str, int]] = []

    def counting(block: torch.Tensor) -> torch.Tensor:
        calls.append((block.device.type, block.shape[1]))
        return torch.zeros((block.shape[0], 7), dtype=torch.float64, device=block.device)

    collector = StatsCollector(engine="eager")
    monkeypatch.setattr(collector._eager, "_kernel", counting)
    numel = 1 << 23
    collector.row(torch.empty(numel, device="meta"))
    collector.row(torch.zeros(numel))
    on_meta = [n for device, n in calls if device == "meta"]
    on_cpu = [n for device, n in calls if device == "cpu"]
    assert sum(on_meta) == sum(on_cpu) == numel
    assert max(on_cpu) == collector.chunk_elements == 1 << 18
    assert max(on_meta) == collector.device_chunk_elements == 1 << 22

    small = StatsCollector(engine="eager", memory_budget=16 * 1024 * 1024)
    assert small.device_chunk_elements == 1 << 18  # 20 bytes of scratch per element fit 8 MiB
    explicit = StatsCollector(engine="eager", chunk_elements=5000)
    assert explicit.chunk_elements == explicit.device_chunk_elements == 5000


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("values", [[-0.0], [-0.0, -0.0], [-0.0, 0.0, -0.0]], ids=str)
def test_negative_zeros_have_max_abs_plus_zero(engine: str, values: list[float]) -> None:
    """|-0.0| is 0: a report must never show max |x| as "-0.0" (maximum() does not order
    signed zeros, so the eager kernel gave it for a tensor of negative zeros)."""
    for shape in ((len(values),), (1, len(values))):
        report = audit({"w": torch.tensor(values).reshape(shape)}, engine=engine)
        assert math.copysign(1.0, report.tensors[0].max_abs) == 1.0


def test_a_compiled_kernel_that_turns_on_flush_to_zero_is_undone() -> None:
    """torch 2.4's inductor loads its CPU kernels built with ``-ffast-math``: the first call
    of each one sets FTZ/DAZ for the thread. The kernel puts IEEE mode back and its rows
    keep a subnormal (simulated here on any torch: the first call flips the mode)."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode to set")
    torch.set_flush_denormal(False)
    calls = []

    def loads_a_fast_math_kernel(block: torch.Tensor) -> torch.Tensor:
        if not calls:
            torch.set_flush_denormal(True)
        calls.append(block)
        return fused_rows(block)

    kernel = CompiledKernel.__new__(CompiledKernel)
    kernel._fn = loads_a_fast_math_kernel
    try:
        rows = kernel(torch.tensor([[1e-310, 0.0]], dtype=torch.float64))
        assert subnormals_survive()
    finally:
        torch.set_flush_denormal(False)
    assert len(calls) == 2  # computed again in IEEE mode
    assert rows[0, 4].item() == 1e-310  # max |x|, not flushed to 0


def test_a_host_thread_in_flush_to_zero_mode_gets_exact_stats_and_keeps_its_mode() -> None:
    """The native kernel computes in IEEE mode in C; the host read and the report's
    arithmetic (norms from scale and sum of squares) under :func:`ieee_mode`."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    torch.set_flush_denormal(False)
    tensor = torch.full((4097,), 1e-310, dtype=torch.float64)
    expected = audit({"w": tensor})
    torch.set_flush_denormal(True)
    try:
        flushed = audit({"w": tensor})
        still_flushing = not subnormals_survive()
    finally:
        torch.set_flush_denormal(False)
    assert still_flushing
    assert flushed.tensors[0].max_abs == 1e-310
    assert flushed.tensors == expected.tensors
    assert_matches_reference(tensor, flushed.tensors[0])
