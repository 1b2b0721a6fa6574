"""What the installed torch can do, for tests of features newer than the oldest torch the
package claims (``torch>=2.4``). A test of such a feature is skipped where torch lacks it,
named by the feature, never by a version guess where a probe can say it."""

from __future__ import annotations

import pytest
import torch

_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _named_optimizers() -> bool:
    # By version, not by building an optimizer: torch.optim pulls in torch._dynamo and with
    # it triton, which must not be imported before TRITON_INTERPRET is set (the Triton tests
    # set it when they are collected, after this module).
    return _VERSION >= (2, 5)


def _saturating_fp8_cast() -> bool:
    return bool(torch.tensor([1000.0]).to(torch.float8_e4m3fn).float().item() == 448.0)


def has_dtype(name: str) -> bool:
    """Whether this torch has the dtype ``torch.<name>``."""
    return isinstance(getattr(torch, name, None), torch.dtype)


#: Optimizers built from ``named_parameters()`` record ``param_names`` (torch >= 2.5).
requires_named_optimizers = pytest.mark.skipif(
    not _named_optimizers(), reason="optimizers over named_parameters() need torch >= 2.5"
)
requires_adafactor = pytest.mark.skipif(
    not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor needs torch >= 2.5"
)
requires_set_stance = pytest.mark.skipif(
    not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance needs torch >= 2.6"
)
#: The precision tables follow torch's saturating float8_e4m3fn cast (448); older torch
#: casts overflow to NaN.
requires_saturating_fp8 = pytest.mark.skipif(
    not _saturating_fp8_cast(), reason="this torch casts float8_e4m3fn overflow to NaN, not 448"
)
#: Behaviours of torch's own loader and hooks that tests pin, as torch 2.6+ words them.
requires_torch_2_6 = pytest.mark.skipif(
    _VERSION < (2, 6), reason="pins torch >= 2.6's own messages and warnings"
)


def requires_dtype(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not has_dtype(name), reason=f"this torch has no {name}")
