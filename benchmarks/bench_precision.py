"""What ``--precision`` costs: the exponent histogram, × one ``torch.sum`` pass.

    python -m benchmarks.bench_precision [--mib 128] [--repeats 3] [--threads 2]

For float32, bfloat16 and float16 tensors of ``--mib`` MiB (gradient-like values, normal
with scale 1e-3), in one process, each measured ``--repeats`` times with the candidates
alternated (a shared machine's noise then hits all of them alike), best of each:

* one ``torch.sum`` pass, the yardstick;
* the default stats row (``StatsCollector.row``, the engine ``auto`` picks);
* the row and the histogram together, as ``scan --precision`` collects them (the native
  kernel counts the histogram in the same read as the row; without it, the next column);
* :func:`gradaudit.engine.histogram.exponent_histogram` alone: the pass of its own that
  every other engine (eager, Triton, CUDA) still adds.

The last line names the CPU, the native kernel's path and the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch

from benchmarks.bench_scan import table
from gradaudit.engine import native
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.engine.stats import StatsCollector


def _row_and_histogram(values: torch.Tensor) -> torch.Tensor:
    collector = StatsCollector(histograms=True)
    ticket = collector.submit(values)
    collector.flush()
    return collector.histogram(ticket)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    collector = StatsCollector()
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        numel = int(args.mib * 2**20) // torch.empty((), dtype=dtype).element_size()
        values = (torch.randn(numel) * 1e-3).to(dtype)
        candidates: dict[str, Callable[[], object]] = {
            "sum": values.sum,
            "row": lambda v=values: collector.row(v),
            "one read": lambda v=values: _row_and_histogram(v),
            "alone": lambda v=values: exponent_histogram(v),
        }
        best = dict.fromkeys(candidates, float("inf"))
        for _ in range(args.repeats):
            for key, fn in candidates.items():
                start = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - start)
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "MiB": args.mib,
                "sum ms": 1e3 * best["sum"],
                "stats row × sum": best["row"] / best["sum"],
                "row + histogram × sum": best["one read"] / best["sum"],
                "histogram alone × sum": best["alone"] / best["sum"],
            }
        )
    print(table(rows, 1))
    path = native.path() if native.available() else "not built"
    print(
        f"\nstats engine {collector.engine_used}, native path {path}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {cpu_model()}, "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
