"""Scanning a ``torch.distributed.checkpoint`` directory, as ratios measured in one process.

    python benchmarks/bench_dcp.py [--gib 0.5] [--ranks 2] [--dir DIR]

``--ranks`` gloo processes each save their ``Shard(0)`` half of a transformer-like fp32
state dict with ``dcp.save`` (DTensors made from local shards, so no rank holds the
whole), giving one chunk per rank per tensor. Then, in this process, with a warm page cache:

* ``sum``: one ``torch.sum`` pass over tensors of the same sizes in memory (the yardstick);
* ``scan``: ``gradaudit.scan_paths`` over the directory (chunks loaded one at a time,
  their rows merged);
* peak extra anonymous memory (``RssAnon``) during the scan, next to the largest chunk and
  the largest ``.distcp`` file.

Machines are noisy: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import gradaudit
from benchmarks.bench_scan import MIB, PeakAnon, best_of, table, transformer_like


def _worker(rank: int, world: int, directory: Path, gib: float) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{directory / 'rendezvous'}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name, whole in transformer_like(int(gib * 1024 * MIB), torch.float32).items():
        rows = whole.shape[0]
        step = -(-rows // world)
        local = whole[rank * step : (rank + 1) * step].clone()
        del whole
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=None, stride=None
        )
    dcp.save({"model": state}, checkpoint_id=str(directory / "ckpt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=0.5, help="size of the fp32 state dict")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes that save it")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.into, args.gib)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "benchmarks.bench_dcp", "--gib", str(args.gib)]
        workers = [
            subprocess.Popen(
                [*command, "--worker", str(rank), str(args.ranks), "--into", str(directory)],
                cwd=root,
                env=env,
            )
            for rank in range(args.ranks)
        ]
        if any(worker.wait() for worker in workers):
            raise SystemExit("a saving rank failed")
        ckpt = directory / "ckpt"
        files = sorted(ckpt.glob("*.distcp"))
        from gradaudit.io.dcp import DcpSource

        tensors = DcpSource(str(ckpt)).tensors
        largest_chunk = max(
            torch.Size(c.sizes).numel() * t.dtype.itemsize for t in tensors for c in t.chunks
        )
        values = list(transformer_like(int(args.gib * 1024 * MIB), torch.float32).values())
        nbytes = sum(t.numel() * t.element_size() for t in values)

        def sum_pass() -> None:
            for t in values:
                t.sum()

        sum_pass()
        t_sum = best_of(3, sum_pass)
        values.clear()  # free them before the scan's memory is measured
        report = gradaudit.scan_paths([ckpt], device="cpu")  # warms the page cache
        with PeakAnon() as memory:
            t_scan = best_of(3, lambda: gradaudit.scan_paths([ckpt], device="cpu"))
        row = {
            "ranks": args.ranks,
            "tensors": report.summary.tensors,
            "MiB": nbytes / MIB,
            "sum ms": 1e3 * t_sum,
            "scan ×sum": t_scan / t_sum,
            "scan peak MiB": memory.extra / MIB,
            "largest chunk MiB": largest_chunk / MIB,
            "largest .distcp MiB": max(f.stat().st_size for f in files) / MIB,
        }
    print(table([row], digits=1))
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, engine {report.engine}")


if __name__ == "__main__":
    main()
