"""The exponent histogram's bins and the formats' rounding boundaries: bit math only.

Mixed Precision Training (Micikevicius et al., 2018) argued loss scaling with a
histogram of log2 gradient magnitudes drawn against fp16's range. This module
is the host side of that figure: the bin layout of an *exponent histogram*
(counts per binary exponent of |x|) and the formats (fp16, bf16, fp8). What a
histogram says about each format is :mod:`gradaudit.precision.headroom`. The
counting itself is device work in :mod:`gradaudit.engine.histogram`; nothing
here needs torch.

Why a histogram by exponent alone is not enough
-----------------------------------------------
Converting to a narrower format rounds to nearest, ties to even. Whether a
value flushes to zero, becomes subnormal or overflows is decided at points
*inside* a binade: fp16 flushes ``|x| <= 2**-25`` (the tie at half the
smallest subnormal goes to the even zero) but not the next float up, becomes
normal from ``2**-14 - 2**-25`` (the tie goes up to ``2**-14``), and
overflows from ``65520`` (``65504`` plus half an ulp; the tie goes to the even
``2**16``). So the layout splits the binades that hold one of these twelve
points (three per format), and every count below is a sum of whole bins:
exact, and mergeable by addition like every other statistic.

The layout is defined on float32 values: half, bfloat16 and fp8 tensors are
exactly float32 values, and float64 tensors are binned after rounding to
float32, which is what ``tensor.to(fp16/bf16/fp8)`` does on the CPU (it goes
through float32: a double rounding, checked by the tests). Non-zero float64
values below float32's range count in its lowest binade (``2**-149``): they
flush in every format.

torch's CPU cast to ``float8_e4m3fn`` saturates: values beyond the largest
finite 448 (and ±Inf) become ±448 rather than NaN. Overflow for that format
means "would round above 448", i.e. ``|x| > 464``; the value is clamped.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

#: Bit pattern of float32 +Inf; NaN patterns are above it.
INF_BITS = 0x7F800000
#: Lowest and highest binary exponent of a non-zero finite float32.
MIN_EXPONENT = -149
MAX_EXPONENT = 127


def float32_bits(value: float) -> int:
    """The bit pattern of ``value`` as a float32 (``value`` must be exactly representable)."""
    bits: int = struct.unpack("<I", struct.pack("<f", value))[0]
    if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
        raise ValueError(f"{value!r} is not a float32")
    return bits


def bits_value(bits: int) -> float:
    value: float = struct.unpack("<f", struct.pack("<I", bits))[0]
    return value


class Precision(str, Enum):
    """A target format; the values are the ``--precision`` spellings."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP8_E4M3FN = "fp8_e4m3fn"
    FP8_E5M2 = "fp8_e5m2"


@dataclass(frozen=True)
class FormatSpec:
    """A format's range and its three rounding boundaries, as float32 values of |x|.

    ``|x| < flush_from`` rounds to zero; ``|x| < normal_from`` rounds to a
    subnormal (or zero); ``|x| >= overflow_from`` overflows (Inf, or the
    saturated maximum for e4m3fn).
    """

    precision: Precision
    #: The torch dtype's name (``float16``); torch itself is not imported here.
    dtype: str
    min_subnormal: float
    min_normal: float
    max: float
    flush_from: float
    normal_from: float
    overflow_from: float
    overflow_result: str

    @property
    def label(self) -> str:
        return self.precision.value


def _spec(
    precision: Precision,
    dtype: str,
    *,
    mantissa: int,
    min_exponent: int,
    max_value: float,
    saturates: bool = False,
) -> FormatSpec:
    min_normal = 2.0**min_exponent
    min_subnormal = 2.0 ** (min_exponent - mantissa)
    half_ulp_at_max = 2.0 ** (math.frexp(max_value)[1] - 1 - mantissa) / 2
    # Ties at half the smallest subnormal go to the even zero: that point still flushes.
    flush_from = bits_value(float32_bits(min_subnormal / 2) + 1)
    # The largest subnormal is odd, so the tie below min_normal rounds up to it.
    normal_from = min_normal - min_subnormal / 2
    if saturates:
        # The largest finite value is even (e4m3fn's 448 = 1.75 * 2**8): the tie stays.
        overflow_from = bits_value(float32_bits(max_value + half_ulp_at_max) + 1)
        result = f"saturates to ±{max_value:g}"
    else:
        overflow_from = max_value + half_ulp_at_max  # odd maximum: the tie goes up
        result = "Inf"
    return FormatSpec(
        precision,
        dtype,
        min_subnormal,
        min_normal,
        max_value,
        flush_from,
        normal_from,
        overflow_from,
        result,
    )


FORMATS: dict[Precision, FormatSpec] = {
    Precision.FP16: _spec(
        Precision.FP16, "float16", mantissa=10, min_exponent=-14, max_value=65504.0
    ),
    Precision.BF16: _spec(
        Precision.BF16,
        "bfloat16",
        mantissa=7,
        min_exponent=-126,
        max_value=(2 - 2**-7) * 2.0**127,
    ),
    Precision.FP8_E4M3FN: _spec(
        Precision.FP8_E4M3FN,
        "float8_e4m3fn",
        mantissa=3,
        min_exponent=-6,
        max_value=448.0,
        saturates=True,
    ),
    Precision.FP8_E5M2: _spec(
        Precision.FP8_E5M2, "float8_e5m2", mantissa=2, min_exponent=-14, max_value=57344.0
    ),
}


def _edge_bits(exponent: int) -> int:
    """Bit pattern of the float32 ``2**exponent`` (subnormal below -126)."""
    if exponent >= -126:
        return (exponent + 127) << 23
    return 1 << (exponent - MIN_EXPONENT)


@dataclass(frozen=True)
class Layout:
    """The bins: bin ``i`` holds ``|x|`` with ``boundaries[i-1] <= bits(|x|) < boundaries[i]``.

    Bin 0 is exact zero; the last bin is NaN and ±Inf; each bin in between lies
    in one binade (``exponents[i]``).
    """

    boundaries: tuple[int, ...]
    exponents: tuple[int | None, ...]

    @property
    def bins(self) -> int:
        return len(self.boundaries) + 1

    def start(self, value: float) -> int:
        """The first bin whose values are ``>= value`` (``value`` a boundary)."""
        return self.boundaries.index(float32_bits(value)) + 1


@functools.lru_cache(maxsize=1)
def layout() -> Layout:
    edges = {_edge_bits(e) for e in range(MIN_EXPONENT, MAX_EXPONENT + 1)}
    for spec in FORMATS.values():
        edges |= {float32_bits(v) for v in (spec.flush_from, spec.normal_from, spec.overflow_from)}
    edges.add(INF_BITS)
    boundaries = tuple(sorted(edges))
    exponents: list[int | None] = [None]
    for low in boundaries[:-1]:
        exponents.append(math.frexp(bits_value(low))[1] - 1)
    exponents.append(None)
    return Layout(boundaries, tuple(exponents))


@dataclass(frozen=True)
class ExponentHistogram:
    """Exact counts per bin of :func:`layout` for one tensor (or a merge of several)."""

    counts: tuple[int, ...]

    def __add__(self, other: ExponentHistogram) -> ExponentHistogram:
        return ExponentHistogram(
            tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        )

    @classmethod
    def merge(cls, histograms: Iterable[ExponentHistogram]) -> ExponentHistogram:
        total = [0] * layout().bins
        for histogram in histograms:
            for i, count in enumerate(histogram.counts):
                total[i] += count
        return cls(tuple(total))

    @property
    def zeros(self) -> int:
        return self.counts[0]

    @property
    def nonfinite(self) -> int:
        return self.counts[-1]

    @property
    def nonzero(self) -> int:
        """Finite non-zero values: the denominator of every fraction."""
        return sum(self.counts[1:-1])

    def exponents(self) -> dict[int, int]:
        """Count of finite non-zero values per binary exponent ``floor(log2|x|)``."""
        out: dict[int, int] = {}
        for exponent, count in zip(layout().exponents, self.counts, strict=True):
            if exponent is not None and count:
                out[exponent] = out.get(exponent, 0) + count
        return out

    def count_between(self, low: float | None, high: float | None) -> int:
        """Finite non-zero values with ``low <= |x| < high`` (both boundaries of the layout)."""
        grid = layout()
        first = 1 if low is None else grid.start(low)
        last = grid.bins - 1 if high is None else grid.start(high)
        return sum(self.counts[first:last])
