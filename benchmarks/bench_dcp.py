"""Scanning a ``torch.distributed.checkpoint`` directory, as ratios measured in one process.

    python -m benchmarks.bench_dcp [--gib 0.5] [--ranks 2] [--dir DIR]

``--ranks`` gloo processes each save their ``Shard(0)`` half of a transformer-like fp32
state dict with ``dcp.save`` (DTensors made from local shards, so no rank holds the
whole), giving one chunk per rank per tensor. Then, in this process, with a warm page cache:

* ``sum``: one ``torch.sum`` pass over tensors of the same sizes in memory (the yardstick);
* ``scan``: ``gradaudit.scan_paths`` over the directory (chunks loaded one at a time,
  their rows merged);
* peak extra anonymous memory (``RssAnon``) during the scan, next to the largest chunk and
  the largest ``.distcp`` file.

With ``--split 1 2`` it then times ``scan_paths_distributed`` over the same directory
under 1 and 2 gloo ranks of one thread each (the chunks divided between them, as under
``torchrun``), best of 3 after a warm-up, as measured by rank 0.

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


def _scan_worker(rank: int, world: int, directory: Path) -> None:
    """One rank of the split scan: time ``scan_paths_distributed``; rank 0 writes the time."""
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    rendezvous = directory / f"rendezvous-scan-{world}"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    ckpt = [directory / "ckpt"]
    gradaudit.scan_paths_distributed(ckpt, device="cpu")  # warm-up
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        gradaudit.scan_paths_distributed(ckpt, device="cpu")
        times.append(time.perf_counter() - start)
    if rank == 0:
        (directory / f"split-{world}.txt").write_text(str(min(times)), encoding="ascii")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _split(
    directory: Path, counts: list[int], root: Path, env: dict[str, str]
) -> list[dict[str, object]]:
    seconds: list[float] = []
    for world in counts:
        command = [sys.executable, "-m", "benchmarks.bench_dcp", "--scan-worker"]
        workers = [
            subprocess.Popen(
                [*command, str(rank), str(world), "--into", str(directory)], cwd=root, env=env
            )
            for rank in range(world)
        ]
        if any(worker.wait() for worker in workers):
            raise SystemExit("a scanning rank failed")
        seconds.append(float((directory / f"split-{world}.txt").read_text(encoding="ascii")))
    return [
        {"scan ranks": world, "scan s": s, "× first": s / seconds[0]}
        for world, s in zip(counts, seconds, strict=True)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=0.5, help="size of the fp32 state dict")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes that save it")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", nargs="*", type=int, default=[], help="rank counts to time")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scan-worker", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.into, args.gib)
    if args.scan_worker:
        _scan_worker(args.scan_worker[0], args.scan_worker[1], args.into)
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
        split = _split(directory, args.split, root, env) if args.split else []
    print(table([row], digits=1))
    if split:
        print()
        print(table(split, digits=2))
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, engine {report.engine}")


if __name__ == "__main__":
    main()
