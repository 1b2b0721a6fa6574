"""One rank of the 2-process DDP tests: ``python -m tests.training.replica_worker RANK WORLD DIR``.

A real gloo ``DistributedDataParallel`` on the CPU, audited by a ``GradientMonitor`` in
four cases: a healthy run, one rank perturbing a gradient after the all-reduce, both ranks
skipping the all-reduce (``no_sync``) on different batches, and ``on_divergence="raise"``
with dumps. Each rank writes what it saw to ``DIR/rank{RANK}.json``; the assertions live in
``tests/training/test_replicas.py``, so a failure names the case.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import gradaudit
from gradaudit.integrations.scalars import record_scalars
from tests.ranks import destroy_group, finish_rank, start_rank

#: The gradient one rank perturbs in the ``perturbed`` case (the second Linear's weight).
PERTURBED = "2.weight"


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them too)
    inner = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return torch.nn.parallel.DistributedDataParallel(inner)


def backward(ddp: torch.nn.Module, rank: int, step: int) -> None:
    """Each rank its own batch, as in data-parallel training."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 6, generator=gen)
    ddp.zero_grad()
    ddp(x).pow(2).mean().backward()


def describe(record: gradaudit.MonitorRecord | None) -> dict[str, Any] | None:
    if record is None or record.replicas is None:
        return None
    divergence = record.replicas.divergence
    return {
        "step": record.step,
        "world_size": record.replicas.world_size,
        "compared": record.replicas.compared,
        "tensor": None if divergence is None else divergence.tensor,
        "ranks": None if divergence is None else list(divergence.ranks),
        "reference": None if divergence is None else list(divergence.reference),
        "tensors": None if divergence is None else list(divergence.tensors),
        "differing": record_scalars(record).get("gradaudit/replicas/differing"),
    }


def healthy(rank: int) -> list[Any]:
    ddp = model()
    monitor = gradaudit.GradientMonitor(
        ddp, every=1, sync=True, on_divergence="raise", dump_dir=None
    )
    seen = []
    for step in range(3):
        backward(ddp, rank, step)
        seen.append(describe(monitor.step()))
    return seen


def perturbed(rank: int) -> dict[str, Any]:
    ddp = model()
    monitor = gradaudit.GradientMonitor(
        ddp, every=1, sync=True, on_divergence="warn", dump_dir=None
    )
    backward(ddp, rank, 0)
    if rank == 1:  # after the all-reduce: this replica silently diverges
        weight = dict(ddp.module.named_parameters())[PERTURBED]
        assert weight.grad is not None
        weight.grad[0, 0] += 1e-3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = monitor.step()
    return {
        "record": describe(record),
        "warnings": [
            str(w.message) for w in caught if w.category is gradaudit.ReplicaDivergenceWarning
        ],
    }


def skipped_all_reduce(rank: int) -> dict[str, Any]:
    """``no_sync`` on different batches: every gradient differs; the default (async) mode."""
    ddp = model()
    monitor = gradaudit.GradientMonitor(ddp, every=1, on_divergence="ignore", dump_dir=None)
    with ddp.no_sync():
        backward(ddp, rank, 0)
    first = monitor.step()
    backward(ddp, rank, 1)  # all-reduced again: agrees
    second = monitor.step()
    third = monitor.flush()
    return {"first": describe(first), "second": describe(second), "third": describe(third)}


def raising(rank: int, out: Path) -> dict[str, Any]:
    ddp = model()
    monitor = gradaudit.GradientMonitor(
        ddp, every=1, sync=True, on_divergence="raise", dump_dir=out / "dumps"
    )
    backward(ddp, rank, 0)
    if rank == 1:
        dict(ddp.module.named_parameters())[PERTURBED].grad.mul_(2.0)  # type: ignore[union-attr]
    try:
        monitor.step()
    except gradaudit.ReplicaDivergenceError as error:
        return {
            "tensor": error.tensor,
            "ranks": list(error.ranks),
            "dump": None if error.dump is None else str(error.dump),
            "message": str(error),
        }
    return {"raised": False}


def healthy_dump(rank: int, out: Path) -> str:
    """Each rank's gradients after a healthy all-reduce, written for ``compare``."""
    ddp = model()
    backward(ddp, rank, 0)
    path = out / f"healthy.rank{rank}.safetensors"
    gradaudit.save_gradients(gradaudit.named_gradients(ddp), path)
    return str(path)


def main() -> None:
    rank, _, out = start_rank()
    try:
        results = {
            "healthy": healthy(rank),
            "perturbed": perturbed(rank),
            "no_sync": skipped_all_reduce(rank),
            "raise": raising(rank, out),
            "healthy_dump": healthy_dump(rank, out),
        }
    finally:
        destroy_group()
    finish_rank(out, rank, results)


if __name__ == "__main__":
    main()
