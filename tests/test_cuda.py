"""CUDA-only checks; every test here is skipped cleanly on a machine without CUDA."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from gradaudit import audit, collect_async
from gradaudit.stats import AUDITED_DTYPES
from tests.reference import reference_stats

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
def test_collection_does_not_sync(dtype: torch.dtype, sync_debug_error: None) -> None:
    tensors = {
        "big": torch.randn(3000, 7, device="cuda").to(dtype),
        "odd": torch.randn(5, 9, device="cuda").to(dtype).t(),
        "scalar": torch.ones((), device="cuda").to(dtype),
        "empty": torch.empty(0, device="cuda", dtype=dtype),
        "int": torch.ones(4, device="cuda", dtype=torch.int32),
    }
    pending = collect_async(tensors, chunk_elements=1000)
    assert len(pending) == 4


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
    engine = importlib.import_module("gradaudit.audit")
    calls: list[int] = []
    real = engine.read_blocks

    def counting(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(sum(block.shape[0] for block in blocks))
        return real(blocks)

    monkeypatch.setattr(engine, "read_blocks", counting)
    on_cuda = compare(model.host, model.seed)
    assert calls == [39]
    assert on_cuda.report.device.startswith("cuda")
    assert on_cuda.dual.normalized_ratio == pytest.approx(on_cpu.dual.normalized_ratio, rel=1e-6)


def test_prefetched_rows_are_read_without_a_sync(sync_debug_error: None) -> None:
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


def test_rows_added_after_a_prefetch_are_read_too() -> None:
    pending = collect_async({"a": torch.ones(3, device="cuda")})
    pending.prefetch()
    pending.add("b", torch.full((2,), math.nan, device="cuda"))
    report = pending.materialize()
    assert [t.name for t in report.tensors] == ["a", "b"]
    assert report.tensors[1].nan == 2
    assert report.tensors[0].norm == pytest.approx(math.sqrt(3))
