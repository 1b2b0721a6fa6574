"""The exponent histogram and the headroom it gives, against float64 references.

Two independent references: NumPy float64 (exponents by ``frexp``, rounding to
the target format by ``rint`` on an exact power-of-two quantum, which is
round-to-nearest-even) and what ``tensor.to(dtype)`` actually does on the CPU.
The second one checks torch's casts, not the machine: they are scalar or
vectorised bit operations with one defined result.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradaudit.engine.histogram import exponent_histogram
from gradaudit.precision.formats import FORMATS, ExponentHistogram, Precision, layout
from gradaudit.precision.headroom import headroom, scale_log2
from gradaudit.precision.judging import judge
from tests.reference import reference_rounding
from tests.torch_features import requires_saturating_fp8

TORCH_DTYPES = {
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
    Precision.FP8_E4M3FN: torch.float8_e4m3fn,
    Precision.FP8_E5M2: torch.float8_e5m2,
}


def _histogram(values: torch.Tensor, chunk: int = 1 << 22) -> ExponentHistogram:
    return ExponentHistogram(tuple(exponent_histogram(values, chunk).tolist()))


def _every(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


def _torch_rounding(values: torch.Tensor, precision: Precision) -> tuple[int, int, int]:
    """The same three counts from the CPU cast itself."""
    if values.element_size() == 1:  # fp8: no isfinite on the CPU; float32 holds them exactly
        values = values.to(torch.float32)
    finite = values[torch.isfinite(values) & (values != 0)]
    spec = FORMATS[precision]
    cast = finite.to(TORCH_DTYPES[precision]).to(torch.float64).abs()
    flushed = int((cast == 0).sum())
    subnormal = int(((cast > 0) & (cast < spec.min_normal)).sum())
    if precision is Precision.FP8_E4M3FN:
        # A saturating cast hides where RNE went above 448; the cast goes through float32.
        rounded_up = finite.to(torch.float32).abs() > 464
        overflowed = int(rounded_up.sum())
        assert bool((cast[rounded_up] == 448).all())
    else:
        overflowed = int(torch.isinf(cast).sum())
    return flushed, subnormal, overflowed


def _check(values: torch.Tensor) -> None:
    histogram = _histogram(values)
    as64 = values.to(torch.float64).numpy()
    finite = as64[np.isfinite(as64)]
    nonzero = finite[finite != 0]
    expected: dict[int, int] = {}
    exponents, counts = np.unique(np.frexp(np.abs(nonzero))[1] - 1, return_counts=True)
    for exponent, count in zip(exponents, counts, strict=True):
        expected[int(exponent)] = int(count)
    assert histogram.exponents() == expected
    assert histogram.zeros == int((finite == 0).sum())
    assert histogram.nonfinite == int((~np.isfinite(as64)).sum())
    assert histogram.nonzero == nonzero.size
    for precision in Precision:
        row = headroom("t", histogram, precision)
        got = (row.flushed, row.subnormal, row.overflowed)
        assert got == reference_rounding(as64, precision), precision
        assert got == _torch_rounding(values, precision), precision


@requires_saturating_fp8
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_and_bfloat16_bit_pattern(dtype: torch.dtype) -> None:
    _check(_every(dtype))


@requires_saturating_fp8
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_bit_pattern(dtype: torch.dtype) -> None:
    values = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).view(dtype)
    _check(values)


def _near_boundaries() -> torch.Tensor:
    """Every boundary of the layout and its float32 neighbours, both signs."""
    bits = torch.tensor(layout().boundaries[:-1], dtype=torch.int64)
    around = torch.cat([bits + k for k in range(-3, 4)]).clamp(0, 0x7F7FFFFF)
    values = around.to(torch.int32).view(torch.float32)
    return torch.cat([values, -values])


@requires_saturating_fp8
def test_random_float32_and_every_boundary() -> None:
    generator = torch.Generator().manual_seed(1234)
    random_bits = torch.randint(
        -(1 << 31), (1 << 31) - 1, (200_000,), dtype=torch.int64, generator=generator
    )
    values = torch.cat([random_bits.to(torch.int32).view(torch.float32), _near_boundaries()])
    _check(values)


@requires_saturating_fp8
def test_float64_is_binned_as_the_casts_round_it() -> None:
    """The CPU casts from float64 round to float32 first; so does the histogram."""
    boundaries = _near_boundaries().to(torch.float64)
    # Halfway between float32 neighbours, a hair either side: double rounding shows here.
    ulp = torch.nextafter(boundaries.float(), torch.tensor(math.inf)).double() - boundaries
    values = torch.cat([boundaries + ulp * f for f in (0.4999, 0.5, 0.5001, -0.5, -0.5001)])
    values = values[torch.isfinite(values)]
    histogram = _histogram(values)
    for precision in Precision:
        row = headroom("t", histogram, precision)
        assert (row.flushed, row.subnormal, row.overflowed) == _torch_rounding(values, precision), (
            precision
        )


def test_chunks_merge_exactly() -> None:
    values = _every(torch.float16)
    whole = _histogram(values)
    assert _histogram(values, chunk=1000) == whole
    halves = _histogram(values[:30000]) + _histogram(values[30000:])
    assert halves == whole
    assert ExponentHistogram.merge([_histogram(values[:5]), _histogram(values[5:])]) == whole


def test_strided_and_empty_tensors() -> None:
    values = torch.randn(64, 64).t()
    assert _histogram(values) == _histogram(values.contiguous())
    empty = _histogram(torch.empty(0))
    assert empty.nonzero == 0
    assert headroom("e", empty, Precision.FP16).dynamic_range is None


def test_scale_is_the_largest_power_of_two_without_overflow() -> None:
    for precision, spec in FORMATS.items():
        dtype = TORCH_DTYPES[precision]
        for max_abs in (1e-30, 3.0e-7, 0.5, 1.0, 448.0, 1000.0, 70000.0):
            s = scale_log2(max_abs, spec)
            assert s is not None
            top = torch.tensor([max_abs * 2.0**s, max_abs * 2.0 ** (s + 1)], dtype=torch.float32)
            cast = top.to(dtype).to(torch.float64)
            fits = cast[0] <= spec.max and math.isfinite(cast[0])
            beyond = top[1].item() >= spec.overflow_from
            assert fits, (precision, max_abs)
            assert beyond, (precision, max_abs)
    assert scale_log2(0.0, FORMATS[Precision.FP16]) is None


def test_findings_name_underflow_and_overflow() -> None:
    values = torch.cat([torch.full((90,), 1e-3), torch.full((10,), 1e-9), torch.tensor([1e5])])
    row = headroom("w", _histogram(values), Precision.FP16, max_abs=1e5)
    assert row.flushed == 10
    assert row.overflowed == 1
    found = judge([row], max_underflow=0.05)
    assert [f.kind for f in found] == ["underflow", "overflow"]
    assert "scale by 2**-1" in found[1].message
    assert judge([row], max_underflow=0.5)[0].kind == "overflow"


def test_finding_messages_agree_with_their_counts() -> None:
    one = torch.tensor([1e-9, 1e5])
    row = headroom("w", _histogram(one), Precision.FP16, max_abs=1e5)
    underflow, overflow = (f.message for f in judge([row], max_underflow=0.1))
    assert underflow.startswith("50.0% of 2 non-zero values flush to zero in fp16")
    assert overflow.startswith("1 value overflows fp16 (Inf)")
    two = torch.tensor([1e-9, 1e5, -1e6])
    row = headroom("w", _histogram(two), Precision.FP16, max_abs=1e6)
    assert judge([row], max_underflow=0.5)[0].message.startswith("2 values overflow fp16")
    single = headroom("w", _histogram(torch.tensor([1e-9])), Precision.FP16, max_abs=1e-9)
    assert judge([single])[0].message.startswith("100.0% of 1 non-zero value flushes to zero")


def test_finding_counts_carry_the_tables_thousands_separator() -> None:
    values = torch.cat([torch.full((2070,), 1e5), torch.full((1500,), 1e-9)])
    row = headroom("w", _histogram(values), Precision.FP16, max_abs=1e5)
    underflow, overflow = (f.message for f in judge([row], max_underflow=0.1))
    assert underflow.startswith("42.0% of 3,570 non-zero values flush to zero in fp16")
    assert overflow.startswith("2,070 values overflow fp16 (Inf)")
