"""One rank of the 2-process DCP tests: ``python -m tests.dcp_worker RANK WORLD DIR``.

Writes, with real ``torch.distributed.checkpoint.save`` over gloo:

* ``DIR/sharded``: an FSDP2 model and its AdamW state (DTensors sharded over the ranks)
  plus DTensors with planted NaN/Inf/1e20 values, sharded unevenly along both dims;
* ``DIR/gathered.pt`` (rank 0): the same state gathered into plain tensors with
  ``torch.save``, the single-file reference the test scans the directory against.

Assertions live in ``tests/test_dcp.py``; this process only has to finish.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.ranks import destroy_group, finish_rank, start_rank


def planted() -> dict[str, torch.Tensor]:
    """Whole tensors with values that make the merge rule work: specials, huge, tiny, bf16."""
    gen = torch.Generator().manual_seed(5)
    specials = torch.randn(101, generator=gen) * 1e20  # fp32 squares overflow
    specials[[3, 90]] = math.nan
    specials[60] = math.inf
    specials[99] = -math.inf
    specials[[5, 70]] = 0.0
    tiny = torch.zeros(9, 40, dtype=torch.float64)
    tiny[:, 20:] = torch.randn(9, 20, generator=gen, dtype=torch.float64) * 1e-300
    return {
        "specials": specials,
        "huge64": torch.randn(7, 11, generator=gen, dtype=torch.float64) * 1e200,
        "tiny64_cols": tiny,
        "bf16": (torch.randn(33, 3, generator=gen) * 1e30).to(torch.bfloat16),
    }


def scan_split(out: Path) -> dict[str, Any]:
    """``scan_paths_distributed`` over the DCP directory and the gathered file, chunks counted."""
    from gradaudit import scan_paths_distributed
    from gradaudit.io import dcp as dcp_reader
    from gradaudit.report.formats.json import to_document

    loads = [0]
    real = dcp_reader.load_chunk

    def counted(*args: Any) -> torch.Tensor:
        loads[0] += 1
        return real(*args)

    dcp_reader.load_chunk = counted  # type: ignore[assignment]
    try:
        report = scan_paths_distributed([out / "sharded", out / "gathered.pt"], device="cpu")
    finally:
        dcp_reader.load_chunk = real  # type: ignore[assignment]
    document = to_document(report)
    document.pop("elapsed_s")
    return {"document": document, "chunks_read": loads[0]}


def main() -> None:
    rank, world, out = start_rank()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(4, 9)).sum().backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        whole = planted()
        extra = {
            "specials": distribute_tensor(whole["specials"], mesh, [Shard(0)]),
            "huge64": distribute_tensor(whole["huge64"], mesh, [Shard(0)]),
            "tiny64_cols": distribute_tensor(whole["tiny64_cols"], mesh, [Shard(1)]),
            "bf16": distribute_tensor(whole["bf16"], mesh, [Shard(0)]),
        }
        dcp.save(
            {"model": model_sd, "optim": optim_sd, "extra": extra, "step": 3},
            checkpoint_id=str(out / "sharded"),
        )
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full_model, full_optim = get_state_dict(model, optimizer, options=full)
        full_extra = {name: tensor.full_tensor() for name, tensor in extra.items()}
        if rank == 0:
            torch.save(
                {"model": full_model, "optim": full_optim, "extra": full_extra, "step": 3},
                out / "gathered.pt",
            )
        dist.barrier()
        result = scan_split(out)
    finally:
        destroy_group()
    finish_rank(out, rank, result)


if __name__ == "__main__":
    main()
