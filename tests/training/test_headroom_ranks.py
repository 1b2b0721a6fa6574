"""A monitor's ``precision=`` across ranks: the headroom of the whole parameters on every rank.

Two gloo processes (``tests/training/headroom_worker.py``) each hold a part of every
gradient, as ``group=`` shards or as ``DTensor`` shards (1-D mesh, and a 2-D mesh with a
``Replicate`` dimension); their monitors' headroom must be the headroom of the whole
tensors in one process, count for count, and the float64 reference's. The ``diluted``
tensors would have a ``cast`` finding on rank 1 if its shard were judged alone, and the
others' findings come from one rank's shard: both ranks must report them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gradaudit import PendingStats
from gradaudit.precision import Precision, precision_report
from tests.ranks import run_ranks
from tests.reference import reference_rounding
from tests.training.headroom_worker import CUTS, TINY, dtensor_wholes, group_wholes

#: Slow (not in the quick loop): starts two gloo processes.
pytestmark = pytest.mark.slow

CASES = ("group", "dtensor")
FORMATS = [p.value for p in Precision]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("headroom")
    return run_ranks("tests.training.headroom_worker", out, "headroom")


def _audited(case: str) -> dict[str, torch.Tensor]:
    """The whole tensors the monitors audited (not the skipped ``ints`` and ``partial``)."""
    wholes = group_wholes() if case == "group" else dtensor_wholes()
    return {name: t for name, t in wholes.items() if name not in ("ints", "partial")}


def _whole_pending(case: str) -> PendingStats:
    pending = PendingStats(histograms=True)
    pending.add_all(_audited(case))
    return pending


def test_ranks_agree(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    for case in (*CASES, "fsdp"):
        assert first[case] == second[case], case


@pytest.mark.parametrize("case", CASES)
def test_summed_histograms_are_the_whole_tensors(ranks: list[dict[str, Any]], case: str) -> None:
    """Every bin of every parameter, exactly; the skipped tensors take no row."""
    pending = _whole_pending(case)
    expected = pending.histogram_counts()
    for result in ranks:
        got = result[case]
        assert got["names"] == list(_audited(case))
        assert np.array_equal(np.array(got["counts"], dtype=np.int64), expected)


@pytest.mark.parametrize("precision", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_headroom_is_the_whole_tensors(
    ranks: list[dict[str, Any]], case: str, precision: str
) -> None:
    whole = precision_report(_whole_pending(case).materialize(), Precision(precision))
    keys = ("nonzero", "flushed", "subnormal", "overflowed")
    keys += ("min_exponent", "max_exponent", "scale_log2")
    rows = {row.name: {key: getattr(row, key) for key in keys} for row in whole.tensors}
    flagged = {f.tensor for f in whole.findings}
    assert flagged  # the cases were made to have some
    values = np.concatenate([t.reshape(-1).double().numpy() for t in _audited(case).values()])
    reference = reference_rounding(values, Precision(precision))
    for result in ranks:
        seen = result[case]["monitor"][precision]
        total = seen["total"]
        assert {key: total[key] for key in keys} == {key: getattr(whole.total, key) for key in keys}
        assert (total["flushed"], total["subnormal"], total["overflowed"]) == reference
        assert total["nonzero"] == int((values != 0).sum())
        assert [row["name"] for row in seen["flagged"]] == [
            name for name in rows if name in flagged
        ]
        for row in seen["flagged"]:
            assert {key: row[key] for key in keys} == rows[row["name"]]
        assert seen["findings"] == [[f.kind, f.tensor] for f in whole.findings]
        assert seen["cast"] == sorted(f.tensor for f in whole.findings)  # the record's


@pytest.mark.parametrize("case", CASES)
def test_a_shards_finding_is_every_ranks(ranks: list[dict[str, Any]], case: str) -> None:
    """Findings caused by rank 1's shard alone are reported by rank 0 too; a shard that
    would be flagged alone but not within the whole tensor is not."""
    one_rank = (
        {"overflow_on_rank1", "flush_on_rank1"}
        if case == "group"
        else {"shard0_flush", "shard1_overflow", "mesh2d_shard_replicate"}
    )
    for result in ranks:
        for precision in FORMATS:
            cast = set(result[case]["monitor"][precision]["cast"])
            assert one_rank <= cast, (precision, one_rank - cast)
            assert "diluted" not in cast, precision


def test_a_real_fsdp2_model(ranks: list[dict[str, Any]]) -> None:
    """FSDP2's own DTensor gradients: the monitor's headroom is that of the gathered whole
    gradients, and rank 1's planted overflow in ``0.weight`` is a finding on both ranks."""
    for result in ranks:
        for precision in FORMATS:
            seen = result["fsdp"]["monitor"][precision]
            whole = result["fsdp"]["whole"][precision]
            assert seen["total"] == whole["total"]
            assert seen["findings"] == whole["findings"]
            assert ["overflow", "0.weight"] in seen["findings"]
            assert "0.weight" in seen["cast"]


def test_the_cases_really_split() -> None:
    """The ``diluted`` shards are over the limit alone, the whole tensors under it; the
    one-rank findings' values are all in rank 1's part."""
    limit = 0.01
    group = group_wholes()
    diluted = group["diluted"]
    assert (diluted[CUTS["diluted"] :] == TINY).float().mean() > limit
    assert (diluted == TINY).float().mean() < limit
    for name in ("overflow_on_rank1", "flush_on_rank1"):
        rank0 = group[name][: CUTS[name]]
        assert rank0.abs().max() < 2
        assert rank0.abs().min() >= 1
    dtensors = dtensor_wholes()
    half = dtensors["diluted"][500:]  # Shard(0) of 1000 on 2 ranks
    assert (half == TINY).float().mean() > limit
    assert (dtensors["diluted"] == TINY).float().mean() < limit
    assert (dtensors["shard0_flush"][:5] != TINY).all()
    assert (dtensors["shard1_overflow"][:, :3].abs() < 2).all()
    assert (dtensors["mesh2d_shard_replicate"][:3].abs() < 1e38).all()
