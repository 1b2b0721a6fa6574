"""Running a test's ranks as subprocesses (gloo, no torchrun): one place for the environment,
the timeout and how a failed or hung rank is reported."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Generous: two gloo processes on a loaded 2-core machine take seconds, a hang forever.
TIMEOUT_S = 240
WORLD = 2
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a torchrun job's variables, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def run_ranks(module: str, out: Path, what: str, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``python -m module RANK WORLD OUT`` for every rank at once; each writes
    ``OUT/rank{r}.json``, returned in rank order. A rank that fails or a job that hangs
    fails the test, with the rank's stderr."""
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", module, str(rank), str(WORLD), str(out)],
            cwd=ROOT,
            env=clean_env() if env is None else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
            worker.communicate()
        pytest.fail(f"the {what} workers did not finish within {TIMEOUT_S} s")
    for rank, (worker, (_, stderr)) in enumerate(zip(workers, outputs, strict=True)):
        assert worker.returncode == 0, f"rank {rank} failed:\n{stderr}"
    return [json.loads((out / f"rank{r}.json").read_text("utf-8")) for r in range(WORLD)]


def start_rank() -> tuple[int, int, Path]:
    """A worker's first step, run as ``python -m module RANK WORLD OUT`` by
    :func:`run_ranks`: one thread (every rank takes the same engine path, as a test's
    single-process reference does) and a gloo process group met through a file in ``OUT``.
    Returns ``(rank, world, out)``."""
    import torch
    import torch.distributed as dist

    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=world
    )
    return rank, world, out


#: How long the gloo workers get, the GIL let go, before their process group is destroyed.
SETTLE_S = 0.2


def destroy_group() -> None:
    """``dist.destroy_process_group()``, once gloo's worker threads have had a moment with
    the GIL. Before torch 2.8 (pytorch/pytorch#154976; the floor leg runs 2.4) the group's
    destructor joins its worker threads holding the GIL, and a worker still freeing a
    finished collective's tensors needs the GIL: a deadlock (pytorch/pytorch#56297), seen
    once in the floor leg (``ProcessGroupGloo::~ProcessGroupGloo`` in ``thread::join``, a
    worker in ``AsyncWork::~AsyncWork`` waiting in ``take_gil``). Sleeping lets the GIL go
    while they finish; it narrows the race, the one fix being torch's."""
    import torch.distributed as dist

    time.sleep(SETTLE_S)
    dist.destroy_process_group()


@contextlib.contextmanager
def single_rank_group(directory: Path) -> Iterator[None]:
    """A gloo process group of this process alone (rank 0 of 1, met through a file in
    ``directory``), destroyed on the way out (:func:`destroy_group`)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{directory / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        destroy_group()


def finish_rank(out: Path, rank: int, result: Any) -> None:
    """A worker's last step: the process group destroyed (where it is still up: Lightning
    and the Trainer leave theirs), ``OUT/rank{rank}.json`` written for :func:`run_ranks`,
    and the process left without interpreter finalisation. Device meshes keep their gloo
    groups in a global registry, and a gloo thread that releases a finished collective
    during finalisation aborts the process ("terminate called without an active
    exception": a PyTorch race seen in about one run in ten here, and once on a Lightning
    rank in CI)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        destroy_group()
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
