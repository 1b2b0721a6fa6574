"""The collection function compiles whole with torch.compile(fullgraph=True) on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from gradaudit.engine.kernels import collect_rows
from gradaudit.engine.stats import StatsCollector
from gradaudit.results.row import HostRow
from tests.reference import reference_stats

#: Slow (not in the quick loop): torch.compile of the row kernel (~12 s).
pytestmark = pytest.mark.slow


def gradients() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(64, 32, generator=gen) * 1e19
    weight[3, 4] = math.nan
    bias = torch.randn(32, generator=gen, dtype=torch.float64) * 1e200
    bias[0] = -math.inf
    half = (torch.randn(100, generator=gen) * 300).to(torch.float16)
    return [weight, bias, half, torch.tensor(2.5), torch.empty(0, 3)]


def test_collect_rows_compiles_with_fullgraph_and_matches_the_reference() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(collect_rows, fullgraph=True, dynamic=False)
    tensors = gradients()
    rows = compiled(tensors)
    assert rows.shape == (len(tensors), 7)
    for tensor, values in zip(tensors, rows.tolist(), strict=True):
        got = HostRow.from_values(values)
        ref = reference_stats(tensor)
        assert (got.nan, got.pos_inf, got.neg_inf, got.zeros) == (
            ref.nan,
            ref.pos_inf,
            ref.neg_inf,
            ref.zeros,
        )
        assert got.max_abs == ref.max_abs
        assert got.norm == pytest.approx(ref.norm, rel=1e-6, abs=0.0)


def test_collect_rows_eagerly_equals_the_collector() -> None:
    tensors = gradients()
    eager = collect_rows(tensors)
    collector = StatsCollector()
    reference = torch.stack([collector.row(t) for t in tensors]).cpu()
    assert torch.allclose(eager[:, :5], reference[:, :5])
    norms = [HostRow.from_values(v).norm for v in eager.tolist()]
    expected = [HostRow.from_values(v).norm for v in reference.tolist()]
    assert norms == pytest.approx(expected, rel=1e-12)
