"""A Lightning ``Callback`` over :class:`~gradaudit.GradientMonitor`.

``pip install 'gradaudit[lightning]'``. Lightning calls ``on_before_optimizer_step``
once per optimizer step, after the backward pass (and after gradient accumulation, and
after AMP unscaling) and *before* gradient clipping, in automatic and in manual
optimization alike (``self.optimizers().step()`` goes through it). So:

* the stats are of the unclipped gradients (Lightning clips after this hook);
* each optimizer gets its own monitor over the parameters it updates (named as in
  ``pl_module.named_parameters()``), and its own step count (that optimizer's steps,
  from 0), so ``every`` means the same with one optimizer or several (a GAN's two);
* the scalars (:mod:`gradaudit.integrations.scalars`) go through ``pl_module.log`` with
  ``on_step=True``, so every Lightning logger receives them. With several optimizers
  the keys carry the optimizer's index: ``gradaudit/optimizer_1/global_norm``;
* **fresh**: a record is logged only on a step Lightning writes to its loggers, and only
  if it is that step's own (``sync=True`` by default): a value ``pl_module.log`` holds is
  written again at later logging steps, so an older record is never handed to it;
* by default (``every=None``) it collects the steps Lightning logs (``log_every_n_steps``)
  and the first; ``every=N`` collects the first step and multiples of ``N``;
* under a DDP strategy (``strategy="ddp"``, ``"ddp_spawn"`` …) the callback finds the
  ``DistributedDataParallel`` wrapper in ``trainer.strategy.model``, and every collected
  step checks that each optimizer's gradients are bit-identical on every rank
  (``on_divergence``; :mod:`gradaudit.training.replicas`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback

from gradaudit.integrations.scalars import PREFIX, record_scalars
from gradaudit.training.monitor import AdapterOptions, GradientMonitor
from gradaudit.training.record import MonitorRecord

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GradauditCallback", "GradauditLightningCallback"]


class GradauditLightningCallback(Callback):  # type: ignore[misc,unused-ignore]
    """Gradient stats every ``every`` steps of each optimizer; ``options`` as the monitor's.

    Every :class:`~gradaudit.training.monitor.AdapterOptions` key is passed through
    with the monitor's defaults but ``sync=True``. ``every=None`` collects the steps
    Lightning logs and the first; ``every=N`` the first and multiples of ``N`` (each
    optimizer's own steps, from 0). ``locate`` needs the module itself, so it works
    with one optimizer (its monitor then watches ``pl_module``); with several it
    is refused at the first step.

    ``per_layer`` logs one ``gradaudit/norm/<parameter>`` key per parameter too;
    ``log=False`` logs nothing (the records are in :attr:`monitors`' histories).
    """

    def __init__(
        self,
        *,
        every: int | None = None,
        per_layer: bool = False,
        log: bool = True,
        **options: Unpack[AdapterOptions],
    ) -> None:
        super().__init__()
        if every is not None and every < 1:
            raise ValueError("every must be >= 1 (or None: the steps Lightning logs)")
        self.every = every
        options.setdefault("sync", True)
        dump_dir = options.pop("dump_dir", "grad_dumps")
        self._options = options
        self._monitor_over(torch.nn.Module(), None)  # the monitor's own checks, now
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self.per_layer = per_layer
        self.log_metrics = log
        #: One monitor per optimizer, by its index in ``trainer.optimizers``.
        self.monitors: dict[int, GradientMonitor] = {}
        self._steps: dict[int, int] = {}  # the next step of each optimizer's monitor

    def on_before_optimizer_step(
        self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer
    ) -> None:
        index = _optimizer_index(trainer.optimizers, optimizer)
        several = len(trainer.optimizers) > 1
        monitor = self.monitors.get(index)
        if monitor is None:
            monitor = self._monitor(pl_module, optimizer, index if several else None)
            # DDP strategies wrap the module; the callback is handed the module itself.
            monitor.find_replicas([getattr(getattr(trainer, "strategy", None), "model", None)])
            self.monitors[index] = monitor
        step = self._steps.get(index, 0)
        self._steps[index] = step + 1
        logged = _lightning_logs_this_step(trainer)
        collect = step == 0 or (logged if self.every is None else step % self.every == 0)
        record = monitor.step(step, collect=collect)
        if record is not None and record.step == step and logged and self.log_metrics:
            self._log(pl_module, record, f"{PREFIX}/optimizer_{index}" if several else PREFIX)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        """Forget the values logged at an earlier step: Lightning would write them again."""
        _forget_logged(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        for monitor in self.monitors.values():
            monitor.flush()

    def _monitor(
        self, pl_module: Any, optimizer: torch.optim.Optimizer, index: int | None
    ) -> GradientMonitor:
        """A monitor over the parameters ``optimizer`` updates, by their module names."""
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        model: Any = [(n, p) for n, p in pl_module.named_parameters() if id(p) in mine]
        if self._options.get("locate", "off") != "off":
            if index is not None:
                raise ValueError(
                    "locate needs one optimizer over the whole module; this LightningModule "
                    "has several: drop locate=, or call GradientMonitor yourself"
                )
            model = pl_module
        dump_dir = self.dump_dir
        if dump_dir is not None and index is not None:
            dump_dir = dump_dir / f"optimizer_{index}"
        return self._monitor_over(model, dump_dir)

    def _monitor_over(self, model: Any, dump_dir: Path | None) -> GradientMonitor:
        options = self._options.copy()
        options["dump_dir"] = dump_dir
        return GradientMonitor(model, every=self.every or 1, **options)

    def _log(self, pl_module: Any, record: MonitorRecord, prefix: str) -> None:
        for name, value in record_scalars(record, per_layer=self.per_layer, prefix=prefix).items():
            pl_module.log(name, value, on_step=True, on_epoch=False)


def _lightning_logs_this_step(trainer: Any) -> bool:
    """Whether Lightning writes this batch's ``on_step`` metrics to its loggers.

    The logger connector's ``should_update_logs`` (``log_every_n_steps``, the last step);
    ``True`` where a Lightning version lacks it, so nothing is lost.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def _forget_logged(trainer: Any) -> None:
    """Reset the ``gradaudit/*`` values Lightning's result collection holds.

    ``pl_module.log(on_step=True)`` values stay there and are written at every later logging
    step until logged again; a reset one is skipped (``has_reset``). Private Lightning
    state, read defensively: where it differs, nothing is reset.
    """
    results = getattr(trainer, "_results", None)
    if not isinstance(results, dict):
        return
    for item in results.values():
        name = getattr(getattr(item, "meta", None), "name", "")
        if isinstance(name, str) and name.startswith(f"{PREFIX}/") and hasattr(item, "reset"):
            item.reset()


def _optimizer_index(optimizers: list[Any], optimizer: Any) -> int:
    """Where ``optimizer`` (or the optimizer a ``LightningOptimizer`` wraps) is in the list."""
    for index, candidate in enumerate(optimizers):
        if candidate is optimizer or getattr(candidate, "optimizer", None) is optimizer:
            return index
    return len(optimizers)  # not one the trainer knows (a user-made optimizer): its own slot


#: The name this class had before the Transformers and Lightning callbacks got names of
#: their own (both were ``GradauditCallback``); kept so existing imports keep working.
GradauditCallback = GradauditLightningCallback
