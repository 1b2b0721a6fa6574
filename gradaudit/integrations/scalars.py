"""One record, one set of logged scalars: the names every adapter and logger shares.

A :class:`~gradaudit.MonitorRecord` is turned into flat ``name -> float`` pairs here and
nowhere else, so a run logged through the Trainer callback, the Lightning callback,
TensorBoard or W&B shows the same keys:

* ``gradaudit/global_norm``: L2 norm of every gradient, NaN when one holds NaN and ``inf``
  when one holds ±Inf (as ``torch.nn.utils.get_total_norm`` and the Trainer's ``grad_norm``):
  an all-NaN step is never logged as ``0.0``, which a dashboard would show as a collapse;
* ``gradaudit/finite_norm``: L2 norm over the finite elements (equal to ``global_norm`` on
  a healthy step);
* ``gradaudit/nonfinite_tensors``: how many gradients hold a NaN or Inf;
* ``gradaudit/nan`` and ``gradaudit/inf``: NaN and ±Inf elements over all gradients;
* ``gradaudit/findings/exploding``, ``…/vanishing``, ``…/outlier``: how many gradients
  have that finding (not ignored), always present so a dashboard has a steady series;
  ``gradaudit/findings/other`` counts the rarer kinds;
* ``gradaudit/replicas/differing``: how many of a ``DistributedDataParallel`` model's
  replicated gradients are not bit-identical on every rank (0 on a healthy step); present
  when the record was checked across ranks (``record.replicas``), absent otherwise;
* ``gradaudit/headroom/<fmt>/flushed_fraction``, ``…/subnormal_fraction`` and
  ``…/overflowed_fraction`` (of every gradient's non-zero values together), ``…/overflowed``
  (how many values), ``…/scale_log2`` (the power of two that brings the most values into
  range without overflow, NaN when every gradient is zero) and ``…/flagged_tensors`` (how
  many gradients have a ``cast`` finding, not ignored): present when the monitor judges a format
  (``precision="fp16"``: ``<fmt>`` is ``fp16``), absent otherwise;
* ``gradaudit/stats_step``: the step the stats describe (the framework callbacks log a
  record only in the row of its own step, so there it equals the row's step);
* ``gradaudit/norm/<parameter>`` per parameter, when ``per_layer`` is on (NaN / ``inf`` for
  a gradient holding NaN / ±Inf, as ``global_norm``).

Everything here reads the host copy the monitor already made: no device access.
"""

from __future__ import annotations

import math

from gradaudit.policy import FindingKind
from gradaudit.training.record import MonitorRecord

#: The prefix of every key.
PREFIX = "gradaudit"
#: Finding kinds with a key of their own; the others add up in ``findings/other``.
FINDING_KEYS = (FindingKind.EXPLODING, FindingKind.VANISHING, FindingKind.OUTLIER)


def record_scalars(
    record: MonitorRecord, *, per_layer: bool = False, prefix: str = PREFIX
) -> dict[str, float]:
    """The scalars to log for ``record``; see the module docstring for the keys."""
    tensors = record.report.tensors
    values = {
        f"{prefix}/global_norm": record.global_norm,
        f"{prefix}/finite_norm": record.finite_norm,
        f"{prefix}/nonfinite_tensors": float(len(record.nonfinite)),
        f"{prefix}/nan": float(sum(t.nan for t in tensors)),
        f"{prefix}/inf": float(sum(t.pos_inf + t.neg_inf for t in tensors)),
        f"{prefix}/stats_step": float(record.step),
    }
    counts = dict.fromkeys(FINDING_KEYS, 0)
    other = 0
    for finding in record.findings:
        if finding.kind in counts:
            counts[finding.kind] += 1
        else:
            other += 1
    values.update({f"{prefix}/findings/{kind.value}": float(n) for kind, n in counts.items()})
    values[f"{prefix}/findings/other"] = float(other)
    if record.replicas is not None:
        divergence = record.replicas.divergence
        values[f"{prefix}/replicas/differing"] = float(
            0 if divergence is None else len(divergence.tensors)
        )
    values.update(headroom_scalars(record, prefix=prefix))
    if per_layer:
        values.update({f"{prefix}/norm/{name}": norm for name, norm in record.norms.items()})
    return values


def headroom_scalars(record: MonitorRecord, *, prefix: str = PREFIX) -> dict[str, float]:
    """The ``headroom/<fmt>/…`` scalars of a record judged for a format (see the module
    docstring); none without one."""
    headroom = record.headroom
    if headroom is None:
        return {}
    total = headroom.total
    key = f"{prefix}/headroom/{headroom.precision.value}"
    # The cast findings the record acts on: not those of an ignored tensor.
    flagged = {f.tensor for f in record.findings if f.kind is FindingKind.CAST}
    return {
        f"{key}/flushed_fraction": total.flushed_fraction,
        f"{key}/subnormal_fraction": total.subnormal_fraction,
        f"{key}/overflowed_fraction": total.overflowed_fraction,
        f"{key}/overflowed": float(total.overflowed),
        f"{key}/scale_log2": math.nan if total.scale_log2 is None else float(total.scale_log2),
        f"{key}/flagged_tensors": float(len(flagged)),
    }
