"""A Hugging Face ``transformers`` ``TrainerCallback`` over :class:`~gradaudit.GradientMonitor`.

``pip install 'gradaudit[transformers]'``. The callback builds a monitor over the
Trainer's model when training begins and calls ``monitor.step()`` from the Trainer's
``on_pre_optimizer_step`` event, which fires once per optimizer step:

* after gradient accumulation: on a ``gradient_accumulation_steps=4`` run it fires after
  the fourth backward, so the stats are of the accumulated gradients;
* after the Trainer's own clipping (``max_grad_norm``) and after mixed-precision
  unscaling: the stats are of the gradients the optimizer is about to apply. The
  Trainer's logged ``grad_norm`` is the norm *before* clipping, so the two differ exactly
  when clipping happened;
* before ``optimizer.step()``: with ``sync=True`` and ``on_nonfinite="raise"`` the
  exception stops training before a NaN gradient is applied.

The event exists since ``transformers`` 4.45; on older versions it is never called, so
the callback refuses to start rather than silently collect nothing.

Steps are numbered like the Trainer's logs: the optimizer step being taken is
``state.global_step + 1``, and ``every`` counts those. The monitor's scalars
(:mod:`gradaudit.integrations.scalars`) are added to each Trainer log entry (its
``log_history`` row and the ``logs`` the reporting callbacks receive): put this callback
first (:meth:`GradauditCallback.attach`) so TensorBoard or W&B reporters see them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from gradaudit.integrations.scalars import record_scalars
from gradaudit.training.monitor import GradientMonitor, MonitorOptions, MonitorRecord

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments
    from typing_extensions import Unpack

__all__ = ["GradauditCallback"]


class GradauditCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Gradient stats every ``every`` optimizer steps; ``options`` as :class:`GradientMonitor`'s.

    Every monitor option (``every``, ``dump_dir``, ``on_nonfinite``, ``sync``,
    ``locate``, …: :class:`~gradaudit.training.monitor.MonitorOptions`) is passed
    through, with the monitor's defaults.

    ``per_layer`` adds one ``gradaudit/norm/<parameter>`` key per parameter to the logs.
    The monitor is :attr:`monitor` once training has begun.
    """

    def __init__(self, *, per_layer: bool = False, **options: Unpack[MonitorOptions]) -> None:
        if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
            import transformers

            raise RuntimeError(
                f"transformers {transformers.__version__} has no on_pre_optimizer_step event "
                "(added in 4.45): upgrade it, or call GradientMonitor.step() yourself"
            )
        self._options = options
        GradientMonitor(torch.nn.Module(), **options)  # the monitor's own checks, now
        self.per_layer = per_layer
        self.monitor: GradientMonitor | None = None
        self._unlogged: MonitorRecord | None = None

    def attach(self, trainer: Trainer) -> GradauditCallback:
        """Add this callback ahead of the Trainer's others, so reporters see its keys."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise RuntimeError("the Trainer passed no model to on_train_begin")
        self.monitor = GradientMonitor(model, **self._options)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        assert self.monitor is not None, "on_train_begin was not called"
        record = self.monitor.step(state.global_step + 1)
        if record is not None:
            self._unlogged = record

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._unlogged is None or logs is None or "loss" not in logs:
            return  # only training-step logs, not eval or the end-of-train summary
        values = record_scalars(self._unlogged, per_layer=self.per_layer)
        self._unlogged = None
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is not None:
            self.monitor.flush()
