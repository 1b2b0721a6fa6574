"""CUDA-only checks; every test here is skipped cleanly on a machine without CUDA."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import gradaudit
from gradaudit import audit, collect_async
from gradaudit.engine import native_rows, staging, torch_shim, triton_kernel, triton_plan, warmup
from gradaudit.engine.dtypes import AUDITED_DTYPES, work_dtype
from gradaudit.engine.stats import StatsCollector
from gradaudit.scan.paths import scan_paths
from gradaudit.scan.pending import PendingStats
from tests.conftest import requires_cuda
from tests.reference import reference_stats

pytestmark = [
    pytest.mark.cuda,
    requires_cuda,
]


@dataclass
class Forced:
    """The kernel a test forced for CUDA tensors, and the Triton flushes that ran."""

    engine: str
    flushes: int = 0

    def check(self, *, takes_triton: bool = True) -> None:
        """Triton ran exactly when it was forced (and takes the tensors)."""
        assert (self.flushes > 0) == (self.engine == "triton" and takes_triton), self


@pytest.fixture(params=["triton", "eager"])
def forced(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Forced:
    """Each kernel explicitly: on a fresh GPU ``auto`` is eager until 1 GiB went through it,
    so a test left to ``auto`` would test eager alone. ``auto``'s one decision
    (``compile_worth``) is pinned too, for paths that take no engine (the monitor)."""
    engine = request.param
    if engine == "triton" and not triton_kernel.installed():
        pytest.skip("Triton is not installed")
    state = Forced(engine)

    def counting(launch: Any) -> Any:
        def counted(*args: Any) -> Any:
            state.flushes += 1
            return launch(*args)

        return counted

    # A flush is launched by a batch or, for a list planned once (where torch's C shim is
    # bound, a collector's first list too), by its plan: both count.
    for owner in (triton_kernel.TritonBatch, triton_plan.TritonPlan):
        monkeypatch.setattr(owner, "launch", counting(owner.launch))
    monkeypatch.setattr(triton_kernel, "compile_worth", lambda device: engine == "triton")
    return state


@pytest.fixture
def sync_debug_error() -> Iterator[None]:
    """Make any implicit device->host synchronisation raise."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", sorted(AUDITED_DTYPES, key=str))
def test_collection_does_not_sync(
    dtype: torch.dtype, forced: Forced, sync_debug_error: None
) -> None:
    tensors = {
        "big": torch.randn(3000, 7, device="cuda").to(dtype),
        "odd": torch.randn(5, 9, device="cuda").to(dtype).t(),
        "scalar": torch.ones((), device="cuda").to(dtype),
        "empty": torch.empty(0, device="cuda", dtype=dtype),
        "int": torch.ones(4, device="cuda", dtype=torch.int32),
    }
    pending = collect_async(tensors, chunk_elements=1000, engine=forced.engine)
    assert len(pending) == 4
    # Small fp8 tensors are bucketed as float32 (their work dtype), and Triton reduces the
    # bucket; float64 and complex (float64 moduli) stay with the eager kernel.
    forced.check(takes_triton=work_dtype(dtype) in triton_kernel.KINDS)


def test_cuda_results_match_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    host = torch.randn(100_003, generator=gen) * 1e19
    host[17] = math.nan
    host[99] = -math.inf
    report = audit({"w": host.cuda()}, chunk_elements=4096)
    (stats,) = report.tensors
    ref = reference_stats(host)
    assert (stats.nan, stats.neg_inf, stats.zeros) == (ref.nan, ref.neg_inf, ref.zeros)
    assert stats.max_abs == ref.max_abs
    assert stats.norm == pytest.approx(ref.norm, rel=1e-6)
    assert report.device.startswith("cuda")


def test_compare_on_cuda_reads_both_sides_once_and_matches_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    from gradaudit import compare
    from tests.grafted import grafted_model

    model = grafted_model()
    on_cpu = compare(model.host, model.seed)
    model.cuda()
    engine = importlib.import_module("gradaudit.scan.readback")
    calls: list[int] = []
    real = engine.read_blocks

    def counting(blocks: list[torch.Tensor], *settled: object) -> list[torch.Tensor]:
        calls.append(sum(block.shape[0] for block in blocks))
        return real(blocks, *settled)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "read_blocks", counting)
    on_cuda = compare(model.host, model.seed)
    # One host read for both sides. It holds the 39 tensors' rows and, on the Triton path, a
    # sentinel row per dtype group plus one last row (41 on an H200): a floor, not an equality.
    assert len(calls) == 1
    assert calls[0] >= 39
    assert on_cuda.report.device.startswith("cuda")
    assert on_cuda.dual.normalized_ratio == pytest.approx(on_cpu.dual.normalized_ratio, rel=1e-6)


def test_prefetched_rows_are_read_without_a_sync(forced: Forced, sync_debug_error: None) -> None:
    """A monitor's default mode: collect + prefetch, then read, all without a stream sync."""
    from gradaudit import GradientMonitor

    model = torch.nn.Linear(64, 32, device="cuda")
    monitor = GradientMonitor(model, every=1, dump_dir=None)
    records = []
    for _ in range(3):
        model(torch.randn(8, 64, device="cuda")).sum().backward()
        records.append(monitor.step())
    assert records[0] is None
    assert [r.step for r in records[1:] if r is not None] == [0, 1]
    forced.check()


def test_prefetched_histograms_are_read_without_a_sync(
    forced: Forced, sync_debug_error: None
) -> None:
    """``precision=`` in the default mode: the histograms are prefetched with the rows, and
    the headroom is the one the CPU counts for the same gradients."""
    from gradaudit import GradientMonitor

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, device="cuda")
    monitor = GradientMonitor(model, every=1, dump_dir=None, precision="fp16", on_finding="ignore")
    records = []
    grads = []
    for _ in range(3):
        model.zero_grad()
        (model(torch.randn(8, 64, device="cuda")) * 1e-6).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        records.append(monitor.step())
    torch.cuda.set_sync_debug_mode("default")
    last = records[2]
    assert last is not None
    assert last.step == 1
    on_cpu = torch.nn.Linear(64, 32)
    for name, param in on_cpu.named_parameters():
        param.grad = grads[1][name].cpu()
    expected = GradientMonitor(
        on_cpu, every=1, sync=True, dump_dir=None, precision="fp16", on_finding="ignore"
    ).step()
    assert expected is not None
    assert last.headroom == expected.headroom
    forced.check()


def test_rows_added_after_a_prefetch_are_read_too(forced: Forced) -> None:
    pending = collect_async({"a": torch.ones(3, device="cuda")}, engine=forced.engine)
    pending.prefetch()
    pending.add("b", torch.full((2,), math.nan, device="cuda"))
    report = pending.materialize()
    assert [t.name for t in report.tensors] == ["a", "b"]
    assert report.tensors[1].nan == 2
    assert report.tensors[0].norm == pytest.approx(math.sqrt(3))
    forced.check()


def test_a_file_streams_to_cuda_through_the_staging_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync_debug_error: None
) -> None:
    """Pinned buffers smaller than the tensors: pieces, refills, no sync, the CPU's numbers."""
    monkeypatch.setattr(staging, "BUFFER_BYTES", 64 * 1024)
    gen = torch.Generator().manual_seed(5)
    tensors = {
        "big": torch.randn(300_001, generator=gen),
        "half": torch.randn(70_000, generator=gen).half(),
        "small": torch.tensor([math.nan, 0.0, 3.0]),
        "double": torch.randn(1000, generator=gen, dtype=torch.float64) * 1e200,
    }
    path = tmp_path / "grads.safetensors"
    save_file(tensors, str(path))
    pending = PendingStats(device="cuda")
    pending.add_path(str(path))
    assert pending._uploads is not None
    assert pending._uploads.refills > 0
    torch.cuda.set_sync_debug_mode("default")
    on_cuda = pending.materialize()
    on_cpu = scan_paths([str(path)], device="cpu")
    for got, want in zip(on_cuda.tensors, on_cpu.tensors, strict=True):
        ref = reference_stats(tensors[got.name])
        assert (got.name, got.nan, got.zeros, got.max_abs) == (
            want.name,
            want.nan,
            want.zeros,
            want.max_abs,
        )
        assert got.max_abs == ref.max_abs
        assert got.norm == pytest.approx(ref.norm, rel=1e-9)


def test_cpu_tensors_for_cuda_are_taken_before_add_returns() -> None:
    pending = PendingStats(device="cuda")
    tensor = torch.ones(5_000_000)
    pending.add("w", tensor)
    tensor.fill_(math.nan)  # the copy may still be in flight; its source was the staging buffer
    (stats,) = pending.materialize().tensors
    assert stats.nan == 0
    assert stats.norm == pytest.approx(math.sqrt(5_000_000))


@pytest.mark.parametrize("nbytes", [0, 4, 1000, 64 * 1024, 64 * 1024 + 4, 1 << 22])
def test_the_cuda_channel_moves_every_byte(nbytes: int) -> None:
    ring = staging.HostToDevice(staging.CudaChannel(torch.device("cuda")), buffer_bytes=64 * 1024)
    sources = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8) for _ in range(5)]
    copies = [ring.copy(source) for source in sources]
    for copy, source in zip(copies, sources, strict=True):
        assert copy.device.type == "cuda"
        assert torch.equal(copy.cpu(), source)


def test_auto_engine_reduces_cuda_tensors_with_triton_when_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the background compile (off, or failed), once a compile is worth it (here:
    as if 1 GiB had gone through eager already)."""
    monkeypatch.setattr(warmup, "ENABLED", False)
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", triton_kernel.COMPILE_AFTER_BYTES)
    report = audit({"w": torch.randn(100_000, device="cuda")})
    assert report.engine == ("triton" if triton_kernel.installed() else "eager")


def test_auto_reduces_a_small_scan_with_eager_while_cold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_kernel, "_warm", set())
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", 0)
    monkeypatch.setattr(warmup, "ENABLED", False)  # the rule without the background compile
    triton_kernel._marker.cache_clear()
    report = audit({"w": torch.randn(100_000, device="cuda")})
    triton_kernel._marker.cache_clear()
    assert report.engine == "eager"
    assert triton_kernel._deferred_bytes == 400_000


def test_auto_compiles_in_the_background_then_launches_triton(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A cold cache: the first audit runs eager while a child compiles (no wait), the
    first after the child is done launches Triton, from the child's on-disk cache."""
    if not triton_kernel.installed():
        pytest.skip("Triton is not installed")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_kernel, "_warm", set())
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", 0)
    monkeypatch.setattr(warmup, "ENABLED", True)
    triton_kernel._marker.cache_clear()
    warmup.reset()
    tensors = {"w": torch.randn(100_000, device="cuda")}
    arch = triton_kernel._arch(tensors["w"].device)
    try:
        assert audit(tensors).engine == "eager"
        assert warmup.wait(arch, timeout=300) is warmup.State.DONE, warmup.cause(arch)
        assert Path(triton_kernel._marker(arch)).exists()
        report = audit(tensors)
        assert report.engine == "triton"
        assert report.tensors[0].norm == pytest.approx(reference_stats(tensors["w"].cpu()).norm)
    finally:
        warmup.reset()
        triton_kernel._marker.cache_clear()


def test_the_gpu_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_gpu

    bench_gpu.main(["--gib", "0.01", "--repeats", "1", "--tiny", "20", "--warm-cache"])
    out = capsys.readouterr().out
    assert "pinned H2D GB/s" in out
    assert "transformer-float32 |" in out


needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def _planted(device: torch.device | str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    tensors = {
        "w": torch.randn(300_001, generator=gen),
        "h": torch.randn(5000, generator=gen).half(),
        "b": torch.randn(17, generator=gen).bfloat16(),
    }
    tensors["w"][5] = math.nan
    tensors["h"][7] = -math.inf
    return {name: t.to(device) for name, t in tensors.items()}


def _assert_matches_host(report: gradaudit.Report, tensors: dict[str, torch.Tensor]) -> None:
    for got in report.tensors:
        ref = reference_stats(tensors[got.name].cpu())
        assert (got.nan, got.pos_inf, got.neg_inf, got.zeros) == (
            ref.nan,
            ref.pos_inf,
            ref.neg_inf,
            ref.zeros,
        )
        assert got.max_abs == ref.max_abs
        assert got.norm == pytest.approx(ref.norm, rel=1e-9)


@needs_two_gpus
def test_prefetch_of_a_model_on_a_non_current_gpu(forced: Forced) -> None:
    """Rows on cuda:1 while cuda:0 is current: copied on cuda:1 after its settle event."""
    tensors = _planted("cuda:1")
    with torch.cuda.device(0):
        torch.cuda._sleep(50_000_000)  # a busy cuda:0 must not matter
        pending = collect_async(tensors, engine=forced.engine)
        pending.prefetch()
        assert pending._readback.prefetched is not None
        assert set(pending._readback.prefetched[1]) == {torch.device("cuda", 1)}
        _assert_matches_host(pending.materialize(), tensors)
    forced.check()


@needs_two_gpus
def test_prefetch_with_rows_on_two_gpus(forced: Forced) -> None:
    """One copy per device, both queued without a sync; the read waits for both."""
    on_0 = _planted("cuda:0")
    on_1 = {f"{name}.1": t.to("cuda:1") for name, t in on_0.items()}
    for device in (0, 1):
        torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = collect_async({**on_0, **on_1}, engine=forced.engine)
        pending.prefetch()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending._readback.prefetched is not None
    assert set(pending._readback.prefetched[1]) == {
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    }
    _assert_matches_host(pending.materialize(), {**on_0, **on_1})
    forced.check()


@pytest.mark.parametrize("prefetch", [False, True])
def test_collected_on_a_side_stream_read_on_the_default_one(prefetch: bool, forced: Forced) -> None:
    """The kernels run late on the side stream; the read on the default stream waits for them."""
    tensors = _planted("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the rows are written long after this returns
        pending = collect_async(tensors, engine=forced.engine)
    if prefetch:
        pending.prefetch()
    _assert_matches_host(pending.materialize(), tensors)
    forced.check()


def test_a_gradient_freed_before_the_side_stream_reads_it_keeps_its_values(
    forced: Forced,
) -> None:
    """``record_stream``: memory freed by zero_grad(set_to_none=True) is not reused early."""
    gen = torch.Generator().manual_seed(1)
    host = torch.randn(1 << 22, generator=gen)
    grad = host.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        pending = collect_async({"g": grad}, engine=forced.engine)
    del grad  # freed on the default stream while the side stream has not read it
    reuse = torch.full((1 << 22,), math.nan, device="cuda")  # same size: the freed block
    (stats,) = pending.materialize().tensors
    assert reuse.isnan().all()
    assert stats.nan == 0
    assert stats.norm == pytest.approx(reference_stats(host).norm, rel=1e-9)
    forced.check()


@pytest.mark.skipif(not triton_kernel.installed(), reason="Triton is not installed")
@pytest.mark.parametrize("side_stream", [False, True])
def test_the_planned_flush_keeps_freed_gradients_until_its_kernels_read_them(
    side_stream: bool,
) -> None:
    """The planned path (a training loop's lists once planned, no ``record_stream``): gradients
    freed right after the collection (``zero_grad(set_to_none=True)``) and their memory
    asked for again, while the kernels wait behind a sleep. On the default stream the new
    allocation's writes queue after the kernels; on a side stream the list is held until an
    event after them has completed (``triton_plan.hold``)."""
    gen = torch.Generator().manual_seed(2)
    hosts = [torch.randn(1 << 22, generator=gen) for _ in range(2)]
    collector = StatsCollector(engine="triton")
    names = ["a", "b"]
    first = PendingStats(collector=collector.fresh())
    # The first list (planned already where torch's C shim is bound).
    first.add_tensors(names, [host.cuda() for host in hosts])
    first.materialize()
    grads = [host.cuda() for host in hosts]
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    triton_plan.release_finished()  # nothing left from earlier tests
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the kernels run long after this returns
        pending = PendingStats(collector=collector.fresh())
        pending.add_tensors(names, grads)
    assert collector._routes.plans[grads[0].device] is not None  # planned
    assert triton_plan.held() == int(side_stream)  # and held only off the default stream
    del grads  # freed while the kernels have not read them
    reuse = [torch.full((1 << 22,), math.nan, device="cuda") for _ in range(2)]
    stats = pending.materialize().tensors
    assert all(bool(each.isnan().all()) for each in reuse)
    for each, host in zip(stats, hosts, strict=True):
        assert each.nan == 0
        assert each.norm == pytest.approx(reference_stats(host).norm, rel=1e-9)
    torch.cuda.synchronize()
    triton_plan.release_finished()
    assert triton_plan.held() == 0


@pytest.mark.skipif(not triton_kernel.installed(), reason="Triton is not installed")
def test_byte_counters_do_not_carry_at_the_longest_span_with_the_real_sm_count() -> None:
    """Tensors long enough for MAX_SPAN on this GPU's own SMs, all NaN or all zero: each lane's
    byte counters fill as far as they go (MAX_STEPS steps plus both edges), counts exact."""
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    length = 4 * sms * triton_kernel.MAX_SPAN + 3
    assert triton_kernel.span_for(length, sms) == triton_kernel.MAX_SPAN
    tensors = {
        "anchor": torch.ones(8, dtype=torch.bfloat16, device=device),  # the aligned base
        "nan": torch.full((length + 1,), math.nan, dtype=torch.bfloat16, device=device)[1:],
        "zeros": torch.zeros(length, dtype=torch.float16, device=device),
    }
    report = collect_async(tensors, engine="triton").materialize()
    assert report.engine == "triton"
    got = {stats.name: stats for stats in report.tensors}
    assert (got["nan"].nan, got["nan"].zeros, got["nan"].pos_inf, got["nan"].neg_inf) == (
        length,
        0,
        0,
        0,
    )
    assert (got["zeros"].nan, got["zeros"].zeros, got["zeros"].norm) == (0, length, 0.0)


@requires_cuda
def test_the_c_shims_facts_of_gpu_tensors_are_torchs() -> None:
    """Through torch's C shim (bound once CUDA is in use, a CUDA probe among its checks):
    each GPU tensor's device type and index, shape, contiguity and address are torch's,
    and a planned list's signature refuses the same tensors on another device."""
    torch.zeros(1, device="cuda")  # CUDA in use before the shim is bound
    if not torch_shim.bound():
        pytest.skip("torch's C shim is not bound with this torch (test_torch_shim.py)")
    module = native_rows.module()
    assert module is not None
    tensors = [
        torch.randn(3, 5, device="cuda"),
        torch.zeros(9, dtype=torch.bfloat16, device="cuda")[2:],
        torch.zeros(4, 6, dtype=torch.float16, device="cuda").t(),
        torch.nn.Parameter(torch.ones(2, 3, device="cuda")),
    ]
    cpu_type = module.shim_facts(torch.zeros(1))[1]
    for tensor in tensors:
        _, device_type, index, _, contiguous, sizes, address = module.shim_facts(tensor)
        assert device_type != cpu_type
        assert (index, contiguous, sizes, address) == (
            tensor.get_device(),
            tensor.is_contiguous(),
            tuple(tensor.shape),
            tensor.data_ptr(),
        )
    plain = [tensors[0], tensors[1], tensors[3]]
    signature = torch_shim.signature(plain)
    assert signature is not None
    found = torch_shim.pointers(plain, signature)
    assert found is not None
    assert found.tolist() == [t.data_ptr() for t in plain]
    assert torch_shim.pointers([t.cpu() for t in plain], signature) is None


def test_a_steady_loops_flush_is_replayed_from_a_graph_without_a_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training loop whose gradients stay in place: the planned flush is captured once
    (no synchronisation, as every step: sync debug mode raises) and replayed; each step's
    rows are its own, read after later steps have replayed; a step queued on another
    stream launches instead, and is right too (``gradaudit.engine.triton_graph``)."""
    from gradaudit.engine import triton_graph
    from tests.engine.test_stats import assert_matches_reference

    if not triton_kernel.installed():
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(triton_graph, "ENABLED", True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "embed": torch.empty(5000, 64, device="cuda", dtype=torch.bfloat16),
        "w1": torch.empty(3000, 7, device="cuda"),
        "b1": torch.empty(7, device="cuda"),
        "norm": torch.empty(64, device="cuda", dtype=torch.float16),
    }
    collector = StatsCollector(engine="triton")
    side = torch.cuda.Stream()
    steps = []
    for index in range(7):
        for tensor in tensors.values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen, device="cuda") * (index + 1))
        tensors["w1"][index, 0] = math.nan
        torch.cuda.synchronize()
        kept = {name: tensor.cpu() for name, tensor in tensors.items()}
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side if index == 6 else torch.cuda.current_stream()):
                pending = PendingStats(collector=collector.fresh())
                pending.add_tensors(list(tensors), list(tensors.values()))
                pending.settle()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(side)
        steps.append((pending, kept))
    plan = collector._routes.plans[tensors["w1"].device]
    assert plan is not None
    graphs = plan.replays
    assert graphs.captures == 1
    # Through torch's C shim the first step is planned, else the second: launched twice at
    # the same places, then captured; replayed up to step 5; step 6 is on the side stream.
    assert graphs.replays == (4 if torch_shim.bound() else 3)
    for pending, kept in steps:
        got = list(pending.materialize().tensors)
        for stats, tensor in zip(got, kept.values(), strict=True):
            assert_matches_reference(tensor, stats)
