"""The framework hooks under real 2-process gloo DDP: is the cross-rank replica check run?

Each framework wraps the model in ``DistributedDataParallel`` itself and hands its hook the
module inside (the Trainer's ``model``, the LightningModule) or leaves the choice to the user
(Accelerate). The ranks (``tests/integrations/ddp_worker.py``) train 4 steps under the real
library; on one step rank 1 perturbs one gradient after DDP's all-reduce. Every rank judges
the same gathered digests, so both must report the same thing: the healthy steps agree, the
perturbed one names the parameter and rank 1.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.ddp_worker import PERTURBED, PERTURBED_STEP, STEPS
from tests.ranks import WORLD, clean_env, run_ranks

#: Slow (not in the quick loop): two gloo processes train under each real framework.
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _run(framework: str, out: Path) -> list[dict[str, Any]]:
    env = clean_env(
        GRADAUDIT_FRAMEWORK=framework, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    return run_ranks("tests.integrations.ddp_worker", out, f"{framework} DDP", env=env)


@pytest.fixture(scope="module")
def transformers_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    return _run("transformers", tmp_path_factory.mktemp("hf_ddp"))


@pytest.fixture(scope="module")
def lightning_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    return _run("lightning", tmp_path_factory.mktemp("lightning_ddp"))


@pytest.fixture(scope="module")
def accelerate_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("accelerate", reason="the transformers extra is not installed")
    return _run("accelerate", tmp_path_factory.mktemp("accelerate_ddp"))


def _assert_checked(seen: list[dict[str, Any] | None], framework: str, first_step: int) -> None:
    """Every step checked across both ranks; only the perturbed one differs, in one tensor."""
    assert [s["step"] if s else None for s in seen] == list(range(first_step, first_step + STEPS))
    compared = {s["compared"] for s in seen if s}
    assert len(compared) == 1
    assert compared.pop() > 1
    for s in seen:
        assert s is not None
        assert s["world_size"] == WORLD
        if s["step"] == PERTURBED_STEP[framework]:
            assert s["tensor"] == PERTURBED[framework]
            assert (s["ranks"], s["reference"], s["tensors"]) == ([1], [0], [s["tensor"]])
            assert s["differing"] == 1.0
        else:  # healthy: DDP's all-reduce left the same bits on both ranks
            assert s["tensor"] is None
            assert s["differing"] == 0.0


def _message(framework: str) -> str:
    step, name = PERTURBED_STEP[framework], PERTURBED[framework]
    return f"step {step}: replicated gradient {name} differs on rank 1 from rank 0"


def test_trainer_callback_finds_the_ddp_wrapper_and_names_a_diverged_replica(
    transformers_ranks: list[dict[str, Any]],
) -> None:
    """The Trainer hands callbacks the unwrapped model; the callback finds model_wrapped."""
    for result in transformers_ranks:
        assert result["wrapper"] == "DistributedDataParallel"
        _assert_checked(result["seen"], "transformers", first_step=1)
        assert result["warnings"] == [_message("transformers")]
        # The count is in the log row of its own step, beside the Trainer's own keys.
        expected = [1.0 if step == PERTURBED_STEP["transformers"] else 0.0 for step in (1, 2, 3, 4)]
        assert result["logged"] == expected


def test_lightning_callback_finds_the_strategys_wrapper_and_names_a_diverged_replica(
    lightning_ranks: list[dict[str, Any]],
) -> None:
    for result in lightning_ranks:
        _assert_checked(result["seen"], "lightning", first_step=0)
        assert result["warnings"] == [_message("lightning")]
        assert result["told"] == []


def test_accelerate_checks_a_monitor_over_the_prepared_model(
    accelerate_ranks: list[dict[str, Any]],
) -> None:
    for result in accelerate_ranks:
        assert result["wrapper"] == "DistributedDataParallel"
        _assert_checked(result["seen_prepared"], "accelerate", first_step=0)
        assert result["warnings"] == [_message("accelerate")]


def test_accelerate_says_once_that_a_monitor_over_the_unprepared_model_cannot_check(
    accelerate_ranks: list[dict[str, Any]],
) -> None:
    """Accelerate keeps no reference to the wrapper it returns: nothing to find."""
    for result in accelerate_ranks:
        assert result["seen"] == [None] * STEPS
        assert len(result["told"]) == 1
        assert "build it over the prepared model" in result["told"][0]
