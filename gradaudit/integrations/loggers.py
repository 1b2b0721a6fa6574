"""Monitor records to experiment trackers: one small interface, one class per tracker.

A tracker is anything with ``log_scalars(values, step)`` and, optionally,
``log_histogram(name, values, step)`` (:class:`ScalarLogger`); a tracker whose every call
is a row of its own (W&B: each ``run.log`` is a history row) also has
``log_row(values, histograms, step)``, which :func:`log_record` then calls once per record.
:func:`log_record` turns a :class:`~gradaudit.MonitorRecord` into the shared scalars
(:mod:`.scalars`) and hands them over; the two classes here only translate that call for
TensorBoard's ``SummaryWriter`` and for a Weights & Biases run. Each imports its library
when it is created, not before.

The histogram is of the per-parameter gradient norms (``log10``), which the record already
holds: one value per parameter, so it costs nothing next to the training step. Histograms
of gradient *values* would need a second pass over every gradient and are not offered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gradaudit.integrations.scalars import PREFIX, record_scalars
from gradaudit.training.record import MonitorRecord

__all__ = ["ScalarLogger", "TensorBoardLogger", "WandbLogger", "log_record"]

#: The W&B metric that holds the step (see :class:`WandbLogger`).
STEP_KEY = f"{PREFIX}/step"


@runtime_checkable
class ScalarLogger(Protocol):
    """Where :func:`log_record` sends scalars; implement it for any other tracker."""

    def log_scalars(self, values: Mapping[str, float], step: int) -> None: ...


def log_record(
    logger: ScalarLogger,
    record: MonitorRecord,
    *,
    step: int | None = None,
    per_layer: bool = True,
    histogram: bool = True,
) -> dict[str, float]:
    """Log ``record`` at ``step`` (default: the step its stats describe); return the scalars.

    With ``histogram`` and a logger that has ``log_histogram``, the ``log10`` of the
    non-zero per-parameter norms go to ``gradaudit/log10_norms``.
    """
    at = record.step if step is None else step
    values = record_scalars(record, per_layer=per_layer)
    histograms: dict[str, list[float]] = {}
    if histogram:
        norms = [math.log10(t.norm) for t in record.report.tensors if t.norm > 0]
        if norms:
            histograms[f"{PREFIX}/log10_norms"] = norms
    log_row = getattr(logger, "log_row", None)
    if log_row is not None:  # one call, one row
        log_row(values, histograms, at)
        return values
    logger.log_scalars(values, at)
    log_histogram = getattr(logger, "log_histogram", None)
    if log_histogram is not None:
        for name, logged in histograms.items():
            log_histogram(name, logged, at)
    return values


class TensorBoardLogger:
    """Scalars and the norm histogram into a ``torch.utils.tensorboard.SummaryWriter``.

    Give it your writer, or a log directory to make one (``pip install
    'gradaudit[tensorboard]'``). ``close()`` closes a writer it made itself.
    """

    def __init__(self, writer: Any | str | Path) -> None:
        self._owned = isinstance(writer, str | Path)
        if self._owned:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(writer))
        self.writer: Any = writer

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def log_histogram(self, name: str, values: Sequence[float], step: int) -> None:
        import numpy as np

        self.writer.add_histogram(name, np.asarray(values, dtype=np.float64), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.flush()
        if self._owned:
            self.writer.close()


class WandbLogger:
    """Scalars and the norm histogram into a Weights & Biases run (``[wandb]`` extra).

    ``run`` defaults to the active ``wandb.run``. The step goes into a metric of its own,
    ``gradaudit/step``, declared as the x-axis of every ``gradaudit/*`` key, rather than
    into W&B's global step: W&B drops a row whose step is below one already logged, which
    a Trainer logging on its own would otherwise cause. Works the same offline
    (``WANDB_MODE=offline``): nothing here needs the network.
    """

    def __init__(self, run: Any | None = None) -> None:
        import wandb

        self._wandb = wandb
        active: Any = run if run is not None else wandb.run
        if active is None:
            raise ValueError("no W&B run: call wandb.init(...) first or pass run=")
        self.run: Any = active
        self.run.define_metric(STEP_KEY)
        self.run.define_metric(f"{PREFIX}/*", step_metric=STEP_KEY)

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        self.run.log({**values, STEP_KEY: step})

    def log_histogram(self, name: str, values: Sequence[float], step: int) -> None:
        self.run.log({name: self._wandb.Histogram(list(values)), STEP_KEY: step})

    def log_row(
        self, values: Mapping[str, float], histograms: Mapping[str, Sequence[float]], step: int
    ) -> None:
        """The scalars and histograms of one record in one ``run.log``: one history row.

        (``log_scalars`` then ``log_histogram`` would be two rows per record, each missing
        half the keys.)
        """
        row: dict[str, Any] = {**values, STEP_KEY: step}
        row.update({name: self._wandb.Histogram(list(h)) for name, h in histograms.items()})
        self.run.log(row)
