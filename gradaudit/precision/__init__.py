"""Low-precision headroom: will these values survive fp16, bf16 or fp8?

``gradaudit.precision`` is the documented import path of these names; each lives in the
module of its job: the exponent-histogram bins and the formats' rounding boundaries
(:mod:`~gradaudit.precision.formats`), what a cast would do to the counted values
(:mod:`~gradaudit.precision.headroom`), and what that means for a run: findings and
reports (:mod:`~gradaudit.precision.judging`). Nothing here needs torch; the counting
itself is device work in :mod:`gradaudit.engine.histogram`.
"""

from __future__ import annotations

from gradaudit.precision.formats import (
    FORMATS,
    INF_BITS,
    MAX_EXPONENT,
    MIN_EXPONENT,
    ExponentHistogram,
    FormatSpec,
    Layout,
    Precision,
    bits_value,
    float32_bits,
    layout,
)
from gradaudit.precision.headroom import (
    Headroom,
    HeadroomColumns,
    headroom,
    headroom_columns,
    scale_log2,
)
from gradaudit.precision.judging import (
    ALL_TENSORS,
    DEFAULT_MAX_UNDERFLOW,
    IN_MEMORY,
    PrecisionFinding,
    PrecisionReport,
    StepHeadroom,
    as_findings,
    cast_findings,
    judge,
    precision_report,
    step_headroom,
)

__all__ = [
    "ALL_TENSORS",
    "DEFAULT_MAX_UNDERFLOW",
    "FORMATS",
    "INF_BITS",
    "IN_MEMORY",
    "MAX_EXPONENT",
    "MIN_EXPONENT",
    "ExponentHistogram",
    "FormatSpec",
    "Headroom",
    "HeadroomColumns",
    "Layout",
    "Precision",
    "PrecisionFinding",
    "PrecisionReport",
    "StepHeadroom",
    "as_findings",
    "bits_value",
    "cast_findings",
    "float32_bits",
    "headroom",
    "headroom_columns",
    "judge",
    "layout",
    "precision_report",
    "scale_log2",
    "step_headroom",
]
