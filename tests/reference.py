"""An independent float64 reference for the engine: plain Python over the values.

It shares no code with ``gradaudit.engine.stats``: values are converted to Python
floats (exact for every audited dtype) and reduced with ``math.fsum`` after
scaling by the largest magnitude, which neither overflows nor loses precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradaudit.precision.formats import Precision


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


# (mantissa bits, smallest normal exponent, largest finite) of each format, from its definition.
ROUNDING_DEFINITIONS = {
    Precision.FP16: (10, -14, 65504.0),
    Precision.BF16: (7, -126, float((2 - 2**-7) * 2.0**127)),
    Precision.FP8_E4M3FN: (3, -6, 448.0),
    Precision.FP8_E5M2: (2, -14, 57344.0),
}


def reference_rounding(values: np.ndarray, precision: Precision) -> tuple[int, int, int]:
    """(flushed, subnormal, overflowed) among finite non-zero ``values``, by exact
    round-to-nearest-even in float64 from each format's definition (no bin, no boundary)."""
    mantissa, emin, largest = ROUNDING_DEFINITIONS[precision]
    v = np.abs(values[np.isfinite(values) & (values != 0)]).astype(np.float64)
    exponent = np.maximum(np.frexp(v)[1] - 1, emin)
    quantum = np.ldexp(1.0, exponent - mantissa)
    rounded = np.rint(v / quantum) * quantum  # exact division; rint ties to even
    flushed = int((rounded == 0).sum())
    subnormal = int(((rounded > 0) & (rounded < 2.0**emin)).sum())
    overflowed = int((rounded > largest).sum())
    return flushed, subnormal, overflowed
