"""One rank of the 2-process headroom tests: ``python -m tests.training.headroom_worker RANK
WORLD DIR``.

A ``GradientMonitor(precision=...)`` over gradients each rank holds a part of: plain tensors
cut between the ranks with ``group=`` (:func:`group_wholes`, cut at :data:`CUTS`),
``DTensor`` gradients on a 1-D and a 2-D CPU mesh (:func:`dtensor_wholes`, placed in
:func:`run_dtensor`), and a real FSDP2 model (:func:`run_fsdp`). Each rank writes its
monitor's headroom for every format, and the summed exponent histograms, to
``DIR/rank{RANK}.json``; ``tests/training/test_headroom_ranks.py`` compares them with the
headroom of the whole tensors in one process and with the float64 reference, so a failure
names the case.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradaudit import GradientMonitor
from gradaudit.precision import Headroom, Precision
from gradaudit.training.distributed import collect_sharded_with_histograms
from tests.ranks import destroy_group, finish_rank, start_rank

#: Where the ``group=`` case cuts each flat (or 2-D, by rows) tensor between rank 0 and 1.
CUTS = {
    "spread": 5,  # rows of a [12, 10]; each rank's piece is not contiguous
    "ints": 2,
    "overflow_on_rank1": 40,
    "flush_on_rank1": 32,
    "diluted": 950,
    "bf16_spread": 30,
    "fp64_tiny": 7,
    "all_on_rank0": 3,
}
#: In the ``diluted`` tensors, values that flush in every format: enough on rank 1 for a
#: finding on its own shard, too few among the whole tensor's.
TINY = 1e-42
HUGE = 3.4e38  # overflows every format, bf16 included


def _spread(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Values over many binades (2**-40 .. 2**12): many bins, some flushing in each format."""
    magnitude = torch.exp2(torch.randint(-40, 12, shape, generator=gen).float())
    sign = torch.randn(shape, generator=gen).sign()
    return magnitude * sign * torch.rand(shape, generator=gen)


def _plain(n: int, gen: torch.Generator) -> torch.Tensor:
    """Values in [1, 2) with a sign: nothing flushes or overflows in any format."""
    return (1 + torch.rand(n, generator=gen)) * torch.randn(n, generator=gen).sign()


def group_wholes() -> dict[str, torch.Tensor]:
    """The whole gradients of the ``group=`` case, the same in every process."""
    gen = torch.Generator().manual_seed(5)
    overflow = _plain(64, gen)
    overflow[50] = HUGE  # rank 1's part
    flush = _plain(64, gen)
    flush[40:] = TINY  # rank 1's part: 24 of 64 flush
    diluted = _plain(1000, gen)
    diluted[[960, 970, 980]] = TINY  # 3 of rank 1's 50 (6%), 3 of 1000 (0.3%)
    tiny = torch.zeros(20, dtype=torch.float64)
    tiny[10:] = torch.randn(10, generator=gen, dtype=torch.float64) * 1e-300  # below fp32
    tiny[:5] = torch.randn(5, generator=gen, dtype=torch.float64)
    return {
        "spread": _spread((12, 10), gen),
        "ints": torch.arange(4),  # skipped: its place among the entries is not a row
        "overflow_on_rank1": overflow,
        "flush_on_rank1": flush,
        "diluted": diluted,
        "bf16_spread": _spread((77,), gen).to(torch.bfloat16),
        "fp64_tiny": tiny,
        "all_on_rank0": _spread((3,), gen),  # rank 1's piece is empty
    }


def dtensor_wholes() -> dict[str, torch.Tensor]:
    """The whole gradients of the DTensor case (placements in :func:`run_dtensor`)."""
    gen = torch.Generator().manual_seed(6)
    flush = _plain(40, gen).reshape(10, 4)
    flush[6:] = TINY  # Shard(0): rank 1's rows 5..9
    overflow = _plain(24, gen).reshape(4, 6)
    overflow[0, 5] = HUGE  # Shard(1): rank 1's columns 3..5
    diluted = _plain(1000, gen)
    diluted[990:998] = TINY  # 8 of rank 1's 500 (1.6%), 8 of 1000 (0.8%)
    shard_replicate = _spread((6, 3), gen)
    shard_replicate[5, 0] = HUGE
    return {
        "shard0_flush": flush,
        "partial": _plain(5, gen),  # skipped (a Partial placement)
        "shard1_overflow": overflow,
        "replicate_spread": _spread((9,), gen),
        "mesh2d_replicate_shard": _spread((6, 2), gen),
        "mesh2d_shard_replicate": shard_replicate,
        "diluted": diluted,
    }


def _module_with_grads(grads: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, grad in grads.items():
        param = torch.nn.Parameter(torch.zeros_like(grad), requires_grad=grad.is_floating_point())
        param.grad = grad
        module.register_parameter(name, param)
    return module


def _row(row: Headroom) -> dict[str, Any]:
    keys = ("name", "nonzero", "flushed", "subnormal", "overflowed")
    more = ("min_exponent", "max_exponent", "scale_log2")
    return {key: getattr(row, key) for key in (*keys, *more)}


def _headrooms(module: torch.nn.Module, group: dist.ProcessGroup | None, sync: bool) -> Any:
    """Every format's headroom, as each rank's monitor judged it (sync or one step late)."""
    seen = {}
    for precision in Precision:
        monitor = GradientMonitor(
            module,
            every=1,
            sync=sync,
            dump_dir=None,
            on_finding="ignore",
            precision=precision,
            group=group,
        )
        record = monitor.step() if sync else (monitor.step(), monitor.flush())[1]
        assert record is not None
        assert record.headroom is not None
        headroom = record.headroom
        seen[precision.value] = {
            "total": _row(headroom.total),
            "flagged": [_row(row) for row in headroom.flagged],
            "findings": [[f.kind, f.tensor] for f in headroom.findings],
            "cast": sorted(f.tensor for f in record.findings if f.kind.value == "cast"),
        }
    return seen


def _counts(module: torch.nn.Module, group: dist.ProcessGroup | None) -> dict[str, Any]:
    pairs = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    pending, histograms = collect_sharded_with_histograms(pairs, group=group)
    return {
        "names": [entry.name for entry in pending.entries],
        "counts": histograms.histogram_counts().tolist(),
    }


def run_group(rank: int) -> dict[str, Any]:
    pieces = {}
    for name, whole in group_wholes().items():
        cut = CUTS[name]
        piece = whole[:cut] if rank == 0 else whole[cut:]
        if name == "spread":
            piece = piece.t().contiguous().t()  # the histogram's other route
            assert not piece.is_contiguous()
        pieces[name] = piece.clone() if piece.is_contiguous() else piece
    module = _module_with_grads(pieces)
    group = dist.group.WORLD
    return {"monitor": _headrooms(module, group, sync=True), **_counts(module, group)}


def run_dtensor(world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("outer", "inner"))
    whole = dtensor_wholes()
    placed = {
        "shard0_flush": (mesh, [Shard(0)]),
        "shard1_overflow": (mesh, [Shard(1)]),
        "replicate_spread": (mesh, [Replicate()]),
        "mesh2d_replicate_shard": (mesh2d, [Replicate(), Shard(0)]),
        "mesh2d_shard_replicate": (mesh2d, [Shard(0), Replicate()]),
        "diluted": (mesh, [Shard(0)]),
    }
    grads = {}
    for name, tensor in whole.items():
        if name == "partial":
            grads[name] = DTensor.from_local(tensor / world, mesh, [Partial()])
        else:
            on, placements = placed[name]
            grads[name] = distribute_tensor(tensor, on, placements)
    module = _module_with_grads(grads)
    return {"monitor": _headrooms(module, None, sync=False), **_counts(module, None)}


def run_fsdp(world: int) -> dict[str, Any]:
    """A real FSDP2 model; rank 1 plants an overflow in its shard of ``0.weight``. Each rank
    also judges the gathered whole gradients (``full_tensor()``) in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradaudit import PendingStats
    from gradaudit.precision import precision_report

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 5)).sum().backward()
    if dist.get_rank() == 1:
        model[0].weight.grad.to_local()[0, 0] = HUGE  # type: ignore[union-attr]
    seen = _headrooms(model, None, sync=True)
    whole = PendingStats(histograms=True)
    for name, param in model.named_parameters():
        assert param.grad is not None
        whole.add(name, param.grad.full_tensor())  # type: ignore[attr-defined]
    expected = {}
    for precision in Precision:
        report = precision_report(whole.materialize(), precision)
        expected[precision.value] = {
            "total": _row(report.total),
            "findings": [[f.kind, f.tensor] for f in report.findings],
        }
    return {"monitor": seen, "whole": expected}


def main() -> None:
    rank, world, out = start_rank()
    try:
        results = {
            "group": run_group(rank),
            "dtensor": run_dtensor(world),
            "fsdp": run_fsdp(world),
        }
    finally:
        destroy_group()
    finish_rank(out, rank, results)


if __name__ == "__main__":
    main()
