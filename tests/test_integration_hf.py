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

from gradaudit import NonFiniteGradientError, NonFiniteGradientWarning
from tests.models import tiny_hf_bert

STEPS = 4


def _trainer(tmp_path: Path, callback: Any, *, nan_at: int | None = None, **args: Any) -> Any:
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    model = tiny_hf_bert()

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(index)
            return {
                "input_ids": torch.randint(0, 50, (8,), generator=gen),
                "labels": torch.tensor(index % 2),
            }

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
    trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=Data())
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
    from gradaudit.integrations.hf import GradauditCallback

    callback = GradauditCallback(every=1, sync=True, dump_dir=tmp_path / "dumps", per_layer=True)
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


def test_stats_are_of_the_clipped_gradients_the_optimizer_applies(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditCallback

    callback = GradauditCallback(every=1, sync=True, dump_dir=None)
    trainer = _trainer(tmp_path, callback, max_grad_norm=0.01)
    trainer.train()
    for row in _train_logs(trainer):
        assert row["grad_norm"] > 0.02  # the Trainer logs the norm before clipping
        assert row["gradaudit/global_norm"] == pytest.approx(0.01, rel=1e-4)


def test_gradient_accumulation_collects_once_per_optimizer_step(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditCallback

    callback = GradauditCallback(every=2, sync=True, dump_dir=None)
    trainer = _trainer(tmp_path, callback, gradient_accumulation_steps=3, max_grad_norm=1e9)
    trainer.train()
    assert callback.monitor is not None
    assert [r.step for r in callback.monitor.history] == [2, 4]
    logged = {row["step"]: row for row in _train_logs(trainer)}
    for step in (2, 4):
        row = logged[step]
        assert row["gradaudit/global_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)
    assert "gradaudit/global_norm" not in logged[1]


def test_nan_raises_before_the_optimizer_applies_it_and_dumps(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditCallback

    callback = GradauditCallback(every=1, sync=True, on_nonfinite="raise", dump_dir=tmp_path)
    trainer = _trainer(tmp_path, callback, nan_at=3, max_grad_norm=0.0)
    with pytest.raises(NonFiniteGradientError) as error:
        trainer.train()
    assert error.value.step == 3
    assert "classifier.weight" in error.value.tensors
    assert error.value.dump == tmp_path / "step_00000003.safetensors"
    assert error.value.dump.is_file()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nan_in_the_default_mode_warns_one_step_late_and_training_goes_on(
    tmp_path: Path,
) -> None:
    from gradaudit.integrations.hf import GradauditCallback

    callback = GradauditCallback(every=1, dump_dir=tmp_path / "dumps")
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
    row = next(r for r in _train_logs(trainer) if r.get("gradaudit/stats_step") == 2)
    assert row["gradaudit/nonfinite_tensors"] == len(steps[2].nonfinite)


def test_every_monitor_option_reaches_the_monitor_locate_included(tmp_path: Path) -> None:
    from gradaudit.integrations.hf import GradauditCallback

    callback = GradauditCallback(every=1, sync=True, dump_dir=None, locate="always")
    _trainer(tmp_path, callback).train()
    assert callback.monitor is not None
    assert [step for step, _ in callback.monitor.locations] == list(range(1, STEPS + 1))
    with pytest.raises(ValueError, match="locate_every"):
        GradauditCallback(locate_every=0)
    with pytest.raises(TypeError):
        GradauditCallback(evry=1)  # type: ignore[call-arg]
