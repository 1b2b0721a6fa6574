"""What a reader knows about a tensor's role (:class:`TensorHint`) and a whole file's
(:class:`FileEvidence`): data that readers fill and :mod:`gradaudit.roles` decides on.

Here, not beside the decision, so that a reader imports a result type and not the
module that judges roles (the arrows point down: io -> results).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradaudit.policy import Role

if TYPE_CHECKING:  # no torch: only a hint's step tensor is one
    import torch

__all__ = ["EstimateBasis", "FileEvidence", "TensorHint"]


@dataclass(frozen=True)
class EstimateBasis:
    """How a gradient estimate is read from one optimizer state tensor.

    ``formula``: ``ema_sq`` (an EMA of g², decay ``decay``: Adam's ``exp_avg_sq`` with
    beta2, RMSprop's ``square_avg`` with alpha), ``sum_sq`` (Adagrad's running sum of g²,
    started at ``initial``), ``mean_sq`` (an unbiased average of g² over ``scale`` columns:
    Adafactor's row factor), ``ema`` (an EMA of g: Adam's ``exp_avg`` with beta1),
    ``momentum`` (SGD's buffer with ``decay`` = momentum and ``dampening``).
    ``step`` is the state's step when the file stores it as a number; when it is a tensor,
    ``step_tensor`` holds it and its value comes back with the one host read.
    """

    formula: str
    decay: float | None = None
    step: float | None = None
    dampening: float = 0.0
    initial: float = 0.0
    scale: float = 1.0
    step_tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def second_moment(self) -> bool:
        return self.formula in ("ema_sq", "sum_sq", "mean_sq")


@dataclass(frozen=True)
class TensorHint:
    """What a reader knows about one tensor from the structure around it.

    ``role`` None means the structure says nothing (the file-level evidence decides).
    ``param`` is the parameter an optimizer state tensor belongs to, when known.
    ``aux``/``aux_for`` mark a row that is not audited itself but serves a derived
    value of the tensor named ``aux_for``: ``sqrt`` (the root of a second moment, whose
    squared norm is the moment's exact sum) or ``step`` (the optimizer step counter).
    """

    role: Role | None
    evidence: str
    param: str | None = None
    basis: EstimateBasis | None = None
    aux: str | None = None
    aux_for: str | None = None


@dataclass(frozen=True)
class FileEvidence:
    """What a whole file holds, and why; ``thin`` when nothing in the file said so."""

    role: Role
    evidence: str
    thin: bool = False
