"""Cross-rank consistency of DDP's replicated gradients, on a real 2-process gloo DDP.

The ranks (``tests/training/replica_worker.py``) run as subprocesses under a timeout; each
writes what its monitor saw, and the assertions are here. Every rank judges the same
gathered digests, so both ranks must report the same thing.
"""

from __future__ import annotations

from typing import Any

import pytest

import gradaudit
from tests.ranks import WORLD, run_ranks
from tests.training.replica_worker import PERTURBED

#: Slow (not in the quick loop): starts two gloo processes.
pytestmark = pytest.mark.slow

PARAMETERS = ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    return run_ranks("tests.training.replica_worker", out, "DDP")


def test_healthy_replicas_agree_on_every_step(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for step, seen in enumerate(result["healthy"]):
            assert seen["step"] == step
            assert (seen["world_size"], seen["compared"]) == (WORLD, len(PARAMETERS))
            assert seen["tensor"] is None
            assert seen["differing"] == 0.0


def test_a_perturbed_replica_is_named_with_its_rank(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        seen = result["perturbed"]["record"]
        assert seen["tensor"] == PERTURBED
        assert (seen["ranks"], seen["reference"]) == ([1], [0])
        assert seen["tensors"] == [PERTURBED]
        assert seen["differing"] == 1.0
        assert result["perturbed"]["warnings"] == [
            f"step 0: replicated gradient {PERTURBED} differs on rank 1 from rank 0"
        ]


def test_a_skipped_all_reduce_shows_in_every_tensor_then_heals(
    ranks: list[dict[str, Any]],
) -> None:
    """The default (async) mode: step 0's check is completed by the next call."""
    for result in ranks:
        seen = result["no_sync"]
        assert seen["first"] is None
        assert seen["second"]["step"] == 0
        assert seen["second"]["tensor"] == PARAMETERS[0]
        assert seen["second"]["tensors"] == PARAMETERS
        assert seen["third"]["step"] == 1
        assert seen["third"]["tensor"] is None


def test_raise_stops_every_rank_with_its_own_dump(ranks: list[dict[str, Any]]) -> None:
    dumps = []
    for rank, result in enumerate(ranks):
        raised = result["raise"]
        assert (raised["tensor"], raised["ranks"]) == (PERTURBED, [1])
        assert raised["dump"].endswith(f"step_00000000.rank{rank:05d}.safetensors")
        assert f"{PERTURBED} differs on rank 1 from rank 0" in raised["message"]
        dumps.append(raised["dump"])
    # Offline, the two ranks' dumps name the same tensor.
    parameters = gradaudit.compare_paths(*dumps).parameters
    assert parameters is not None
    assert parameters.first_difference == PERTURBED


def test_compare_says_healthy_ranks_dumps_are_identical(ranks: list[dict[str, Any]]) -> None:
    parameters = gradaudit.compare_paths(*(r["healthy_dump"] for r in ranks)).parameters
    assert parameters is not None
    assert parameters.first_difference is None
    assert parameters.identical
