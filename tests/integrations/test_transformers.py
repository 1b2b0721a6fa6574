"""The ``transformers`` Trainer callback, with the real Trainer on a tiny random BERT.

No weights are downloaded: the model is built from a config. The Trainer's own logged
``grad_norm`` (the pre-clip norm it computes itself) is the independent reference for
the monitor's global norm when nothing is clipped.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import (
    GradientFindingError,
    GradientFindingWarning,
    NonFiniteGradientError,
    NonFiniteGradientWarning,
)
from tests.conftest import requires_cuda
from tests.models import tiny_hf_bert, tiny_hf_gpt2

#: Slow (not in the quick loop): trains tiny models under the real Trainer.
pytestmark = pytest.mark.slow

STEPS = 4


def _trainer(
    tmp_path: Path,
    callback: Any,
    *,
    nan_at: int | None = None,
    attach: bool = True,
    model: Any = None,
    **args: Any,
) -> Any:
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    model = tiny_hf_bert() if model is None else model

    causal = model.config.model_type == "gpt2"  # labels are the next tokens, not a class

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(index)
            ids = torch.randint(0, 50, (8,), generator=gen)
            return {"input_ids": ids, "labels": ids if causal else torch.tensor(index % 2)}

    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "max_steps": STEPS,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    settings.update(args)
    callbacks = [] if attach else [callback]
    trainer = Trainer(
        model=model, args=TrainingArguments(**settings), train_dataset=Data(), callbacks=callbacks
    )
    if attach:
        callback.attach(trainer)
    if nan_at is not None:
        # A NaN in one gradient during the backward of optimizer step ``nan_at`` (1-based).
        class Poison(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                poisoned[0] = state.global_step + 1 == nan_at

        poisoned = [False]
        weight = model.classifier.weight
        weight.register_hook(lambda g: g * math.nan if poisoned[0] else g)
        trainer.add_callback(Poison())
    return trainer


def _train_logs(trainer: Any) -> list[dict[str, Any]]:
    return [row for row in trainer.state.log_history if "loss" in row]


def test_healthy_run_logs_the_monitor_scalars_next_to_the_trainers(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(
        every=1, sync=True, dump_dir=tmp_path / "dumps", per_layer=True
    )
    trainer = _trainer(tmp_path, callback, max_grad_norm=1e9)  # norms computed, nothing clipped
    trainer.train()
    rows = _train_logs(trainer)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["gradaudit/stats_step"] == row["step"]
        assert row["gradaudit/nonfinite_tensors"] == 0
        assert row["gradaudit/nan"] == 0
        assert row["gradaudit/global_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)
        assert "gradaudit/norm/classifier.weight" in row
    assert callback.monitor is not None
    assert [r.step for r in callback.monitor.history] == list(range(1, STEPS + 1))
    assert not (tmp_path / "dumps").exists()


def test_precision_logs_the_headroom_of_each_step(tmp_path: Path) -> None:
    """``precision="fp16"`` reaches the monitor, and each row carries the headroom of the
    gradients of its own step, as the monitor recorded it."""
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(
        every=1, dump_dir=None, precision="fp16", on_finding="ignore"
    )
    trainer = _trainer(tmp_path, callback, max_grad_norm=1e9)
    trainer.train()
    rows = _train_logs(trainer)
    assert callback.monitor is not None
    records = {r.step: r for r in callback.monitor.history}
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        headroom = records[row["step"]].headroom
        assert headroom is not None
        total = headroom.total
        assert total.nonzero > 0
        assert row["gradaudit/headroom/fp16/flushed_fraction"] == total.flushed_fraction
        assert row["gradaudit/headroom/fp16/overflowed"] == total.overflowed == 0
        assert row["gradaudit/headroom/fp16/scale_log2"] == total.scale_log2
        assert row["gradaudit/headroom/fp16/flagged_tensors"] == len(headroom.flagged)


def test_stats_are_of_the_gradients_before_the_trainers_clipping(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, dump_dir=None)
    trainer = _trainer(tmp_path, callback, max_grad_norm=0.01)
    trainer.train()
    for row in _train_logs(trainer):
        assert row["grad_norm"] > 0.02  # the Trainer logs the norm before clipping
        assert row["gradaudit/global_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)
    # The clip still happened: the optimizer applied clipped gradients.
    assert "clip_grad_norm_" not in vars(trainer.accelerator)  # the wrapper is gone


POISONED = "transformer.h.1.mlp.c_fc.weight"


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
@pytest.mark.parametrize("value", [math.nan, math.inf, 1e6])
def test_one_bad_element_is_named_in_its_parameter_before_the_clip(
    tmp_path: Path, value: float, max_grad_norm: float
) -> None:
    """transformers 5.x scales every gradient by max_norm / total_norm before
    on_pre_optimizer_step (max_norm=inf with max_grad_norm=0): read there, one NaN showed in
    all 28 tensors, an Inf became NaN beside 27 zeros, and 1e6 read as max_grad_norm."""
    from transformers import TrainerCallback

    from gradaudit.integrations.hf import GradauditTrainerCallback

    model = tiny_hf_gpt2()
    poisoned = [False]

    class Poison(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            poisoned[0] = state.global_step + 1 == 2

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if not poisoned[0]:
            return grad
        grad = grad.clone()
        grad.view(-1)[3] = value
        return grad

    dict(model.named_parameters())[POISONED].register_hook(poison)
    callback = GradauditTrainerCallback(every=1, on_nonfinite="ignore", on_finding="ignore")
    trainer = _trainer(
        tmp_path, callback, attach=False, model=model, max_grad_norm=max_grad_norm, max_steps=2
    )
    trainer.add_callback(Poison())
    trainer.train()
    assert callback.monitor is not None
    record = callback.monitor.history[-1]
    assert record.step == 2
    assert len(record.report.tensors) == 28
    bad = {t.name: t for t in record.report.tensors if t.nonfinite}
    if math.isnan(value):
        assert list(bad) == [POISONED]
        assert (bad[POISONED].nan, bad[POISONED].pos_inf) == (1, 0)
    elif math.isinf(value):
        assert list(bad) == [POISONED]
        assert (bad[POISONED].nan, bad[POISONED].pos_inf) == (0, 1)
    else:
        assert not bad
        assert record.global_norm == pytest.approx(value, rel=1e-6)
        exploding = [f.tensor for f in record.findings if f.kind.value == "exploding"]
        assert exploding == [POISONED]
    assert all(t.norm > 0 for t in record.report.tensors if t.name != POISONED)
    row = _train_logs(trainer)[-1]
    assert row["gradaudit/stats_step"] == 2
    assert row["gradaudit/nonfinite_tensors"] == len(bad)


def test_gradient_accumulation_collects_once_per_optimizer_step(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=2, sync=True, dump_dir=None)
    trainer = _trainer(tmp_path, callback, gradient_accumulation_steps=3, max_grad_norm=1e9)
    trainer.train()
    assert callback.monitor is not None
    assert [r.step for r in callback.monitor.history] == [1, 2, 4]  # the first, multiples
    logged = {row["step"]: row for row in _train_logs(trainer)}
    for step in (1, 2, 4):
        row = logged[step]
        assert row["gradaudit/global_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)
    assert "gradaudit/global_norm" not in logged[3]


def test_nan_raises_before_the_optimizer_applies_it_and_dumps(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, sync=True, on_nonfinite="raise", dump_dir=tmp_path)
    trainer = _trainer(tmp_path, callback, nan_at=3, max_grad_norm=0.0)
    with pytest.raises(NonFiniteGradientError) as error:
        trainer.train()
    assert error.value.step == 3
    assert "classifier.weight" in error.value.tensors
    assert error.value.dump == tmp_path / "step_00000003.safetensors"
    assert error.value.dump.is_file()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nan_with_sync_false_warns_one_step_late_and_training_goes_on(
    tmp_path: Path,
) -> None:
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, sync=False, dump_dir=tmp_path / "dumps")
    trainer = _trainer(tmp_path, callback, nan_at=2, max_grad_norm=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    messages = [str(w.message) for w in caught if w.category is NonFiniteGradientWarning]
    # Learned one call late, at step 3; the NaN was applied, so later steps have NaN too.
    assert messages[0].startswith("step 2: NaN/Inf gradients in ")
    assert "; gradients of step 3 written to " in messages[0]
    assert callback.monitor is not None
    steps = {r.step: r for r in callback.monitor.history}
    assert not steps[1].nonfinite
    assert "classifier.weight" in steps[2].nonfinite
    first_dump = tmp_path / "dumps" / "step_00000003.safetensors"
    from safetensors import safe_open

    with safe_open(str(first_dump), "pt") as dump:
        assert dump.metadata()["nonfinite_step"] == "2"
    assert trainer.state.global_step == STEPS  # training went on
    # A record read one step late is never logged in a later step's row.
    assert not any("gradaudit/global_norm" in row for row in _train_logs(trainer))


def test_every_monitor_option_reaches_the_monitor_locate_included(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, sync=True, dump_dir=None, locate="always")
    _trainer(tmp_path, callback).train()
    assert callback.monitor is not None
    assert [step for step, _ in callback.monitor.locations] == list(range(1, STEPS + 1))
    with pytest.raises(ValueError, match="locate_every"):
        GradauditTrainerCallback(locate_every=0)
    with pytest.raises(TypeError):
        GradauditTrainerCallback(evry=1)  # type: ignore[call-arg]


def test_a_row_carries_the_stats_of_its_own_step_by_default(tmp_path: Path) -> None:
    """Before: sync=False and every=100 by default, so a row at step N showed step
    N - every's stats (or none for 99 steps)."""
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(dump_dir=None)
    trainer = _trainer(tmp_path, callback, logging_steps=2, max_grad_norm=1e9)
    trainer.train()
    rows = [row for row in _train_logs(trainer) if "gradaudit/global_norm" in row]
    assert [row["step"] for row in rows] == [2, 4]
    for row in rows:
        assert row["gradaudit/stats_step"] == row["step"]
        assert row["gradaudit/global_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)
    assert callback.monitor is not None
    assert [r.step for r in callback.monitor.history] == [1, 2, 4]  # the first step too


def test_a_50_step_run_with_every_default_shows_the_stats(tmp_path: Path) -> None:
    """The Trainer's defaults (logging_steps=500) log no training row in 50 steps; the
    end-of-training summary row carries the stats of the last step."""
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback()
    trainer = _trainer(
        tmp_path,
        callback,
        attach=False,
        max_steps=50,
        logging_steps=500,
        max_grad_norm=1.0,
        per_device_train_batch_size=1,
    )
    trainer.train()
    summary = trainer.state.log_history[-1]
    assert "train_runtime" in summary
    assert summary["gradaudit/stats_step"] == 50
    assert summary["gradaudit/global_norm"] > 0
    assert callback.monitor is not None
    assert [r.step for r in callback.monitor.history] == [1, 50]


def test_callbacks_list_reaches_tensorboard_like_attach(tmp_path: Path) -> None:
    """``Trainer(callbacks=[GradauditTrainerCallback()])`` runs after the reporters the Trainer
    adds itself; the callback puts itself first when training begins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, dump_dir=None)
    trainer = _trainer(tmp_path, callback, attach=False, report_to=["tensorboard"])
    trainer.train()
    logs = Path(trainer.args.output_dir)  # the TensorBoardCallback writes below output_dir
    (run,) = {path.parent for path in logs.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "train/gradaudit/global_norm" in tags
    steps = [event.step for event in events.Scalars("train/gradaudit/stats_step")]
    values = [event.value for event in events.Scalars("train/gradaudit/stats_step")]
    assert steps == values == list(range(1, STEPS + 1))


def test_an_lr_30_blow_up_warns_and_is_counted_within_one_every(tmp_path: Path) -> None:
    """Before: the exploding findings sat in record.report, with no warning and no key."""
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=3, dump_dir=None)
    trainer = _trainer(
        tmp_path,
        callback,
        attach=False,
        model=tiny_hf_gpt2(),
        learning_rate=30.0,
        max_steps=3,
        logging_steps=3,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    found = [str(w.message) for w in caught if w.category is GradientFindingWarning]
    assert any(m.startswith("step 3: ") and "exploding transformer." in m for m in found)
    (row,) = [row for row in _train_logs(trainer) if row["step"] == 3]
    assert row["gradaudit/findings/exploding"] >= 1
    assert row["gradaudit/global_norm"] > 100

    raising = GradauditTrainerCallback(every=3, on_finding="raise", dump_dir=tmp_path / "dumps")
    trainer = _trainer(tmp_path, raising, model=tiny_hf_gpt2(), learning_rate=30.0, max_steps=3)
    with pytest.raises(GradientFindingError) as error:
        trainer.train()
    assert error.value.step == 3
    assert any(kind == "exploding" for kind, _ in error.value.findings)
    assert error.value.dump == tmp_path / "dumps" / "step_00000003.safetensors"


def test_a_clip_that_bypasses_the_accelerator_is_said_once(tmp_path: Path) -> None:
    """A Trainer whose clip does not go through accelerator.clip_grad_norm_ (transformers'
    mixed-mesh DTensor path, a subclass): the stats are read after it, and the callback
    says so once."""
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, dump_dir=None)
    trainer = _trainer(tmp_path, callback, max_grad_norm=0.01)

    def own_clip(model: Any, max_norm: float | None = None) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)

    trainer._clip_grad_norm = own_clip
    trainer._get_grad_norm = lambda model, grad_norm=None: grad_norm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [
        str(w.message) for w in caught if "without accelerator.clip_grad_norm_" in str(w.message)
    ]
    assert len(said) == 1
    assert "max_grad_norm=0.01" in said[0]
    for row in _train_logs(trainer):
        assert row["gradaudit/global_norm"] == pytest.approx(0.01, rel=1e-4)  # after the clip


@pytest.mark.cuda
@requires_cuda
def test_fp16_gradients_are_read_unscaled_before_the_clip_and_unscaled_once(
    tmp_path: Path,
) -> None:
    """fp16 with a GradScaler: the callback unscales before the clip and the clip's own
    unscale is skipped (a GradScaler refuses a second unscale_ in one step); the norms
    the Trainer logs (unscaled, before clipping) are the callback's."""
    from gradaudit.integrations.hf import GradauditTrainerCallback

    callback = GradauditTrainerCallback(every=1, on_nonfinite="ignore", on_finding="ignore")
    trainer = _trainer(
        tmp_path,
        callback,
        attach=False,
        model=tiny_hf_gpt2(),
        max_grad_norm=1.0,
        fp16=True,
        use_cpu=False,
    )
    assert trainer.accelerator.scaler is not None
    trainer.train()  # a second unscale_ in one step would raise here
    rows = [row for row in _train_logs(trainer) if math.isfinite(row.get("grad_norm", math.nan))]
    assert rows
    for row in rows:
        assert row["gradaudit/global_norm"] == pytest.approx(row["grad_norm"], rel=1e-3)
