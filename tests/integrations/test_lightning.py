"""The Lightning callback, with the real Lightning Trainer on the CPU.

Metrics are read back from Lightning's own ``CSVLogger`` (any logger receives what
``pl_module.log`` sends). The reference for the norms is a plain float64 computation
over the gradients the module saw, recorded by the module itself before each step.
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import NonFiniteGradientError, NonFiniteGradientWarning

#: Slow (not in the quick loop): trains tiny models under the real Lightning Trainer.
pytestmark = pytest.mark.slow

STEPS = 4


def _data() -> Any:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen)
    y = torch.randn(64, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _float64_norm(module: torch.nn.Module) -> float:
    return math.sqrt(
        sum(float((p.grad.double() ** 2).sum()) for p in module.parameters() if p.grad is not None)
    )


def _automatic(nan_at: int | None = None) -> Any:
    import lightning.pytorch as pl

    class Regressor(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
            )
            self.seen: dict[int, float] = {}
            self.calls = 0

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if nan_at is not None and self.calls == nan_at:
                loss = loss + self.net[2].bias.sum() * math.nan  # one NaN gradient
            self.calls += 1
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.seen[self.calls - 1] = _float64_norm(self.net)  # runs after the callbacks'

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regressor()


def _fit(tmp_path: Path, module: Any, callback: Any, **options: Any) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": STEPS,
        "logger": CSVLogger(str(tmp_path / "logs"), name="run", version=0),
        "callbacks": [callback],
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
    }
    settings.update(options)
    trainer = pl.Trainer(**settings)
    with warnings.catch_warnings():
        # Lightning's advice about workers and log intervals; gradaudit's own warnings
        # (RuntimeWarning subclasses) still reach the test.
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        trainer.fit(module, _data())
    return trainer


def _metrics(tmp_path: Path) -> list[dict[str, str]]:
    with (tmp_path / "logs" / "run" / "version_0" / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def test_logged_norms_match_a_float64_reference_in_every_logger_row(tmp_path: Path) -> None:
    from gradaudit.integrations.lightning import GradauditLightningCallback

    callback = GradauditLightningCallback(every=1, sync=True, dump_dir=None, per_layer=True)
    module = _automatic()
    _fit(tmp_path, module, callback)
    rows = [row for row in _metrics(tmp_path) if row.get("gradaudit/global_norm")]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    for row in rows:
        step = int(float(row["gradaudit/stats_step"]))
        assert float(row["gradaudit/global_norm"]) == pytest.approx(module.seen[step], rel=1e-6)
        assert float(row["gradaudit/nonfinite_tensors"]) == 0
        assert float(row["gradaudit/norm/net.0.weight"]) > 0


def test_stats_are_before_lightnings_gradient_clipping(tmp_path: Path) -> None:
    from gradaudit.integrations.lightning import GradauditLightningCallback

    callback = GradauditLightningCallback(every=1, sync=True, dump_dir=None)
    module = _automatic()
    _fit(tmp_path, module, callback, gradient_clip_val=1e-3)
    (monitor,) = callback.monitors.values()
    for record in monitor.history:
        assert record.global_norm > 1e-2
        assert record.global_norm == pytest.approx(module.seen[record.step], rel=1e-6)


def test_nan_at_a_known_step_raises_and_dumps(tmp_path: Path) -> None:
    from gradaudit.integrations.lightning import GradauditLightningCallback

    callback = GradauditLightningCallback(
        every=1, sync=True, on_nonfinite="raise", dump_dir=tmp_path
    )
    module = _automatic(nan_at=2)
    with pytest.raises(NonFiniteGradientError) as error:
        _fit(tmp_path, module, callback)
    assert error.value.step == 2
    assert error.value.tensors == ("net.2.bias",)
    assert error.value.dump == tmp_path / "step_00000002.safetensors"
    assert error.value.dump.is_file()
    assert all(torch.isfinite(p).all() for p in module.parameters())  # never applied


def test_manual_optimization_with_two_optimizers(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from gradaudit.integrations.lightning import GradauditLightningCallback

    class TwoNets(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.first = torch.nn.Linear(6, 1)
            self.second = torch.nn.Linear(6, 1)
            self.seen: list[tuple[float, float]] = []

        def training_step(self, batch: Any, index: int) -> None:
            x, y = batch
            opt_a, opt_b = self.optimizers()
            loss_a = torch.nn.functional.mse_loss(self.first(x), y)
            opt_a.zero_grad()
            self.manual_backward(loss_a)
            if self.global_step // 2 == 1:  # the second step of the first optimizer
                self.first.bias.grad.fill_(math.inf)
            norm_a = _float64_norm(self.first)
            before = self.first.bias.detach().clone()
            opt_a.step()
            with torch.no_grad():  # SGD applied the Inf (as NaN): undo it, keep the run finite
                self.first.bias.copy_(before)
            loss_b = torch.nn.functional.mse_loss(self.second(x), y) * 3
            opt_b.zero_grad()
            self.manual_backward(loss_b)
            self.seen.append((norm_a, _float64_norm(self.second)))
            opt_b.step()

        def configure_optimizers(self) -> Any:
            return (
                torch.optim.SGD(self.first.parameters(), lr=0.0),
                torch.optim.SGD(self.second.parameters(), lr=0.1),
            )

    callback = GradauditLightningCallback(every=1, sync=True, on_nonfinite="warn", dump_dir=None)
    module = TwoNets()
    with pytest.warns(
        NonFiniteGradientWarning, match=r"step 1: NaN/Inf gradients in 1 tensor: first\.bias"
    ):
        _fit(tmp_path, module, callback, max_steps=2 * 3)
    first, second = callback.monitors[0], callback.monitors[1]
    assert [r.step for r in first.history] == [0, 1, 2]
    assert set(first.history[0].norms) == {"first.weight", "first.bias"}
    assert set(second.history[0].norms) == {"second.weight", "second.bias"}
    assert [r.nonfinite for r in first.history] == [(), ("first.bias",), ()]
    for (norm_a, norm_b), a, b in zip(module.seen, first.history, second.history, strict=True):
        assert b.global_norm == pytest.approx(norm_b, rel=1e-6)
        if not a.nonfinite:
            assert a.global_norm == pytest.approx(norm_a, rel=1e-6)
    keys = set().union(*(row.keys() for row in _metrics(tmp_path)))
    assert {"gradaudit/optimizer_0/global_norm", "gradaudit/optimizer_1/global_norm"} <= keys


def test_every_monitor_option_reaches_the_monitor_locate_included(tmp_path: Path) -> None:
    from gradaudit.integrations.lightning import GradauditLightningCallback

    callback = GradauditLightningCallback(
        every=1, sync=True, dump_dir=None, locate="always", on_nonfinite="ignore", history=2
    )
    _fit(tmp_path, _automatic(), callback)
    (monitor,) = callback.monitors.values()
    assert [step for step, _ in monitor.locations] == [STEPS - 2, STEPS - 1]
    assert not any(location.found for _, location in monitor.locations)
    with pytest.raises(ValueError, match="locate must be"):
        GradauditLightningCallback(locate="sometimes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        GradauditLightningCallback(evry=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("settings", [{}, {"every_n_train_steps": 2, "save_top_k": -1}])
def test_a_healthy_runs_lightning_checkpoints_pass_the_gate(
    tmp_path: Path, settings: dict[str, int]
) -> None:
    """Files Lightning's own ``ModelCheckpoint`` writes (the default, and every 2 steps keeping
    all): its bookkeeping (``kth_value = inf`` before any top-k exists) is listed as skipped,
    never judged, and the model and optimizer state are audited."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gradaudit import scan_paths
    from gradaudit.results.verdict import exit_code

    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", **settings)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,  # the default ModelCheckpoint saves at an epoch's end
        logger=False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        trainer.fit(_automatic(), _data())
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert files
    report = scan_paths([str(f) for f in files])
    assert exit_code(report) == 0, [f.message for f in report.findings if f.failing]
    reasons = {s.name: s.reason for s in report.skipped if s.source == str(files[0])}
    assert "Lightning callback state" in reasons["callbacks"]
    assert not any(t.name.startswith("callbacks") for t in report.tensors)
    assert any(t.name.startswith("state_dict.net.") for t in report.tensors)


def test_a_row_carries_the_stats_of_its_own_step_and_old_ones_are_not_rewritten(
    tmp_path: Path,
) -> None:
    """Before: a record read one collected step late was logged, and Lightning wrote the
    value it held again at every later logging step (stats of step 3 in the rows of 5 and 7)."""
    from gradaudit.integrations.lightning import GradauditLightningCallback

    callback = GradauditLightningCallback(every=3, dump_dir=None)
    _fit(tmp_path, _automatic(), callback, max_steps=10, log_every_n_steps=2)
    rows = [row for row in _metrics(tmp_path) if row.get("gradaudit/global_norm")]
    assert [(int(row["step"]), float(row["gradaudit/stats_step"])) for row in rows] == [
        (3, 3.0),
        (9, 9.0),
    ]
    (monitor,) = callback.monitors.values()
    assert [r.step for r in monitor.history] == [0, 3, 6, 9]


def test_a_50_step_run_with_the_defaults_logs_the_stats(tmp_path: Path) -> None:
    """Lightning logs every 50 steps by default; the callback collects those steps (and the
    first). Before: every=100 from step 0, read one collected step late: no row at all."""
    from gradaudit.integrations.lightning import GradauditLightningCallback

    callback = GradauditLightningCallback(dump_dir=None)
    module = _automatic()
    _fit(tmp_path, module, callback, max_steps=50, log_every_n_steps=50)
    rows = [row for row in _metrics(tmp_path) if row.get("gradaudit/global_norm")]
    assert [int(row["step"]) for row in rows] == [49]
    assert float(rows[0]["gradaudit/stats_step"]) == 49
    assert float(rows[0]["gradaudit/global_norm"]) == pytest.approx(module.seen[49], rel=1e-6)
    assert float(rows[0]["gradaudit/findings/exploding"]) == 0
