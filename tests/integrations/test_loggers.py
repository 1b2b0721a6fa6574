"""Monitor records into TensorBoard and Weights & Biases (offline), with the real libraries.

A NaN is injected at a known step of a plain loop; the TensorBoard event file is read
back with TensorBoard's own reader, and the W&B run works offline under ``tmp_path``
(``WANDB_MODE=offline``: nothing touches the network).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from gradaudit import GradientMonitor, MonitorRecord

#: Slow (not in the quick loop): trains tiny models with TensorBoard and W&B writing.
pytestmark = pytest.mark.slow

NAN_STEP = 2
STEPS = 4


def _records() -> list[MonitorRecord]:
    """Four collected steps of a small model; step ``NAN_STEP`` has a NaN in ``1.bias``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore")
    records = []
    for step in range(STEPS):
        model.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        if step == NAN_STEP:
            model[2].bias.grad[0] = math.nan
        record = monitor.step()
        assert record is not None
        records.append(record)
    return records


def test_tensorboard_gets_scalars_and_the_norm_histogram_per_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradaudit.integrations.loggers import TensorBoardLogger, log_record

    records = _records()
    logger = TensorBoardLogger(tmp_path / "tb")
    for record in records:
        log_record(logger, record)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert "gradaudit/log10_norms" in tags["histograms"]
    assert {"gradaudit/global_norm", "gradaudit/norm/0.weight", "gradaudit/nan"} <= set(
        tags["scalars"]
    )
    nonfinite = [(e.step, e.value) for e in events.Scalars("gradaudit/nonfinite_tensors")]
    assert nonfinite == [(s, 1.0 if s == NAN_STEP else 0.0) for s in range(STEPS)]
    norms = [e.value for e in events.Scalars("gradaudit/global_norm")]
    assert norms == pytest.approx(
        [r.global_norm for r in records], rel=1e-6, nan_ok=True
    )  # float32
    histograms = events.Histograms("gradaudit/log10_norms")
    assert [h.step for h in histograms] == list(range(STEPS))
    assert histograms[0].histogram_value.num == len(records[0].report.tensors)


def test_wandb_offline_run_gets_the_same_scalars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    from gradaudit.integrations.loggers import WandbLogger, log_record

    records = _records()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        run = wandb.init(project="gradaudit-test", dir=str(tmp_path), mode="offline")
    try:
        logger = WandbLogger()
        assert logger.run is run
        logged = [log_record(logger, record) for record in records]
        summary = dict(run.summary)
        rows = run.step  # W&B's own count of history rows committed
    finally:
        run.finish()
    assert rows == len(records)  # one row per record, scalars and histogram together
    assert "gradaudit/log10_norms" in summary
    assert logged[NAN_STEP]["gradaudit/nonfinite_tensors"] == 1.0
    assert logged[NAN_STEP]["gradaudit/nan"] == 1.0
    last = records[-1]
    assert summary["gradaudit/global_norm"] == last.global_norm  # finite: the NaN was step 2
    assert summary["gradaudit/stats_step"] == last.step
    assert summary["gradaudit/norm/2.bias"] == last.norms["2.bias"]
    assert summary["gradaudit/step"] == last.step
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_wandb_logger_without_a_run_says_what_to_do() -> None:
    import wandb

    from gradaudit.integrations.loggers import WandbLogger

    assert wandb.run is None
    with pytest.raises(ValueError, match=r"call wandb\.init"):
        WandbLogger()
