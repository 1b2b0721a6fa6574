"""An independent float64 reference for the engine: plain Python over the values.

It shares no code with ``gradaudit.engine.stats``: values are converted to Python
floats (exact for every audited dtype) and reduced with ``math.fsum`` after
scaling by the largest magnitude, which neither overflows nor loses precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reference:
    nan: int
    pos_inf: int
    neg_inf: int
    zeros: int
    max_abs: float
    norm: float


def reference_stats(tensor: torch.Tensor) -> Reference:
    values = tensor.detach().to(torch.float64).reshape(-1).tolist()
    finite = [v for v in values if math.isfinite(v)]
    max_abs = max((abs(v) for v in finite), default=0.0)
    norm = 0.0
    if max_abs > 0:
        norm = max_abs * math.sqrt(math.fsum((v / max_abs) ** 2 for v in finite))
    return Reference(
        nan=sum(1 for v in values if math.isnan(v)),
        pos_inf=sum(1 for v in values if v == math.inf),
        neg_inf=sum(1 for v in values if v == -math.inf),
        zeros=sum(1 for v in values if v == 0.0),
        max_abs=max_abs,
        norm=norm,
    )
