"""Many in-memory tensors as columns (gradaudit.engine.bulk): the same results, in order."""

from __future__ import annotations

import math

import pytest
import torch

from gradaudit import audit, collect_async
from gradaudit.engine import native, torch_shim
from gradaudit.engine.bulk import native_segments
from tests.engine.test_stats import assert_matches_reference
from tests.reference import reference_stats

needs_native = pytest.mark.skipif(not native.available(), reason="the native kernel is not built")


@pytest.fixture(autouse=True, params=["the C shim", "the binding"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test with the facts read both ways: through torch's C shim (where it is bound)
    and through torch's binding."""
    if request.param == "the C shim":
        if torch_shim.code_table(native.codes()) is None:
            pytest.skip("torch's C shim is not bound with this torch (test_torch_shim.py)")
    else:
        monkeypatch.setattr(native.torch_shim, "code_table", lambda codes: None)
    return str(request.param)


def mixed() -> dict[str, torch.Tensor]:
    """Runs of plain CPU tensors of every native dtype, broken by tensors that are not."""
    gen = torch.Generator().manual_seed(21)
    tensors: dict[str, torch.Tensor] = {}
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2]
    for i in range(300):
        values = torch.randn(1 + (i * 37) % 900, generator=gen) * 10.0 ** (i % 7 - 3)
        values[i % values.numel()] = [0.0, math.nan, math.inf, -math.inf, 1e4, 2.0][i % 6]
        tensors[f"layers.{i}.weight.grad"] = values.to(dtypes[i % len(dtypes)])
        if i == 50:
            tensors["strided"] = torch.randn(40, 7, generator=gen).t()
        if i == 120:
            tensors["complex"] = torch.randn(33, generator=gen, dtype=torch.complex64)
        if i == 121:
            tensors["parameter"] = torch.nn.Parameter(torch.randn(17, generator=gen))
        if i == 200:
            tensors["empty"] = torch.empty(0, 5)
            tensors["scalar"] = torch.tensor(-3.0)
    tensors["last.strided"] = torch.randn(9, 6, generator=gen)[:, ::2]
    return tensors


@needs_native
def test_segments_and_others_cover_the_list_in_order() -> None:
    tensors = [*mixed().values(), *other_layouts().values(), torch.ones(2)]
    codes = {torch.float32: 0, torch.float16: 2}
    segments, others = native_segments(tensors, codes)
    covered = sorted([i for s in segments for i in range(s.start, s.stop)] + others)
    assert covered == list(range(len(tensors)))
    for segment in segments:
        part = tensors[segment.start : segment.stop]
        assert all(t.dtype in codes and t.is_contiguous() for t in part)
        assert list(segment.pointers) == [t.data_ptr() for t in part]
        assert list(segment.counts) == [t.numel() for t in part]
        assert list(segment.codes) == [codes[t.dtype] for t in part]
        assert list(segment.ranks) == [t.dim() for t in part]
        assert list(segment.dims) == [size for t in part for size in t.shape]
        assert segment.nbytes == sum(t.numel() * t.element_size() for t in part)
    for index in others:
        tensor = tensors[index]
        assert (
            tensor.layout is not torch.strided
            or tensor.dtype not in codes
            or not tensor.is_contiguous()
        )


def other_layouts() -> dict[str, torch.Tensor]:
    """One CPU float32 tensor of each layout that is not strided."""
    dense = torch.randn(4, 4)
    return {
        "coo": dense.to_sparse(),
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "bsr": dense.to_sparse_bsr((2, 2)),
        "bsc": dense.to_sparse_bsc((2, 2)),
        "mkldnn": dense.to_mkldnn(),
    }


@needs_native
@pytest.mark.parametrize("layout", list(other_layouts()))
def test_a_tensor_of_another_layout_is_never_read_as_strided(layout: str) -> None:
    """No layout is asked: another layout must still be told apart (sparse COO is not
    contiguous, compressed sparse layouts raise in is_contiguous(), mkldnn in data_ptr()),
    alone or among plain tensors."""
    odd = other_layouts()[layout]
    plain = [torch.ones(3), torch.full((5,), 2.0)]
    codes = {torch.float32: 0}
    assert native_segments([odd], codes) == ([], [0])
    segments, others = native_segments([plain[0], odd, plain[1]], codes)
    assert others == [1]
    assert [(s.start, s.stop) for s in segments] == [(0, 1), (2, 3)]


@needs_native
def test_anything_but_plain_tensors_takes_the_per_tensor_path() -> None:
    """A subclass (DTensor, a wrapper) is decided tensor by tensor; the plain ones beside
    it still go to the kernel as columns."""

    class Marked(torch.Tensor):
        pass

    tensors = [torch.ones(3), torch.ones(3).as_subclass(Marked), torch.nn.Parameter(torch.ones(2))]
    segments, others = native_segments(tensors, {torch.float32: 0})
    assert others == [1]
    assert [(s.start, s.stop) for s in segments] == [(0, 1), (2, 3)]
    assert native_segments([torch.ones(3)], {}) == ([], [0])


def test_without_the_native_build_every_tensor_takes_the_per_tensor_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    assert native_segments([torch.ones(3), torch.ones(2)], {torch.float32: 0}) == ([], [0, 1])


@needs_native
@pytest.mark.parametrize("engine", ["native", "auto"])
def test_audit_of_mixed_tensors_matches_reference_in_order(engine: str) -> None:
    tensors = mixed()
    report = audit(tensors, engine=engine)
    audited = {name: t for name, t in tensors.items() if name != "complex"}
    assert [s.name for s in report.tensors if s.name != "complex"] == list(audited)
    for stats in report.tensors:
        tensor = tensors[stats.name]
        assert stats.shape == tuple(tensor.shape)
        assert stats.dtype == str(tensor.dtype).removeprefix("torch.")
        assert stats.numel == tensor.numel()
        if tensor.is_complex():
            continue
        assert_matches_reference(tensor, stats)
        assert stats.norm == pytest.approx(reference_stats(tensor).norm, rel=1e-12)
    eager = audit(tensors, engine="eager")
    assert [(s.name, s.nan, s.pos_inf, s.neg_inf, s.zeros, s.max_abs) for s in eager.tensors] == [
        (s.name, s.nan, s.pos_inf, s.neg_inf, s.zeros, s.max_abs) for s in report.tensors
    ]


@needs_native
def test_pairs_with_names_that_are_not_strings_and_skipped_dtypes() -> None:
    pairs = [(1, torch.ones(4)), (2, torch.arange(3)), ("x", torch.zeros(2, dtype=torch.bfloat16))]
    report = audit(pairs)
    assert [s.name for s in report.tensors] == ["1", "x"]
    assert [s.name for s in report.skipped] == ["2"]
    assert report.tensors[1].zeros == 2


@needs_native
def test_values_are_taken_before_collect_returns() -> None:
    """Gradients may be stepped or zeroed right after collection: the rows are already made."""
    grads = {f"g{i}": torch.full((100,), float(i + 1)) for i in range(50)}
    pending = collect_async(grads, engine="native")
    for grad in grads.values():
        grad.fill_(math.nan)
    report = pending.materialize()
    assert all(s.nan == 0 for s in report.tensors)
    assert report.tensors[9].max_abs == 10.0


@needs_native
def test_audit_skips_other_layouts_among_plain_tensors() -> None:
    odd = other_layouts()
    tensors = {"a": torch.ones(3), **odd, "b": torch.zeros(2)}
    report = audit(tensors)
    assert [s.name for s in report.tensors] == ["a", "b"]
    assert [s.name for s in report.skipped] == list(odd)
    assert all("not audited" in s.reason for s in report.skipped)
