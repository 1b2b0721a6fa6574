"""GradientMonitor(precision=...): a step's headroom, exactly scan's, acted on as findings."""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gradaudit import (
    GradientFindingError,
    GradientFindingWarning,
    GradientMonitor,
    PendingStats,
    Thresholds,
)
from gradaudit.cli import app
from gradaudit.engine import stats as engine_stats
from gradaudit.engine.native_rows import NativeBatch
from gradaudit.integrations.scalars import record_scalars
from gradaudit.precision.formats import Precision
from gradaudit.precision.headroom import Headroom
from gradaudit.precision.judging import precision_report
from gradaudit.training import monitor as monitor_module
from gradaudit.training.dump import save_gradients
from gradaudit.training.record import MonitorRecord
from tests.conftest import runner
from tests.ranks import single_rank_group
from tests.reference import reference_rounding


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def _set_gradients(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Gradients spread over many binades, some of them flushing or overflowing in every
    format, one of them not contiguous (it takes the collector's other route)."""
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for name, param in model.named_parameters():
        magnitude = torch.exp2(torch.randint(-40, 12, param.shape, generator=generator))
        sign = torch.randn(param.shape, generator=generator).sign()
        grad = (magnitude * sign * torch.rand(param.shape, generator=generator)).float()
        grad.view(-1)[0] = 0.0
        if name == "1.bias":  # flushes in every format (bf16: below 2**-134)
            grad[:2] = 1e-42
        if name == "0.bias":  # overflows every format (bf16: above (2 - 2**-8) * 2**127)
            grad[1] = 3.4e38
        if name == "0.weight":  # [16, 8]: a transposed [8, 16]
            grad = grad.reshape(8, 16).t()
        param.grad = grad
        grads[name] = grad.clone()
    return grads


def _record(model: torch.nn.Module, precision: str, **options: object) -> MonitorRecord:
    monitor = GradientMonitor(
        model,
        every=1,
        sync=True,
        dump_dir=None,
        precision=precision,
        on_finding="ignore",
        **options,  # type: ignore[arg-type]
    )
    record = monitor.step()
    assert record is not None
    assert record.headroom is not None
    return record


@pytest.mark.parametrize("precision", [p.value for p in Precision])
def test_headroom_is_the_scans_and_the_reference(precision: str) -> None:
    model = _model()
    grads = _set_gradients(model, seed=1)
    record = _record(model, precision)
    headroom = record.headroom
    assert headroom is not None
    # The library's headroom of the same tensors: every count the same, exactly.
    pending = PendingStats(histograms=True)
    pending.add_all(grads)
    expected = precision_report(pending.materialize(), Precision(precision))
    assert headroom.total == expected.total
    assert headroom.findings == expected.findings
    flagged = {f.tensor for f in expected.findings}
    assert flagged  # the gradients were made to have some
    assert headroom.flagged == tuple(t for t in expected.tensors if t.name in flagged)
    # And against round-to-nearest-even in float64, from the formats' definitions.
    values = np.concatenate([g.reshape(-1).double().numpy() for g in grads.values()])
    total = headroom.total
    assert (total.flushed, total.subnormal, total.overflowed) == reference_rounding(
        values, Precision(precision)
    )
    assert total.nonzero == int((values != 0).sum())


def test_headroom_is_scan_precision_of_the_same_gradients_saved(tmp_path: Path) -> None:
    model = _model()
    grads = _set_gradients(model, seed=2)
    record = _record(model, "fp16")
    path = tmp_path / "grads.safetensors"
    save_gradients(list(grads.items()), path)
    result = runner.invoke(app, ["scan", str(path), "--precision", "fp16", "--format", "json"])
    document = json.loads(result.stdout)["headroom"]
    assert record.headroom is not None
    total = record.headroom.total
    keys = ("nonzero", "flushed", "subnormal", "overflowed", "min_exponent", "max_exponent")
    assert {k: getattr(total, k) for k in keys} == {k: document["total"][k] for k in keys}
    assert total.scale_log2 == document["total"]["scale_log2"]
    rows = {row["name"]: row for row in document["tensors"]}
    for row in record.headroom.flagged:
        assert {k: getattr(row, k) for k in keys} == {k: rows[row.name][k] for k in keys}
    scanned = {(f["kind"], f["tensor"]) for f in document["findings"]}
    assert {(f.kind, f.tensor) for f in record.headroom.findings} == scanned


def test_the_eager_engine_counts_the_same_in_its_extra_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model()
    _set_gradients(model, seed=4)
    native = _record(model, "fp16")
    passes: list[torch.Size] = []
    counted = engine_stats.exponent_histogram

    def spy(tensor: torch.Tensor) -> torch.Tensor:
        passes.append(tensor.shape)
        return counted(tensor)

    monkeypatch.setattr(engine_stats, "exponent_histogram", spy)
    eager = functools.partial(engine_stats.StatsCollector, engine="eager")
    monkeypatch.setattr(monitor_module, "StatsCollector", eager)
    assert _record(model, "fp16").headroom == native.headroom
    assert len(passes) == len(list(model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bfloat16_and_float16_gradients_are_counted_by_bit_pattern(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(dtype)
    model.weight.grad = (torch.randn(32, 64) * 1e-3).to(dtype)
    # Representable in the gradients' dtype, flushed in the target format.
    model.bias.grad = (torch.randn(32) * (1e-9 if dtype == torch.bfloat16 else 1e-6)).to(dtype)
    record = _record(model, "fp8_e5m2" if dtype == torch.float16 else "fp16")
    assert record.headroom is not None
    values = np.concatenate(
        [model.weight.grad.double().reshape(-1).numpy(), model.bias.grad.double().numpy()]
    )
    total = record.headroom.total
    assert (total.flushed, total.subnormal, total.overflowed) == reference_rounding(
        values, record.headroom.precision
    )
    assert total.flushed > 0
    assert [row.name for row in record.headroom.flagged] == ["bias"]  # 1e-9 flushes


def _planted_overflow() -> torch.nn.Module:
    model = _model()
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    model[1].weight.grad[0, 0] = 1e6  # type: ignore[index]
    return model


def test_an_overflow_warns_naming_the_tensor_and_is_logged() -> None:
    model = _planted_overflow()
    # A high exploding threshold: the cast finding is the only one.
    monitor = GradientMonitor(
        model,
        every=1,
        sync=True,
        dump_dir=None,
        precision="fp16",
        thresholds=Thresholds(exploding=1e9),
    )
    with pytest.warns(GradientFindingWarning) as caught:
        record = monitor.step()
    assert record is not None
    (message,) = [str(w.message) for w in caught]
    assert "cast 1.weight (fp16 headroom: 1 value overflows fp16 (Inf)" in message
    assert record.failing_findings[0].tensor == "1.weight"
    scalars = record_scalars(record)
    assert scalars["gradaudit/headroom/fp16/overflowed"] == 1.0
    assert scalars["gradaudit/headroom/fp16/flagged_tensors"] == 1.0
    nonzero = sum(p.numel() for p in model.parameters())
    assert scalars["gradaudit/headroom/fp16/overflowed_fraction"] == 1 / nonzero
    assert scalars["gradaudit/headroom/fp16/flushed_fraction"] == 0.0
    # max|x| 1e6 < 65520 * 2**-3: the largest power of two that keeps it finite is 2**-4.
    assert scalars["gradaudit/headroom/fp16/scale_log2"] == -4.0
    assert scalars["gradaudit/findings/other"] == 1.0
    # Rate-limited like every finding: the next steps record it without warning again.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = monitor.step()
    assert again is not None
    assert [f.tensor for f in again.findings] == ["1.weight"]


def test_an_overflow_raises_and_dumps(tmp_path: Path) -> None:
    model = _planted_overflow()
    monitor = GradientMonitor(
        model, every=1, sync=True, dump_dir=tmp_path, precision="fp16", on_finding="raise"
    )
    with pytest.raises(GradientFindingError) as raised:
        monitor.step()
    assert ("cast", "1.weight") in raised.value.findings
    assert raised.value.dump is not None
    assert raised.value.dump.exists()


def test_the_same_gradients_in_bf16_have_headroom() -> None:
    model = _planted_overflow()
    record = _record(model, "bf16")
    assert record.headroom is not None
    assert record.headroom.total.overflowed == 0
    assert record.headroom.findings == ()
    assert record_scalars(record)["gradaudit/headroom/bf16/flagged_tensors"] == 0.0


def test_the_default_mode_reads_the_headroom_one_call_late() -> None:
    model = _model()
    _set_gradients(model, seed=3)
    monitor = GradientMonitor(model, every=1, dump_dir=None, precision="fp16", on_finding="ignore")
    assert monitor.step() is None
    synced = _record(model, "fp16")
    record = monitor.flush()
    assert record is not None
    assert record.headroom == synced.headroom


def test_without_precision_nothing_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a histogram was counted without precision=")

    monkeypatch.setattr(engine_stats, "exponent_histogram", refuse)
    monkeypatch.setattr(NativeBatch, "reduce_with_histograms", refuse)
    model = _planted_overflow()
    model[0].weight.grad = model[0].weight.grad.t().contiguous().t()  # type: ignore[index]
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None, on_finding="ignore")
    record = monitor.step()
    assert record is not None
    assert record.headroom is None
    assert not any(key.startswith("gradaudit/headroom/") for key in record_scalars(record))
    assert all(f.kind.value != "cast" for f in record.findings)


def test_options_are_checked() -> None:
    model = _model()
    with pytest.raises(ValueError, match="precision must be None or one of"):
        GradientMonitor(model, precision="fp32")
    with pytest.raises(ValueError, match="max_underflow"):
        GradientMonitor(model, precision="fp16", max_underflow=2.0)
    assert GradientMonitor(model, precision=Precision.BF16).precision is Precision.BF16


def test_a_group_of_one_rank_judges_as_without_one(tmp_path: Path) -> None:
    """With ``group=`` the histograms go through the rows' collective (summed across ranks:
    ``tests/training/test_headroom_ranks.py``); alone in its group, a rank's headroom is its
    gradients' own, the non-contiguous one included."""
    import torch.distributed as dist

    model = _model()
    _set_gradients(model, seed=6)
    alone = _record(model, "fp16")
    with single_rank_group(tmp_path):
        grouped = _record(model, "fp16", group=dist.group.WORLD)
    assert grouped.headroom == alone.headroom
    assert grouped.headroom is not None
    assert grouped.headroom.findings
    assert [f for f in grouped.findings if f.kind.value == "cast"] == [
        f for f in alone.findings if f.kind.value == "cast"
    ]


def test_max_underflow_decides_the_underflow_finding() -> None:
    model = torch.nn.Linear(10, 1, bias=False)
    grad = torch.full((1, 10), 1e-3)
    grad[0, :3] = 1e-9  # 3 of 10 values flush in fp16
    model.weight.grad = grad
    assert [f.kind for f in _record(model, "fp16", max_underflow=0.3).findings] == []
    findings = _record(model, "fp16", max_underflow=0.29).findings
    assert [(f.kind.value, f.tensor) for f in findings] == [("cast", "weight")]
    assert "30.0% of 10 non-zero values flush to zero in fp16" in findings[0].message


def test_a_zero_step_has_no_scale() -> None:
    model = torch.nn.Linear(2, 2)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    record = _record(model, "fp8_e4m3fn")
    assert record.headroom is not None
    assert record.headroom.total == Headroom(
        "(all tensors)", Precision.FP8_E4M3FN, 0, 0, 0, 0, None, None, None
    )
    assert math.isnan(record_scalars(record)["gradaudit/headroom/fp8_e4m3fn/scale_log2"])


def test_an_ignored_tensor_is_neither_acted_on_nor_counted() -> None:
    model = _planted_overflow()
    record = _record(model, "fp16", thresholds=Thresholds(ignore=("1.weight",)))
    assert record.headroom is not None
    assert [f.tensor for f in record.headroom.findings] == ["1.weight"]  # still judged
    assert [f for f in record.findings if f.kind.value == "cast"] == []
    scalars = record_scalars(record)
    assert scalars["gradaudit/headroom/fp16/flagged_tensors"] == 0.0
    assert scalars["gradaudit/headroom/fp16/overflowed"] == 1.0
