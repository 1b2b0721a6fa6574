"""What a monitor's ``precision=`` costs across ranks: ``group=`` shards on 2 gloo ranks.

    python -m benchmarks.bench_ranks [--tensors 200] [--width 256] [--repeats 30]

Two processes on the CPU (gloo, meeting through a file), each holding half of every
gradient of a model of ``--tensors`` parameters (``[width, width]`` matrices and ``[width]``
vectors, alternately), float32, one thread each. Every repeat times one collecting step
(``sync=True``: collection, the collectives and the read) of three monitors, their order
rotated so that a shared machine's noise hits them alike, after a barrier so both ranks
start together:

* ``group=``, ``precision=None``: the stats rows combined across ranks (two collectives);
* ``group=``, ``precision="fp16"``: the histograms summed too, in the rows' SUM collective;
* ``precision="fp16"`` without ``group=``: each rank's own shards, no collective (what the
  histograms cost to count and judge, without combining them).

Rank 0 prints each one's median and interquartile range in ms, the ratios of the medians,
and the CPU and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.bench_peers import cpu_model
from gradaudit import GradientMonitor

WORLD = 2
#: The ranks run ``python -m benchmarks.bench_ranks`` from the repository's root.
ROOT = Path(__file__).resolve().parent.parent


def _model(tensors: int, width: int, rank: int) -> torch.nn.Module:
    """Half of every gradient: rank 0 the first half of its elements, rank 1 the rest."""
    generator = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    for index in range(tensors):
        shape = (width, width) if index % 2 == 0 else (width,)
        whole = torch.randn(shape, generator=generator).reshape(-1) * 1e-3
        half = whole.numel() // 2
        piece = whole[:half] if rank == 0 else whole[half:]
        param = torch.nn.Parameter(torch.zeros_like(piece))
        param.grad = piece.clone()
        module.register_parameter(f"p{index}", param)
    return module


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def rank_main(rank: int, out: Path, tensors: int, width: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=WORLD
    )
    try:
        module = _model(tensors, width, rank)
        group = dist.group.WORLD
        options = {"every": 1, "sync": True, "dump_dir": None, "on_finding": "ignore"}
        monitors: dict[str, Callable[[], object]] = {
            "group=, precision=None": GradientMonitor(module, group=group, **options).step,
            "group=, precision=fp16": GradientMonitor(
                module, group=group, precision="fp16", **options
            ).step,
            "precision=fp16, no group": GradientMonitor(module, precision="fp16", **options).step,
        }
        names = list(monitors)
        times: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(repeats + 3):  # 3 warm-up rounds
            for offset in range(len(names)):
                name = names[(repeat + offset) % len(names)]
                dist.barrier()
                start = time.perf_counter()
                monitors[name]()
                elapsed = time.perf_counter() - start
                if repeat >= 3:
                    times[name].append(elapsed * 1e3)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    print(f"{tensors} tensors ({width}x{width} and {width}), half of each per rank, float32")
    print("monitor | median ms (IQR) | x group=, precision=None")
    base = _quartiles(times[names[0]])[1]
    for name in names:
        q1, median, q3 = _quartiles(times[name])
        print(f"{name} | {median:.2f} ({q1:.2f}-{q3:.2f}) | {median / base:.2f}")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 (quartiles)")
    if args.rank is not None:
        rank_main(args.rank, Path(args.out), args.tensors, args.width, args.repeats)
        return
    with tempfile.TemporaryDirectory() as out:
        sizes = ["--tensors", str(args.tensors), "--width", str(args.width)]
        command = [sys.executable, "-m", "benchmarks.bench_ranks", *sizes]
        command += ["--repeats", str(args.repeats), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        workers = [
            subprocess.Popen([*command, "--rank", str(rank)], cwd=ROOT, env=env)
            for rank in range(WORLD)
        ]
        codes = [worker.wait() for worker in workers]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
