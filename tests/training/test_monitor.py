"""GradientMonitor: stats one call late, a bounded history, dumps and errors on NaN/Inf."""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gradaudit import (
    GradientMonitor,
    NonFiniteGradientError,
    NonFiniteGradientWarning,
    Thresholds,
    audit,
    named_gradients,
)
from gradaudit.io.safetensors_header import read_header
from gradaudit.training.monitor import MonitorOptions
from gradaudit.training.record import MonitorRecord


class Loop:
    """A tiny model and a way to give it known gradients at each step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        self.grads: list[dict[str, torch.Tensor]] = []

    def backward(self, poison: float | None = None) -> None:
        self.model.zero_grad()
        self.model(torch.randn(5, 3)).pow(2).sum().backward()
        if poison is not None:
            self.model[1].bias.grad[0] = poison  # type: ignore[index]
        self.grads.append({n: g.clone() for n, g in named_gradients(self.model)})


def test_stats_arrive_one_call_late_and_match_that_step(tmp_path: Path) -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=2, dump_dir=tmp_path)
    returned = []
    for _ in range(5):
        loop.backward()
        returned.append(monitor.step())
    assert [r and r.step for r in returned] == [None, 0, None, 2, None]
    final = monitor.flush()
    assert final is not None
    assert final.step == 4
    assert monitor.flush() is None
    assert [r.step for r in monitor.history] == [0, 2, 4]
    for record in monitor.history:
        expected = audit(loop.grads[record.step])
        assert record.global_norm == expected.summary.global_norm
        assert record.norms == {t.name: t.norm for t in expected.tensors}
    assert monitor.norm_history() == [(r.step, r.global_norm) for r in monitor.history]
    assert [s for s, _ in monitor.norm_history("1.bias")] == [0, 2, 4]
    assert list(tmp_path.iterdir()) == []  # healthy: no dump


def test_sync_mode_returns_this_steps_stats() -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, sync=True, dump_dir=None)
    for step in range(3):
        loop.backward()
        record = monitor.step()
        assert record is not None
        assert record.step == step
        assert record.global_norm == audit(loop.grads[step]).summary.global_norm
    assert monitor.flush() is None


def test_history_is_bounded() -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, history=3, dump_dir=None)
    for _ in range(10):
        loop.backward()
        monitor.step()
    monitor.flush()
    assert [r.step for r in monitor.history] == [7, 8, 9]
    assert monitor.last is monitor.history[-1]


def test_explicit_step_numbers_choose_what_is_collected() -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=10, dump_dir=None)
    for step in range(95, 112):
        loop.backward()
        monitor.step(step)
    monitor.flush()
    assert [r.step for r in monitor.history] == [100, 110]


def test_async_nan_dumps_the_current_gradients(tmp_path: Path) -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, dump_dir=tmp_path / "dumps")
    loop.backward(poison=math.nan)
    assert monitor.step() is None
    loop.backward()
    with pytest.warns(NonFiniteGradientWarning, match=r"step 0: NaN/Inf .* 1\.bias \(1 NaN\)"):
        record = monitor.step()
    assert record is not None
    assert record.step == 0
    assert record.nonfinite == ("1.bias",)
    # Learned one call late: the dump holds step 1's gradients, and says so.
    assert record.dump == tmp_path / "dumps" / "step_00000001.safetensors"
    header = read_header(record.dump)
    assert header.metadata["step"] == "1"
    assert header.metadata["nonfinite_step"] == "0"
    assert header.metadata["nonfinite_tensors"] == "1.bias (1 NaN)"
    with safe_open(str(record.dump), framework="pt") as handle:
        assert handle.get_tensor("1.bias").equal(loop.grads[1]["1.bias"])


def test_sync_nan_dumps_exactly_the_bad_gradients_and_raises(tmp_path: Path) -> None:
    loop = Loop()
    monitor = GradientMonitor(
        loop.model, every=1, sync=True, dump_dir=tmp_path, on_nonfinite="raise"
    )
    loop.backward()
    monitor.step()
    loop.backward(poison=-math.inf)
    with pytest.raises(NonFiniteGradientError, match=r"step 1: .*1\.bias \(1 -Inf\)") as caught:
        monitor.step()
    error = caught.value
    assert error.step == 1
    assert error.tensors == ("1.bias",)
    assert error.dump == tmp_path / "step_00000001.safetensors"
    with safe_open(str(error.dump), framework="pt") as handle:
        assert handle.get_tensor("1.bias")[0] == -math.inf
    assert monitor.last is not None
    assert monitor.last.dump == error.dump


def test_warn_and_ignore_write_no_dump(tmp_path: Path) -> None:
    for action in ("warn", "ignore"):
        loop = Loop()
        monitor = GradientMonitor(
            loop.model, every=1, sync=True, dump_dir=tmp_path, on_nonfinite=action
        )
        loop.backward(poison=math.nan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = monitor.step()
        assert record is not None
        assert record.nonfinite == ("1.bias",)
        assert record.dump is None
        assert len(caught) == (1 if action == "warn" else 0)
        if caught:
            assert caught[0].filename == __file__  # points at the caller of step()
    assert list(tmp_path.iterdir()) == []


def test_dumps_are_capped(tmp_path: Path) -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, sync=True, dump_dir=tmp_path, max_dumps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteGradientWarning)
        for _ in range(4):
            loop.backward(poison=math.nan)
            monitor.step()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000000.safetensors",
        "step_00000001.safetensors",
    ]
    assert monitor.dumps_written == 2


def test_a_failed_dump_does_not_stop_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, sync=True, dump_dir=blocker / "dumps")
    loop.backward(poison=math.nan)
    with pytest.warns(NonFiniteGradientWarning, match="no dump written"):
        record = monitor.step()
    assert record is not None
    assert record.dump is None
    assert record.dump_error is not None
    assert "Error" in record.dump_error


def test_a_generator_of_parameters_is_kept() -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model.parameters(), every=1, sync=True, dump_dir=None)
    for _ in range(2):
        loop.backward()
        record = monitor.step()
        assert record is not None
        assert len(record.report.tensors) == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every"),
        ({"history": 0}, "history"),
        ({"max_dumps": -1}, "max_dumps"),
        ({"on_nonfinite": "explode"}, "on_nonfinite must be one of"),
        ({"replicated_by": torch.nn.Linear(1, 1)}, "replicated_by must be the Distributed"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradientMonitor(torch.nn.Linear(1, 1), **kwargs)  # type: ignore[arg-type]


def test_find_replicas_takes_no_module_but_a_ddp_wrapper_and_looks_once() -> None:
    """Outside DDP (one process, no wrapper among the candidates) nothing is checked across
    ranks; the real wrappers are found in tests/integrations/test_ddp.py (gloo, 2 ranks)."""
    model = torch.nn.Linear(2, 2)
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None)
    assert monitor.find_replicas([model, None, torch.nn.Linear(2, 2)]) is None
    assert monitor.replicated_by is None
    model.weight.grad = torch.ones(2, 2)
    record = monitor.step()
    assert record is not None
    assert record.replicas is None


def _explode(loop: Loop, factor: float) -> None:
    loop.backward()
    with torch.no_grad():
        loop.model[1].weight.grad.mul_(factor)  # type: ignore[index,union-attr]


def test_findings_warn_rate_limited_and_are_in_the_record() -> None:
    from gradaudit import GradientFindingWarning

    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, sync=True, dump_dir=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(12):  # an explosion that persists: one warning, then quiet for 10
            _explode(loop, 1e6)
            record = monitor.step()
            assert record is not None
            assert [(f.kind.value, f.tensor) for f in record.findings] == [
                ("exploding", "1.weight")
            ]
    found = [w for w in caught if w.category is GradientFindingWarning]
    messages = [str(w.message) for w in found]
    assert len(messages) == 2
    assert messages[0].startswith("step 0: 1 gradient finding (global norm ")
    assert "exploding 1.weight (norm " in messages[0]
    assert messages[1].startswith("step 10: ")
    assert {w.filename for w in found} == {__file__}  # points at the caller of step()


def test_a_finding_read_by_flush_warns_at_the_caller_of_flush() -> None:
    from gradaudit import GradientFindingWarning

    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, dump_dir=None)  # read one call late
    _explode(loop, 1e6)
    assert monitor.step() is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = monitor.flush()
    assert record is not None
    assert [w.filename for w in caught if w.category is GradientFindingWarning] == [__file__]


def test_on_finding_raise_dump_and_ignore(tmp_path: Path) -> None:
    from gradaudit import GradientFindingError

    loop = Loop()
    raising = GradientMonitor(loop.model, every=1, sync=True, on_finding="raise", dump_dir=tmp_path)
    _explode(loop, 1e6)
    with pytest.raises(GradientFindingError) as error:
        raising.step()
    assert error.value.step == 0
    assert error.value.findings == (("exploding", "1.weight"),)
    assert error.value.dump == tmp_path / "step_00000000.safetensors"
    with safe_open(str(error.value.dump), "pt") as dump:
        assert dump.metadata()["finding_step"] == "0"

    quiet = GradientMonitor(loop.model, every=1, sync=True, on_finding="ignore", dump_dir=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = quiet.step()
    assert record is not None
    assert record.failing_findings
    with pytest.raises(ValueError, match="on_finding must be one of"):
        GradientMonitor(loop.model, on_finding="shout")  # type: ignore[arg-type]


def test_collect_overrides_every() -> None:
    loop = Loop()
    monitor = GradientMonitor(loop.model, every=100, sync=True, dump_dir=None)
    loop.backward()
    assert monitor.step(7, collect=True) is not None
    loop.backward()
    assert monitor.step(100, collect=False) is None


def test_an_all_nan_step_has_a_nan_global_norm_not_zero() -> None:
    """As ``get_total_norm`` and the Trainer's ``grad_norm``: NaN, never 0.0 (which a
    dashboard shows as gradients that vanished); ±Inf gives inf; the finite part is kept."""
    from gradaudit.integrations.scalars import record_scalars

    loop = Loop()
    monitor = GradientMonitor(loop.model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore")
    (loop.model(torch.randn(5, 3)).sum() * math.nan).backward()
    record = monitor.step()
    assert record is not None
    assert len(record.nonfinite) == 4  # every gradient
    assert math.isnan(record.global_norm)
    assert record.finite_norm == 0.0
    assert all(math.isnan(norm) for norm in record.norms.values())
    scalars = record_scalars(record, per_layer=True)
    assert math.isnan(scalars["gradaudit/global_norm"])
    assert math.isnan(scalars["gradaudit/norm/0.weight"])
    loop.backward(poison=math.inf)
    record = monitor.step()
    assert record is not None
    assert record.global_norm == math.inf
    assert record.finite_norm == pytest.approx(
        math.sqrt(
            sum(float((g.double()[g.isfinite()] ** 2).sum()) for g in loop.grads[-1].values())
        )
    )
    assert record.norms["1.bias"] == math.inf
    assert math.isfinite(record.norms["1.weight"])


def test_record_columns_agree_with_the_objects() -> None:
    """A record works its properties out on the report's columns (issue 28 item 9): the
    same values as from the TensorStats and Finding objects, NaN/Inf/findings included."""
    import dataclasses

    from gradaudit.policy import Thresholds
    from gradaudit.results.stats_table import StatsTable

    torch.manual_seed(0)
    grads = {
        "ok": torch.randn(64) * 1e-2,
        "nan": torch.tensor([1.0, float("nan"), 2.0]),
        "inf": torch.tensor([1.0, float("inf"), -float("inf")]),
        "both": torch.tensor([float("nan"), float("inf")]),
        "exploding": torch.full((8,), 1e6),
        "zeros": torch.zeros(16),
        "ok2": torch.randn(4, 4),
    }
    for thresholds in (Thresholds(), Thresholds(ignore=("zeros", "nan"))):
        report = audit(grads, thresholds=thresholds)
        assert isinstance(report.tensors, StatsTable)
        as_objects = dataclasses.replace(
            report, tensors=list(report.tensors), findings=list(report.findings)
        )
        columns, objects = MonitorRecord(3, report), MonitorRecord(3, as_objects)
        assert columns.nonfinite == objects.nonfinite == ("nan", "inf", "both")
        assert columns.findings == objects.findings
        assert {f.tensor for f in columns.findings} >= {"exploding"}
        assert columns.failing_findings == objects.failing_findings
        ignored = [f for f in report.findings if f.severity.value == "ignored"]
        assert bool(ignored) == bool(thresholds.ignore)
        assert math.isnan(columns.global_norm)
        assert math.isnan(objects.global_norm)
        norms, expected = columns.norms, objects.norms
        assert list(norms) == list(expected)
        for name, value in expected.items():
            assert norms[name] == value or (math.isnan(norms[name]) and math.isnan(value))
        assert math.isinf(norms["inf"])
        assert math.isnan(norms["both"])
    healthy = audit({"a": torch.ones(3), "b": torch.full((2,), float("inf"))})
    assert MonitorRecord(0, healthy).global_norm == math.inf
    finite = audit({"a": torch.ones(4)})
    assert MonitorRecord(0, finite).global_norm == pytest.approx(2.0)


def _report_facts(record: object) -> tuple[object, ...]:
    """Everything a report says, but its timing: tensors, findings, summary, references."""
    assert isinstance(record, MonitorRecord)
    report = record.report
    return (
        list(report.tensors),
        list(report.findings),
        report.summary,
        report.outlier_references,
        report.files,
        report.limit_findings,
        record.global_norm,
        record.norms,
        record.nonfinite,
        record.findings,
    )


def test_a_reused_monitor_reports_what_a_fresh_one_does_as_its_parameters_change() -> None:
    # A monitor keeps what judging takes from its parameters' names and shapes between
    # steps (gradaudit.scan.layout); each change of the parameter list must be seen.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(10)))
    reused = GradientMonitor(model, every=1, sync=True, dump_dir=None, on_finding="ignore")

    def give(scale: dict[str, float] | None = None) -> None:
        for name, param in model.named_parameters():
            param.grad = torch.randn_like(param) * 1e-2 * (scale or {}).get(name, 1.0)

    def check() -> None:
        fresh = GradientMonitor(model, every=1, sync=True, dump_dir=None, on_finding="ignore")
        assert _report_facts(reused.step()) == _report_facts(fresh.step())

    give()
    check()
    give({"3.weight": 1e6, "4.bias": 1e-12})  # the same layout: an outlier, a vanishing one
    check()
    model.append(torch.nn.Linear(6, 6))  # a parameter added
    give()
    check()
    model[2].weight.grad = None  # a gradient becoming None
    check()
    model[5].double()  # a dtype changed
    give()
    check()
    model[7].weight.grad = torch.zeros_like(model[7].weight)  # its RMS 0: out of its group
    check()
    model[7].weight.grad = None  # and back to the first layout but one gradient
    model[2].weight.grad = torch.ones_like(model[2].weight)
    check()
    reused.thresholds = Thresholds(exploding=1e-3)  # other thresholds: every gradient explodes
    check_thresholds = GradientMonitor(
        model, every=1, sync=True, dump_dir=None, on_finding="ignore", thresholds=reused.thresholds
    )
    assert _report_facts(reused.step()) == _report_facts(check_thresholds.step())
    assert reused.last is not None
    assert reused.last.report.summary.exploding_tensors > 0


def test_every_option_an_adapter_may_pass_is_declared_for_the_adapters() -> None:
    """``AdapterOptions`` is how a new monitor option reaches every framework callback: one
    left out there would be refused by the callbacks' type hints (``precision`` was added to
    both at once). ``prefix``, ``group`` and ``replicated_by`` are the adapters' to decide."""
    keywords = {
        name
        for name, parameter in inspect.signature(GradientMonitor).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert keywords - {"prefix", "group", "replicated_by"} == set(MonitorOptions.__annotations__)
