"""Which dtypes are audited, and the names and reasons every output uses for them.

The predicates a reader needs (:func:`hides_values`, :func:`dtype_skip_reason`), apart from
the collector in :mod:`gradaudit.engine.stats`: a reader imports these and not the kernels,
Triton's host side and the staging behind the collector.
"""

from __future__ import annotations

import functools

import torch

from gradaudit.results.row import skip_reason

#: Every fp8 variant this torch has. The native and Triton kernels know e4m3fn and e5m2;
#: the others (NaN-only "fnuz" encodings, the exponent-only e8m0 scales of MX formats)
#: reach the eager kernel through an exact float32 copy, which keeps NaN as NaN.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
)

#: Complex dtypes: audited through the float64 modulus of each element
#: (:func:`~gradaudit.engine.kernels.complex_magnitudes`), NaN/Inf in either part counting.
COMPLEX_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.complex32, torch.complex64, torch.complex128}
)

#: Dtypes that are audited numerically; everything else is reported as skipped.
AUDITED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        *FLOAT8_DTYPES,
        *COMPLEX_DTYPES,
    }
)


@functools.lru_cache(maxsize=64)
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, the spelling used in every output."""
    return str(dtype).removeprefix("torch.")


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is reduced in: float64 stays, everything else becomes float32.

    A float32 copy of half, bfloat16 or fp8 values is exact, and CPU kernels for
    isinf/max/norm are missing for fp8. Complex tensors are reduced as their
    float64 moduli.
    """
    return torch.float64 if dtype == torch.float64 or dtype.is_complex else torch.float32


def hides_values(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` that is not audited could hide a NaN or an Inf.

    Integer and boolean tensors cannot hold either; a floating-point or complex
    one the engine did not read could, and the verdict must say so (a
    ``skipped`` finding) instead of passing silently.
    """
    return dtype.is_floating_point or dtype.is_complex


def not_audited_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` is skipped rather than audited, or ``None`` when it is audited."""
    if tensor.layout is not torch.strided:
        return f"{str(tensor.layout).removeprefix('torch.')} tensors are not audited"
    return dtype_skip_reason(tensor.dtype)


def dtype_skip_reason(dtype: torch.dtype) -> str | None:
    """Why a tensor of ``dtype`` is skipped, or ``None`` when the dtype is audited."""
    if dtype in AUDITED_DTYPES:
        return None
    return skip_reason(dtype_name(dtype), floating=dtype.is_floating_point)
