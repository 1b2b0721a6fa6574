"""One rank of the 2-process gloo tests: ``python -m tests.distributed_worker RANK WORLD DIR``.

Every case collects on shards across the ranks and writes what it got to
``DIR/rank{RANK}.json``; ``tests/scan/test_distributed.py`` compares that with
single-process stats of the whole tensors (built by :func:`whole_tensors`, the
same function on both sides) and with the float64 reference. Assertions live in
the tests, so a failure names the case; this process only has to finish.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.ranks import destroy_group, finish_rank, start_rank

#: Where the flat tensors of the ``group=`` case are cut between rank 0 and rank 1.
CUTS = {
    "fp32_specials": 37,
    "fp64_huge": 20,
    "fp64_tiny_half_zero": 20,
    "bf16": 30,
    "all_on_rank0": 3,
    "matrix": 4,  # rows
    "ints": 2,
}


def whole_tensors() -> dict[str, torch.Tensor]:
    """The whole parameters' gradients, identical on every rank and in the test process."""
    gen = torch.Generator().manual_seed(7)
    specials = torch.randn(101, generator=gen) * 1e20  # fp32 squares overflow past 1.8e19
    specials[[3, 60]] = math.nan
    specials[10] = math.inf
    specials[90] = -math.inf
    specials[[5, 70]] = 0.0
    specials[71] = -0.0
    tiny = torch.zeros(40, dtype=torch.float64)
    tiny[20:] = torch.randn(20, generator=gen, dtype=torch.float64) * 1e-300
    return {
        "fp32_specials": specials,
        "fp64_huge": torch.randn(50, generator=gen, dtype=torch.float64) * 1e200,
        "fp64_tiny_half_zero": tiny,
        "bf16": (torch.randn(33, generator=gen) * 1e30).to(torch.bfloat16),
        "all_on_rank0": torch.randn(3, generator=gen),
        "matrix": torch.randn(6, 5, generator=gen),
        "ints": torch.arange(4),
    }


def dtensor_cases() -> dict[str, torch.Tensor]:
    """Whole tensors for the DTensor cases (placements chosen in :func:`run_dtensor`)."""
    gen = torch.Generator().manual_seed(11)
    uneven = torch.randn(101, generator=gen) * 1e20
    uneven[[0, 100]] = math.nan
    uneven[50] = math.inf
    return {
        "shard0_uneven": uneven,
        "shard1": torch.randn(4, 7, generator=gen, dtype=torch.float64) * 1e200,
        "replicate": torch.randn(9, generator=gen),
        "single_row": torch.randn(1, 3, generator=gen),  # rank 1's shard is empty
        "mesh2d_replicate_shard": torch.randn(6, 2, generator=gen),
        "partial": torch.randn(5, generator=gen),
    }


def _stats(report: Any) -> dict[str, Any]:
    return {
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "numel": t.numel,
                "nan": t.nan,
                "pos_inf": t.pos_inf,
                "neg_inf": t.neg_inf,
                "zeros": t.zeros,
                "max_abs": t.max_abs,
                "norm": t.norm,
            }
            for t in report.tensors
        ],
        "skipped": [[s.name, s.reason] for s in report.skipped],
        "global_norm": report.summary.global_norm,
    }


def run_group(rank: int) -> dict[str, Any]:
    """Plain tensors, each rank holding one disjoint piece, combined with ``group=``."""
    from gradaudit import collect_module

    model = torch.nn.Module()
    for name, whole in whole_tensors().items():
        cut = CUTS[name]
        piece = whole[:cut] if rank == 0 else whole[cut:]
        param = torch.nn.Parameter(torch.zeros_like(piece), requires_grad=whole.is_floating_point())
        param.grad = piece.clone()
        model.register_parameter(name, param)
    return _stats(collect_module(model, group=dist.group.WORLD).materialize())


def run_dtensor(world: int) -> dict[str, Any]:
    """DTensor gradients on a CPU device mesh, including a 2-D mesh with a replicated dim."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from gradaudit import audit, collect_module

    mesh = init_device_mesh("cpu", (world,))
    mesh2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    whole = dtensor_cases()
    grads = {
        "shard0_uneven": distribute_tensor(whole["shard0_uneven"], mesh, [Shard(0)]),
        "shard1": distribute_tensor(whole["shard1"], mesh, [Shard(1)]),
        "replicate": distribute_tensor(whole["replicate"], mesh, [Replicate()]),
        "single_row": distribute_tensor(whole["single_row"], mesh, [Shard(0)]),
        "mesh2d_replicate_shard": distribute_tensor(
            whole["mesh2d_replicate_shard"], mesh2d, [Replicate(), Shard(0)]
        ),
        "partial": DTensor.from_local(whole["partial"] / world, mesh, [Partial()]),
    }
    pairs = [(name, grad) for name, grad in grads.items()]
    report = collect_module(_module_with_grads(pairs)).materialize()
    result = _stats(report)
    result["local_numels"] = {name: g.to_local().numel() for name, g in grads.items()}
    try:
        audit({"shard0_uneven": grads["shard0_uneven"]})
    except TypeError as error:
        result["audit_error"] = str(error)
    return result


def _module_with_grads(pairs: list[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, grad in pairs:
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        module.register_parameter(name, param)
    return module


def run_fsdp(world: int, out: Path) -> dict[str, Any]:
    """A real FSDP2 model: collect_module on its DTensor gradients, then a gathered dump."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradaudit import GradientMonitor, collect_module, save_gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 5)).sum().backward()
    result = _stats(collect_module(model).materialize())
    save_gradients(model, out / "fsdp.safetensors", step=1)

    # A NaN on one rank's shard only: every rank's monitor sees it, rank 0 writes one dump.
    if dist.get_rank() == 1:
        model[0].weight.grad.to_local()[0, 0] = math.nan  # type: ignore[union-attr]
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=out / "dumps")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        record = monitor.step()
    assert record is not None
    result["monitor_nonfinite"] = list(record.nonfinite)
    result["monitor_dump"] = None if record.dump is None else record.dump.name
    return result


def run_scan(out: Path) -> dict[str, Any]:
    """scan_paths_distributed over the files the test wrote into ``out/scan``."""
    from gradaudit import scan_paths_distributed
    from gradaudit.report.formats.json import to_document

    paths = (out / "scan_paths.txt").read_text(encoding="utf-8").splitlines()
    document = to_document(scan_paths_distributed(paths, device="cpu"))
    document.pop("elapsed_s")
    return {"document": document}


def main() -> None:
    rank, world, out = start_rank()
    try:
        results = {
            "group": run_group(rank),
            "dtensor": run_dtensor(world),
            "fsdp": run_fsdp(world, out),
            "scan": run_scan(out),
        }
    finally:
        destroy_group()
    finish_rank(out, rank, results)


if __name__ == "__main__":
    main()
