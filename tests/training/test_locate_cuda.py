"""CUDA checks of the locator and the exponent histogram; skipped cleanly without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gradaudit.engine.histogram import exponent_histogram
from gradaudit.training.locate import NanLocator
from tests.conftest import requires_cuda

pytestmark = [
    pytest.mark.cuda,
    requires_cuda,
]


@pytest.fixture
def sync_debug_error() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_hooks_do_not_sync_and_locate_on_cuda() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Log(), nn.Linear(8, 2)).cuda()
    x = torch.randn(4, 8, device="cuda")
    locator = NanLocator(model)
    with locator:
        loss = model(x).sum()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()  # every hook: device work only
        finally:
            torch.cuda.set_sync_debug_mode("default")
    del loss
    location = locator.read()
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_histogram_matches_the_cpu_and_does_not_sync(
    dtype: torch.dtype, sync_debug_error: None
) -> None:
    torch.cuda.set_sync_debug_mode("default")
    values = (torch.randn(100_000) * 1e-4).to(dtype)
    values[::97] = 0.0
    exponent_histogram(values.cuda())  # tables made once, outside the check
    device_values = values.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    counts = exponent_histogram(device_values)
    torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(counts.cpu(), exponent_histogram(values))
