"""The merge rule's collectives, on a gloo group of one rank (two ranks:
``tests/scan/test_distributed.py``, ``tests/training/test_headroom_ranks.py``).

Alone, a rank's sums are its own values: what is checked is that the counts folded into
the rows' SUM come back exactly, as int64, in their own columns, and leave the rows as
``all_reduce_rows`` gives them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradaudit.engine.collectives import all_reduce_rows, all_reduce_rows_and_counts
from gradaudit.engine.stats import StatsCollector
from tests.ranks import single_rank_group


@pytest.fixture
def alone(tmp_path: Path) -> Iterator[None]:
    with single_rank_group(tmp_path):
        yield


@pytest.mark.usefixtures("alone")
def test_counts_ride_in_the_rows_sum_exactly() -> None:
    collector = StatsCollector()
    tensors = [torch.tensor([3.0, -4.0, 0.0]), torch.tensor([1e-30, float("nan")])]
    rows = torch.stack([collector.row(t) for t in tensors])
    # Large counts: above int32, and the largest float64 holds exactly (2**53 - 1).
    counts = torch.tensor([[0, 1, 3_000_000_007], [2**53 - 1, 5, 0]], dtype=torch.int64)
    merged, summed = all_reduce_rows_and_counts(rows.clone(), counts.clone())
    assert summed.dtype == torch.int64
    assert torch.equal(summed, counts)
    assert torch.equal(merged, all_reduce_rows(rows.clone()))
