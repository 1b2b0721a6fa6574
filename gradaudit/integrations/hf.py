"""A Hugging Face ``transformers`` ``TrainerCallback`` over :class:`~gradaudit.GradientMonitor`.

``pip install 'gradaudit[transformers]'``. The callback builds a monitor over the
Trainer's model when training begins and collects once per optimizer step, after
gradient accumulation:

* **before the Trainer's clipping.** ``transformers`` 5.x calls
  ``accelerator.clip_grad_norm_`` on every optimizer step (with ``max_norm=inf`` when
  ``max_grad_norm=0``, to log ``grad_norm``), *before* ``on_pre_optimizer_step``; that call
  multiplies every gradient by ``max_norm / total_norm``, so one NaN gradient makes them all
  NaN and an explosion reads as ``max_grad_norm``. While training, the callback wraps that
  one method on the Trainer's own accelerator (restored when training ends) and reads the
  gradients inside it, after fp16 unscaling and before the clip: a NaN is named in its
  parameter, an Inf stays an Inf, an explosion keeps its size. Where the clip does not go
  through it (DeepSpeed clips and steps inside ``backward``; ``transformers``' mixed-mesh
  DTensor path), the callback says so once and reads at ``on_pre_optimizer_step``.
* **fresh.** A record goes into the log row of its own step or into none: with the
  default ``sync=True`` it is read when collected (one device sync per collected step).
* **the steps the Trainer logs**, by default (``every=None``): the steps of
  ``logging_steps``, the first step and the last (whose stats go into the end-of-training
  summary row), so a 50-step run with the Trainer's defaults (``logging_steps=500``) still
  shows them. ``every=N`` collects the first step and multiples of ``N`` instead.

* **every rank's replicated gradients alike**, under DDP (``torchrun`` on several processes):
  the Trainer hands callbacks the module DDP wraps, so the callback finds the wrapper in
  ``trainer.model_wrapped`` and every collected step checks that the gradients are
  bit-identical on every rank (``on_divergence``; :mod:`gradaudit.training.replicas`).

The monitor's scalars (:mod:`gradaudit.integrations.scalars`) are added to the log row of
their step (its ``log_history`` entry and the ``logs`` the reporting callbacks receive). The
callback moves itself ahead of the Trainer's other callbacks when training begins, so
TensorBoard or W&B reporters see its keys whether it came through ``Trainer(callbacks=[…])``
or :meth:`GradauditTrainerCallback.attach`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainerCallback

from gradaudit.integrations.scalars import record_scalars
from gradaudit.training.monitor import AdapterOptions, GradientMonitor
from gradaudit.training.record import MonitorRecord

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from typing_extensions import Unpack

__all__ = ["GradauditCallback", "GradauditTrainerCallback"]

#: How far up the call stack ``on_train_begin`` looks for the Trainer that called it
#: (CallbackHandler.call_event, CallbackHandler.on_train_begin, the training loop).
_STACK_DEPTH = 8


class GradauditTrainerCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Gradient stats of the steps the Trainer logs; ``options`` as :class:`GradientMonitor`'s.

    Every monitor option but ``every`` (``dump_dir``, ``on_nonfinite``, ``on_finding``,
    ``sync``, ``locate``, …: :class:`~gradaudit.training.monitor.AdapterOptions`) is passed
    through, with the monitor's defaults except ``sync=True`` (fresh rows). ``every=None``
    collects the steps the Trainer logs, the first and the last; ``every=N`` the first step
    and multiples of ``N``.

    ``per_layer`` adds one ``gradaudit/norm/<parameter>`` key per parameter to the logs.
    The monitor is :attr:`monitor` once training has begun.
    """

    def __init__(
        self,
        *,
        every: int | None = None,
        per_layer: bool = False,
        **options: Unpack[AdapterOptions],
    ) -> None:
        if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
            import transformers

            raise RuntimeError(
                f"transformers {transformers.__version__} has no on_pre_optimizer_step event "
                "(added in 4.45): upgrade it, or call GradientMonitor.step() yourself"
            )
        if every is not None and every < 1:
            raise ValueError("every must be >= 1 (or None: the steps the Trainer logs)")
        options.setdefault("sync", True)
        self._options = options
        self.every = every
        GradientMonitor(torch.nn.Module(), **options)  # the monitor's own checks, now
        self.per_layer = per_layer
        self.monitor: GradientMonitor | None = None
        self._trainer: Trainer | None = None
        self._state: TrainerState | None = None
        self._args: TrainingArguments | None = None
        self._unlogged: MonitorRecord | None = None
        self._stepped = 0  # the optimizer step the monitor was last called for
        self._uninstall: Callable[[], None] | None = None
        self._fallback_said = False

    def attach(self, trainer: Trainer) -> GradauditTrainerCallback:
        """Add this callback ahead of the Trainer's others (the same as passing it in
        ``Trainer(callbacks=[…])``, which this callback also puts first when training begins)."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        self._trainer = trainer
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
        self._remove_clip_hook()
        self.monitor = GradientMonitor(model, every=self.every or 1, **self._options)
        self._state, self._args = state, args
        self._unlogged = None
        self._stepped = 0
        self._fallback_said = False
        trainer = self._trainer or _calling_trainer()
        if trainer is None:
            warnings.warn(
                "GradauditTrainerCallback: the Trainer that calls it was not found, so its stats "
                "are read at on_pre_optimizer_step, after the Trainer's gradient clipping, and "
                "reporters that run before it miss its keys: use callback.attach(trainer)",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        # Under DDP the Trainer hands callbacks the module it wraps; the wrapper, whose
        # replicated gradients are checked across ranks, is its model_wrapped by now.
        self.monitor.find_replicas([getattr(trainer, "model_wrapped", None)])
        callbacks = trainer.callback_handler.callbacks
        if callbacks and callbacks[0] is not self and self in callbacks:
            # Safe while the handler iterates: the callbacks after this one keep their places.
            callbacks.remove(self)
            callbacks.insert(0, self)
        self._install_clip_hook(trainer)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step + 1
        if self._stepped == step:
            return  # read before the clip, inside accelerator.clip_grad_norm_
        if self._uninstall is not None and not self._fallback_said:
            self._fallback_said = True
            warnings.warn(
                "GradauditTrainerCallback: this Trainer clipped the gradients without "
                "accelerator.clip_grad_norm_, so the stats are of the clipped gradients "
                f"(max_grad_norm={args.max_grad_norm}): a NaN in one gradient may show in all",
                RuntimeWarning,
                stacklevel=2,
            )
        self._step(step)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        record = self._unlogged
        if record is None or logs is None:
            return
        if "loss" not in logs and "train_runtime" not in logs:
            return  # a training row or the end-of-training summary; not eval rows
        self._unlogged = None
        if record.step != state.global_step:
            return  # never a stale record at a later step
        values = record_scalars(record, per_layer=self.per_layer)
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._remove_clip_hook()
        if self.monitor is not None:
            self.monitor.flush()

    def _should_collect(self, step: int) -> bool:
        """The first step, and the steps the Trainer logs (or multiples of ``every``)."""
        if step == 1:
            return True
        if self.every is not None:
            return step % self.every == 0
        state, args = self._state, self._args
        assert state is not None, "on_train_begin was not called"
        assert args is not None, "on_train_begin was not called"
        if state.max_steps and step >= state.max_steps:
            return True
        logging_steps = int(getattr(state, "logging_steps", 0) or 0)
        strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        return strategy == "steps" and logging_steps > 0 and step % logging_steps == 0

    def _step(self, step: int) -> None:
        """Step the monitor for optimizer step ``step``; keep a fresh record for its row."""
        assert self.monitor is not None, "on_train_begin was not called"
        self._stepped = step
        record = self.monitor.step(step, collect=self._should_collect(step))
        if record is not None and record.step == step:
            self._unlogged = record

    def _install_clip_hook(self, trainer: Trainer) -> None:
        """Read the gradients inside ``accelerator.clip_grad_norm_``, before it clips."""
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is None or not callable(getattr(accelerator, "clip_grad_norm_", None)):
            return
        kind = str(getattr(accelerator, "distributed_type", ""))
        if "DEEPSPEED" in kind.upper():
            warnings.warn(
                "GradauditTrainerCallback under DeepSpeed: the engine clips and steps inside "
                "backward(), so the stats are of what the parameters' .grad hold at "
                "on_pre_optimizer_step (after clipping; empty under ZeRO)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        had_own = "clip_grad_norm_" in vars(accelerator)
        original = accelerator.clip_grad_norm_

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            state = self._state
            if state is None or self.monitor is None or self._stepped == state.global_step + 1:
                return original(parameters, max_norm, norm_type)
            parameters = list(parameters)
            with _unscaled_once(accelerator):
                try:
                    self._step(state.global_step + 1)
                except BaseException:
                    self._remove_clip_hook()  # training stops here: leave the accelerator as it was
                    raise
                return original(parameters, max_norm, norm_type)

        accelerator.clip_grad_norm_ = clip_grad_norm_

        def uninstall() -> None:
            if had_own:
                accelerator.clip_grad_norm_ = original
            else:
                vars(accelerator).pop("clip_grad_norm_", None)

        self._uninstall = uninstall

    def _remove_clip_hook(self) -> None:
        if self._uninstall is not None:
            self._uninstall()
            self._uninstall = None


@contextmanager
def _unscaled_once(accelerator: Any) -> Iterator[None]:
    """Unscale fp16 gradients now (a no-op without a ``GradScaler``) and make the clip's own
    ``unscale_gradients`` call a no-op: a ``GradScaler`` may unscale an optimizer once per step."""
    accelerator.unscale_gradients()
    had_own = "unscale_gradients" in vars(accelerator)
    own = vars(accelerator).get("unscale_gradients")
    accelerator.unscale_gradients = lambda optimizer=None: None
    try:
        yield
    finally:
        if had_own:
            accelerator.unscale_gradients = own
        else:
            vars(accelerator).pop("unscale_gradients", None)


def _calling_trainer() -> Trainer | None:
    """The Trainer whose training loop is calling ``on_train_begin``, from the call stack.

    A callback passed as ``Trainer(callbacks=[…])`` is never handed the Trainer; its
    training loop is a few frames up (through the CallbackHandler). ``None`` if absent.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


#: The name this class had before the Transformers and Lightning callbacks got names of
#: their own (both were ``GradauditCallback``); kept so existing imports keep working.
GradauditCallback = GradauditTrainerCallback
