"""One record, one set of logged scalars: the names every adapter and logger shares.

A :class:`~gradaudit.MonitorRecord` is turned into flat ``name -> float`` pairs here and
nowhere else, so a run logged through the Trainer callback, the Lightning callback,
TensorBoard or W&B shows the same keys:

* ``gradaudit/global_norm``: L2 norm over the finite elements of every gradient;
* ``gradaudit/nonfinite_tensors``: how many gradients hold a NaN or Inf;
* ``gradaudit/nan`` and ``gradaudit/inf``: NaN and ±Inf elements over all gradients;
* ``gradaudit/stats_step``: the step the stats describe (one collected step behind the
  logging step unless the monitor runs with ``sync=True``);
* ``gradaudit/norm/<parameter>`` per parameter, when ``per_layer`` is on.

Everything here reads the host copy the monitor already made: no device access.
"""

from __future__ import annotations

from gradaudit.training.monitor import MonitorRecord

#: The prefix of every key.
PREFIX = "gradaudit"


def record_scalars(
    record: MonitorRecord, *, per_layer: bool = False, prefix: str = PREFIX
) -> dict[str, float]:
    """The scalars to log for ``record``; see the module docstring for the keys."""
    tensors = record.report.tensors
    values = {
        f"{prefix}/global_norm": record.global_norm,
        f"{prefix}/nonfinite_tensors": float(len(record.nonfinite)),
        f"{prefix}/nan": float(sum(t.nan for t in tensors)),
        f"{prefix}/inf": float(sum(t.pos_inf + t.neg_inf for t in tensors)),
        f"{prefix}/stats_step": float(record.step),
    }
    if per_layer:
        values.update({f"{prefix}/norm/{t.name}": t.norm for t in tensors})
    return values
