"""Small tensors read as runs (columns, one native call) give what one-by-one reading gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradaudit import audit, scan_paths
from gradaudit.engine import native
from gradaudit.io.base import TensorRun
from gradaudit.io.safetensors_source import SafetensorsSource
from tests.hostile import raw_safetensors


def mixed_file(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Runs broken by dtype changes, a skipped dtype, an empty, a large and a misaligned tensor."""
    gen = torch.Generator().manual_seed(3)
    tensors: list[tuple[str, torch.Tensor]] = []
    for i in range(40):
        tensors.append((f"a.{i}", torch.randn(3, 5, generator=gen)))
    tensors.append(("scalar", torch.tensor(2.5)))
    tensors.append(("nan", torch.tensor([1.0, float("nan"), float("inf")])))
    tensors.append(("empty", torch.empty(0, 4)))
    tensors.append(("large", torch.randn(70_000, generator=gen)))
    for i in range(20):
        tensors.append((f"b.{i}", torch.randn(7, generator=gen).to(torch.bfloat16)))
    tensors.append(("ints", torch.arange(6, dtype=torch.int16)))
    tensors.append(("odd", torch.arange(3, dtype=torch.uint8)))  # misaligns what follows
    tensors.append(("after", torch.randn(4, generator=gen)))
    tensors.append(("pad", torch.arange(1, dtype=torch.uint8)))  # aligns what follows again
    tensors.append(("c.0", torch.randn(2, generator=gen)))
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int16: "I16", torch.uint8: "U8"}
    header: dict[str, object] = {}
    data = bytearray()
    for name, tensor in tensors:
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header)
    text += " " * (-(8 + len(text)) % 8)
    return raw_safetensors(path, text, bytes(data)), dict(tensors)


@pytest.mark.skipif(not native.available(), reason="runs go to the native kernel")
def test_runs_match_reading_one_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, tensors = mixed_file(tmp_path / "mixed.safetensors")
    items = list(SafetensorsSource(str(path)).runs())
    runs = [item for item in items if isinstance(item, TensorRun)]
    assert [len(run.names) for run in runs] == [43, 20, 1]  # a.*+scalar+nan+empty, b.*, c.0
    shapes = [tuple(tensor.shape) for _, tensor in runs[0].tensors()]
    assert shapes[:2] == [(3, 5), (3, 5)]
    assert shapes[40] == ()
    assert list(runs[0].ranks) == [len(shape) for shape in shapes]
    assert list(runs[0].dims) == [size for shape in shapes for size in shape]

    by_runs = scan_paths([path], device="cpu")
    import gradaudit.io.safetensors_map as module

    monkeypatch.setattr(module, "RUN_MAX_ELEMENTS", 0)
    one_by_one = scan_paths([path], device="cpu")
    assert by_runs.tensors == one_by_one.tensors
    assert by_runs.findings == one_by_one.findings
    assert [s.name for s in by_runs.skipped] == ["ints", "odd", "pad"]

    floats = {k: v for k, v in tensors.items() if v.is_floating_point()}
    direct = {t.name: t for t in audit(floats).tensors}
    assert [t.name for t in by_runs.tensors] == list(floats)
    for stats in by_runs.tensors:
        want = direct[stats.name]
        assert (stats.shape, stats.dtype, stats.nan, stats.pos_inf) == (
            want.shape,
            want.dtype,
            want.nan,
            want.pos_inf,
        )
        assert stats.norm == pytest.approx(want.norm, rel=1e-12)


def test_runs_as_tensors_are_views_of_the_right_bytes(tmp_path: Path) -> None:
    path, tensors = mixed_file(tmp_path / "mixed.safetensors")
    seen = {}
    for item in SafetensorsSource(str(path)).runs():
        if isinstance(item, TensorRun):
            seen.update(dict(item.tensors()))
        elif isinstance(item, tuple):
            seen[item[0]] = item[1]
    for name, tensor in seen.items():
        assert torch.equal(tensor, tensors[name]) or (
            tensor.isnan().any() and torch.equal(tensor.nan_to_num(), tensors[name].nan_to_num())
        )


def test_histograms_keep_one_per_tensor_when_the_file_has_runs(tmp_path: Path) -> None:
    path, tensors = mixed_file(tmp_path / "mixed.safetensors")
    report = scan_paths([path], device="cpu", histograms=True)
    floats = [name for name, tensor in tensors.items() if tensor.is_floating_point()]
    assert [t.name for t in report.tensors] == floats
    assert len(report.histograms) == len(floats)
    assert all(h is not None for h in report.histograms)


@pytest.mark.skipif(not native.available(), reason="runs go to the native kernel")
@pytest.mark.parametrize("engine", ["auto", "eager"])
def test_empty_tensors_join_runs_even_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """1.75 M empty tensors (the most a 100 MB header holds) cost a Python call each when
    each came on its own; a run of only empty tensors lies in no bytes at all."""
    header = {f"e.{i}": {"dtype": "F32", "shape": [0, i], "data_offsets": [0, 0]} for i in range(5)}
    path = raw_safetensors(tmp_path / "empty.safetensors", json.dumps(header))
    (run,) = list(SafetensorsSource(str(path)).runs())
    assert isinstance(run, TensorRun)
    assert [tuple(tensor.shape) for _, tensor in run.tensors()] == [(0, i) for i in range(5)]

    by_runs = scan_paths([path], device="cpu", engine=engine)
    import gradaudit.io.safetensors_map as module

    monkeypatch.setattr(module, "RUN_MAX_ELEMENTS", -1)
    one_by_one = scan_paths([path], device="cpu", engine=engine)
    assert by_runs.tensors == one_by_one.tensors
    assert [(t.numel, t.norm, t.nan) for t in by_runs.tensors] == [(0, 0.0, 0)] * 5
