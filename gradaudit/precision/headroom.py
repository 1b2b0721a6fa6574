"""What converting values to a format would do: how many flush to zero, become subnormal
or overflow, counted from exponent histograms (:mod:`gradaudit.precision.formats`), one
histogram at a time or many at once as numpy columns.

Counts, not verdicts: what a count means for a run (a finding, a report) is
:mod:`gradaudit.precision.judging`. numpy is imported where it is used: the CLI's
``--help`` imports this module.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradaudit.precision.formats import FORMATS, ExponentHistogram, FormatSpec, Precision, layout

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Headroom:
    """What converting one tensor (or layer, or model) to one format would do."""

    name: str
    precision: Precision
    nonzero: int
    #: Non-zero values that would round to zero.
    flushed: int
    #: Non-zero values that would become subnormal (reduced precision).
    subnormal: int
    #: Values that would overflow (Inf; e4m3fn saturates).
    overflowed: int
    #: floor(log2) of the smallest and largest non-zero |x|; ``None`` when all are zero.
    min_exponent: int | None
    max_exponent: int | None
    #: The power of two (log2) that brings the most values into range without
    #: overflow (``GradScaler(init_scale=2**scale_log2)``); ``None`` without max |x|.
    scale_log2: int | None
    source: str | None = None

    def fraction(self, count: int) -> float:
        return count / self.nonzero if self.nonzero else 0.0

    @property
    def flushed_fraction(self) -> float:
        return self.fraction(self.flushed)

    @property
    def subnormal_fraction(self) -> float:
        return self.fraction(self.subnormal)

    @property
    def overflowed_fraction(self) -> float:
        return self.fraction(self.overflowed)

    @property
    def dynamic_range(self) -> int | None:
        """Binades spanned by the non-zero values (max exponent - min exponent + 1)."""
        if self.min_exponent is None or self.max_exponent is None:
            return None
        return self.max_exponent - self.min_exponent + 1


def scale_log2(max_abs: float, spec: FormatSpec) -> int | None:
    """The largest ``s`` with ``max_abs * 2**s`` below the overflow boundary; exact."""
    if not (max_abs > 0 and math.isfinite(max_abs)):
        return None
    s = math.frexp(spec.overflow_from)[1] - math.frexp(max_abs)[1]
    while math.ldexp(max_abs, s) >= spec.overflow_from:
        s -= 1
    while math.ldexp(max_abs, s + 1) < spec.overflow_from:
        s += 1
    return s


def headroom(
    name: str,
    histogram: ExponentHistogram,
    precision: Precision,
    *,
    max_abs: float | None = None,
    source: str | None = None,
) -> Headroom:
    """The flush/subnormal/overflow counts of ``histogram`` for one format."""
    import numpy as np  # here, not at the top: the CLI's --help imports this module

    columns = headroom_columns(np.array([histogram.counts], dtype=np.int64), precision)
    return columns.row(0, name, max_abs=max_abs, source=source)


@functools.cache
def _bin_starts(precision: Precision) -> tuple[int, int, int]:
    """The first bin of the values that become subnormal, normal and overflow in ``precision``."""
    grid = layout()
    spec = FORMATS[precision]
    return grid.start(spec.flush_from), grid.start(spec.normal_from), grid.start(spec.overflow_from)


@functools.lru_cache(maxsize=1)
def _finite_exponents() -> np.ndarray:
    """The binary exponent of each bin of a finite non-zero value (bins 1 to ``bins - 2``)."""
    import numpy as np  # here, not at the top: the CLI's --help imports this module

    return np.array(layout().exponents[1:-1], dtype=np.int64)


@dataclass(frozen=True)
class HeadroomColumns:
    """:class:`Headroom` counts of many histograms at once, one numpy row per histogram.

    A training loop's monitor judges every gradient at every collected step: a Python
    loop over 293 bins per tensor cost ~0.1 ms a tensor, these columns ~1 us. Every
    :class:`Headroom` is made through :meth:`row`, so the counts have one definition.
    """

    precision: Precision
    nonzero: np.ndarray
    flushed: np.ndarray
    subnormal: np.ndarray
    overflowed: np.ndarray
    #: floor(log2) of the smallest and largest non-zero |x|; meaningless where ``nonzero``
    #: is 0.
    min_exponent: np.ndarray
    max_exponent: np.ndarray

    def row(
        self, index: int, name: str, *, max_abs: float | None = None, source: str | None = None
    ) -> Headroom:
        """Row ``index`` as a :class:`Headroom` (``max_abs`` gives its scale)."""
        empty = not self.nonzero[index]
        return Headroom(
            name=name,
            precision=self.precision,
            nonzero=int(self.nonzero[index]),
            flushed=int(self.flushed[index]),
            subnormal=int(self.subnormal[index]),
            overflowed=int(self.overflowed[index]),
            min_exponent=None if empty else int(self.min_exponent[index]),
            max_exponent=None if empty else int(self.max_exponent[index]),
            scale_log2=None if max_abs is None else scale_log2(max_abs, FORMATS[self.precision]),
            source=source,
        )


def headroom_columns(counts: np.ndarray, precision: Precision) -> HeadroomColumns:
    """The headroom counts of each row of ``counts`` (int64, ``[histograms, bins]``)."""

    flush, normal, overflow = _bin_starts(precision)
    last = counts.shape[1] - 1  # the NaN/Inf bin
    finite = counts[:, 1:last]
    present = finite > 0
    width = present.shape[1]
    exponents = _finite_exponents()
    return HeadroomColumns(
        precision,
        nonzero=finite.sum(axis=1),
        flushed=counts[:, 1:flush].sum(axis=1),
        subnormal=counts[:, flush:normal].sum(axis=1),
        overflowed=counts[:, overflow:last].sum(axis=1),
        min_exponent=exponents[present.argmax(axis=1)],
        max_exponent=exponents[width - 1 - present[:, ::-1].argmax(axis=1)],
    )
