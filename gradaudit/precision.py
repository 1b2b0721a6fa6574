"""Low-precision headroom: will these values survive fp16, bf16 or fp8?

Mixed Precision Training (Micikevicius et al., 2018) argued loss scaling with a
histogram of log2 gradient magnitudes drawn against fp16's range. This module
is the host side of that figure: the bin layout of an *exponent histogram*
(counts per binary exponent of |x|), the formats, and what a histogram says
about each format. The counting itself is device work in
:mod:`gradaudit.engine.histogram`; nothing here needs torch.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from gradaudit.grouping import model_order
from gradaudit.policy import FindingKind, Thresholds, fraction_exceeds
from gradaudit.results import Finding, Report

if TYPE_CHECKING:
    import numpy as np

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


#: A tensor in which more than this fraction of the non-zero values would flush to zero
#: (``--max-underflow``) gets a finding.
DEFAULT_MAX_UNDERFLOW = 0.01


@dataclass(frozen=True)
class PrecisionFinding:
    """A tensor that would lose values in the target format: underflow or overflow."""

    kind: str  # "underflow" or "overflow"
    tensor: str
    precision: Precision
    fraction: float
    message: str
    source: str | None = None


def _count(n: int, noun: str) -> str:
    """``1 value``, ``2,070 values``: a finding's message reads as English for every count,
    with the thousands separator the tables beside it use."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def judge(
    rows: Sequence[Headroom], max_underflow: float = DEFAULT_MAX_UNDERFLOW
) -> tuple[PrecisionFinding, ...]:
    """Findings: more than ``max_underflow`` of a tensor's values flush, or any overflows."""
    out: list[PrecisionFinding] = []
    for row in rows:
        label = row.precision.value
        if fraction_exceeds(row.flushed, row.nonzero, max_underflow):
            out.append(
                PrecisionFinding(
                    "underflow",
                    row.name,
                    row.precision,
                    row.flushed_fraction,
                    f"{row.flushed_fraction:.1%} of {_count(row.nonzero, 'non-zero value')} "
                    f"{'flushes' if row.nonzero == 1 else 'flush'} to zero in {label} "
                    f"(> {max_underflow:g})"
                    + ("" if row.scale_log2 is None else f"; scale by 2**{row.scale_log2}"),
                    row.source,
                )
            )
        if row.overflowed:
            spec = FORMATS[row.precision]
            out.append(
                PrecisionFinding(
                    "overflow",
                    row.name,
                    row.precision,
                    row.overflowed_fraction,
                    f"{_count(row.overflowed, 'value')} "
                    f"{'overflows' if row.overflowed == 1 else 'overflow'} {label} "
                    f"({spec.overflow_result})"
                    + ("" if row.scale_log2 is None else f"; scale by 2**{row.scale_log2}"),
                    row.source,
                )
            )
    return tuple(out)


@dataclass(frozen=True)
class PrecisionReport:
    """Headroom of every audited tensor, layer and the whole model for one format."""

    precision: Precision
    max_underflow: float
    tensors: tuple[Headroom, ...]
    #: Tensors grouped by owning module (``a.b.weight`` -> ``a.b``), in model order.
    layers: tuple[Headroom, ...]
    total: Headroom
    #: The whole run per input file, in the order first seen (one row for one file; the
    #: in-memory tensors of a library report are one row named :data:`IN_MEMORY`). JUnit
    #: reports each file's headroom in that file's test suite.
    files: tuple[Headroom, ...]
    #: The whole model's histogram (what ``--plot`` draws).
    histogram: ExponentHistogram
    findings: tuple[PrecisionFinding, ...]


def as_findings(report: PrecisionReport, thresholds: Thresholds) -> tuple[Finding, ...]:
    """The headroom findings as ``cast`` findings of the scan (they always fail, as
    ``--cast-check`` does; ``ignore`` patterns still apply): one verdict counts them."""
    return cast_findings(report.findings, thresholds)


def cast_findings(
    findings: Iterable[PrecisionFinding], thresholds: Thresholds
) -> tuple[Finding, ...]:
    """Headroom findings as ``cast`` findings (:func:`as_findings`, a monitor's step)."""
    return tuple(
        Finding(
            FindingKind.CAST,
            thresholds.severity(FindingKind.CAST, f.tensor),
            f.tensor,
            f"{f.precision.value} headroom: {f.message}",
            f.source,
        )
        for f in findings
    )


#: The name of the headroom row of every tensor together.
ALL_TENSORS = "(all tensors)"
#: The name of the headroom row of tensors audited from memory (no input file).
IN_MEMORY = "(in memory)"


def _merged(
    name: str,
    members: Sequence[tuple[ExponentHistogram, float]],
    precision: Precision,
    source: str | None = None,
) -> Headroom:
    """The headroom of several tensors together: histograms add, the largest max |x| scales."""
    merged = ExponentHistogram.merge(h for h, _ in members)
    return headroom(name, merged, precision, max_abs=max(m for _, m in members), source=source)


def precision_report(
    report: Report, precision: Precision, max_underflow: float = DEFAULT_MAX_UNDERFLOW
) -> PrecisionReport:
    """Judge a report collected with histograms (``scan_paths(..., histograms=True)``)."""
    if len(report.histograms) != len(report.tensors):
        raise ValueError("the report was collected without exponent histograms")
    rows: list[Headroom] = []
    groups: dict[str, list[tuple[ExponentHistogram, float]]] = {}
    by_file: dict[str | None, list[tuple[ExponentHistogram, float]]] = {}
    kept: list[ExponentHistogram] = []
    for stats, histogram in zip(report.tensors, report.histograms, strict=True):
        if histogram is None:
            continue
        kept.append(histogram)
        rows.append(
            headroom(stats.name, histogram, precision, max_abs=stats.max_abs, source=stats.source)
        )
        layer = stats.name.rsplit(".", 1)[0] if "." in stats.name else stats.name
        groups.setdefault(layer, []).append((histogram, stats.max_abs))
        by_file.setdefault(stats.source, []).append((histogram, stats.max_abs))
    layers = []
    for name in model_order(groups):
        layers.append(_merged(name, groups[name], precision))
    files = tuple(
        _merged(IN_MEMORY if source is None else source, members, precision, source)
        for source, members in by_file.items()
    )
    total_histogram = ExponentHistogram.merge(kept)
    top = max((t.max_abs for t in report.tensors), default=0.0)
    total = headroom(ALL_TENSORS, total_histogram, precision, max_abs=top)
    return PrecisionReport(
        precision,
        max_underflow,
        tuple(rows),
        tuple(layers),
        total,
        files,
        total_histogram,
        judge(rows, max_underflow),
    )


@dataclass(frozen=True)
class StepHeadroom:
    """The headroom of one training step's gradients, as a monitor keeps it.

    What a training loop needs on every collected step, and no more: the whole model's
    row (the logged scalars), and the rows of the tensors with a finding (what the
    warning names). :func:`precision_report` has every tensor's and layer's row, for a
    scan; the counts are the same (:class:`HeadroomColumns`).
    """

    precision: Precision
    max_underflow: float
    #: Every gradient together (``(all tensors)``).
    total: Headroom
    #: The gradients with a finding, in collection order.
    flagged: tuple[Headroom, ...]
    findings: tuple[PrecisionFinding, ...]


def step_headroom(
    names: Sequence[str],
    counts: np.ndarray,
    max_abs: np.ndarray,
    precision: Precision,
    max_underflow: float = DEFAULT_MAX_UNDERFLOW,
) -> StepHeadroom:
    """Judge ``counts`` (one histogram row per name) with ``max_abs`` (each one's max |x|).

    Only the rows that may have a finding become :class:`Headroom` objects, and
    :func:`judge` decides on them exactly: the columns pick every row with an overflow or
    a flushed fraction within a rounding error of ``max_underflow`` (a float product may
    err; :func:`~gradaudit.policy.fraction_exceeds` does not).
    """
    import numpy as np  # here, not at the top: the CLI's --help imports this module

    if len(names) != counts.shape[0] or len(names) != len(max_abs):
        raise ValueError("one histogram row and one max |x| per name")
    columns = headroom_columns(counts, precision)
    limit = max_underflow * columns.nonzero.astype(np.float64) * (1 - 1e-9)
    maybe = (columns.overflowed > 0) | ((columns.flushed > 0) & (columns.flushed >= limit))
    rows = [
        columns.row(i, names[i], max_abs=float(max_abs[i])) for i in np.flatnonzero(maybe).tolist()
    ]
    findings = judge(rows, max_underflow)
    flagged_names = {f.tensor for f in findings}
    total_columns = headroom_columns(counts.sum(axis=0, keepdims=True), precision)
    top = float(max_abs.max()) if len(max_abs) else 0.0
    return StepHeadroom(
        precision,
        max_underflow,
        total_columns.row(0, ALL_TENSORS, max_abs=top),
        tuple(row for row in rows if row.name in flagged_names),
        findings,
    )
