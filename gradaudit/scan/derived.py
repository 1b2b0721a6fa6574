"""The one-element rows an optimizer state tensor's checks and gradient estimate need.

Not audited themselves, they ride along with the one host read (and travel with the
entries between ranks): a second moment's sum (``sum``, for the gradient estimate) and
its minimum clamped to 0 (``neg``: nonzero exactly when an element is negative), and the
state's step counter (``step``); each row's max |x| is the value. What those values are,
and how they are reduced without slowing the scan, is this module's job;
:meth:`~gradaudit.scan.pending.PendingStats.queue_derived` queues them.
"""

from __future__ import annotations

import torch

from gradaudit.engine.dtypes import not_audited_reason
from gradaudit.policy import Role
from gradaudit.results.roles import TensorHint

#: CPU reductions for derived rows run in pieces this long, below torch's grain size
#: (32768), so each runs on the calling thread: with the native kernel's threads busy,
#: torch's own pool made the same sums 3-10x slower (measured on a 270 MB checkpoint).
_PIECE = 16384


def derived_rows(
    name: str, tensor: torch.Tensor, hint: TensorHint
) -> list[tuple[str, torch.Tensor, TensorHint]]:
    """``(row name, one-element value, its hint)`` of each row ``tensor``'s checks need.

    Reductions, not an element-wise root: a square root of the subnormal values that fill
    a second moment cost 30x a sum on x86 (measured).
    """
    if not_audited_reason(tensor) is not None or tensor.numel() == 0:
        return []
    basis = hint.basis
    values: list[tuple[str, torch.Tensor]] = []
    if hint.role is Role.OPTIMIZER_SECOND_MOMENT:
        values.append(("neg", _serial_reduce(tensor, "amin").clamp(max=0)))
    if basis is not None and basis.second_moment:
        values.append(("sum", _serial_reduce(tensor, "sum")))
    step = None if basis is None else basis.step_tensor
    if step is not None and step.dtype is not torch.bool and not step.dtype.is_complex:
        values.append(("step", step.reshape(()).to(torch.float64)))
    return [
        (f"{name}#{kind}", value.reshape(1), TensorHint(None, "", aux=kind, aux_for=name))
        for kind, value in values
    ]


def _pieces(flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat[start : start + _PIECE] for start in range(0, flat.numel(), _PIECE)]


def _serial_reduce(tensor: torch.Tensor, how: str) -> torch.Tensor:
    """``sum`` (accumulated in float64) or ``amin`` of ``tensor``, as a float64 0-d tensor.

    On the CPU piece by piece on the calling thread; elsewhere in one call.
    """
    flat = tensor.reshape(-1)
    if how == "sum":
        if flat.device.type != "cpu" or flat.numel() <= _PIECE:
            return flat.sum(dtype=torch.float64)
        return torch.stack([p.sum(dtype=torch.float64) for p in _pieces(flat)]).sum()
    if flat.device.type != "cpu" or flat.numel() <= _PIECE:
        return flat.amin().to(torch.float64)
    return torch.stack([p.amin() for p in _pieces(flat)]).amin().to(torch.float64)
