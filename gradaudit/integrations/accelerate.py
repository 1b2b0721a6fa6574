"""Hugging Face Accelerate loops: one call after ``accelerator.backward``.

Accelerate has no callback system: the loop is yours, so the helper is one function,
:func:`accelerate_step`, called where ``GradientMonitor.step()`` would go::

    with accelerator.accumulate(model):
        loss = model(batch)
        accelerator.backward(loss)
        accelerate_step(accelerator, monitor, optimizer)   # before optimizer.step()
        optimizer.step()
        optimizer.zero_grad()

It does two things a hand-written call gets wrong:

* under ``accelerator.accumulate`` it collects only when gradients are synchronised (the
  last micro-batch of an accumulation window, ``accelerator.sync_gradients``), so ``every``
  counts optimizer steps and the stats are of the accumulated gradients;
* under fp16 mixed precision the gradients are multiplied by the loss scale until the
  ``GradScaler`` unscales them; ``unscale=True`` calls ``accelerator.unscale_gradients``
  first so the stats are of the real gradients. A ``GradScaler`` may unscale an optimizer
  only once per step, and ``accelerator.clip_grad_norm_`` unscales too: when you clip,
  call this *after* clipping with ``unscale=False`` (the stats are then of the clipped
  gradients, which the optimizer applies). Without fp16 both are no-ops.

* under DDP (``accelerate launch`` or ``torchrun`` on several processes) a monitor built over
  the prepared model (the ``DistributedDataParallel`` wrapper ``prepare`` returns) checks at
  every collected step that the replicated gradients are bit-identical on every rank
  (``on_divergence``; :mod:`gradaudit.training.replicas`). Accelerate keeps no reference to
  that wrapper, so a monitor built over the model as it was before ``prepare`` cannot check
  them: the first call says so, once.

Needs only ``accelerate`` itself, which this module never imports: the accelerator
object is passed in.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from gradaudit.training.monitor import GradientMonitor
from gradaudit.training.record import MonitorRecord

__all__ = ["accelerate_step"]

#: Monitors already told that their gradients are not checked across ranks.
_TOLD: weakref.WeakSet[GradientMonitor] = weakref.WeakSet()


def accelerate_step(
    accelerator: Any,
    monitor: GradientMonitor,
    optimizer: Any = None,
    *,
    unscale: bool = True,
    step: int | None = None,
) -> MonitorRecord | None:
    """``monitor.step(step)`` on synchronised steps, after unscaling fp16 gradients.

    Steps the monitor, never the optimizer: call ``optimizer.step()`` after it as before.
    Returns what ``monitor.step`` returns, or ``None`` on an accumulation micro-step (the
    monitor's step count does not advance then). ``optimizer`` limits the unscaling to one
    optimizer; by default every prepared optimizer is unscaled.
    """
    if not accelerator.sync_gradients:
        return None
    if monitor not in _TOLD and _unchecked_replicas(accelerator, monitor):
        _TOLD.add(monitor)
        warnings.warn(
            "accelerate_step: the monitor watches the model as it was before "
            "accelerator.prepare, not the DistributedDataParallel wrapper prepare returned, so "
            "its gradients are not checked across ranks: build it over the prepared model",
            RuntimeWarning,
            stacklevel=2,
        )
    if unscale:
        accelerator.unscale_gradients(optimizer)
    return monitor.step(step)


def _unchecked_replicas(accelerator: Any, monitor: GradientMonitor) -> bool:
    """Whether ``accelerator`` runs DDP over several processes while ``monitor`` watches
    something other than the wrapper (sharded gradients, ``group=``, are not replicas)."""
    if monitor.replicated_by is not None or monitor.group is not None:
        return False
    if int(getattr(accelerator, "num_processes", 1)) <= 1:
        return False
    kind = getattr(accelerator, "distributed_type", "")
    return str(getattr(kind, "value", kind)).upper().startswith("MULTI_")  # MULTI_CPU, _GPU …
