"""What ``--precision`` costs: the exponent histogram, × one ``torch.sum`` pass.

    python -m benchmarks.bench_precision [--mib 128] [--repeats 3] [--threads 2] [--clock cpu]
                                         [--baseline path/to/_native.so] [--calls 1]

For float32, bfloat16 and float16 tensors of ``--mib`` MiB (gradient-like values, normal
with scale 1e-3), in one process, each measured ``--repeats`` times with the candidates
alternated and each repeat starting one candidate further along (a shared machine's noise
then hits all of them alike, and none always follows the same one), best of each:

* one ``torch.sum`` pass, the yardstick;
* the default stats row (``StatsCollector.row``, the engine ``auto`` picks);
* the row and the histogram together, as ``scan --precision`` collects them (the native
  kernel counts the histogram in the same read as the row; without it, the next column);
* :func:`gradaudit.engine.histogram.exponent_histogram` alone: the pass of its own that
  every other engine (eager, Triton, CUDA) still adds;
* with ``--baseline``, the row and the histogram by another build of the native kernel (a
  copy of main's ``_native*.so``, say), loaded beside this one, and by this build through
  the same raw call: before and after in one run, compared like with like (the collector
  column above also makes a collector per call, about 0.1x a sum pass of 64 MiB more).

``--clock cpu`` times by the process's CPU time, all threads together: on a shared machine
wall time also counts the time other processes held the cores.

``--calls N`` times N calls of each candidate back to back (figures per call). With a tensor
that fits the core's cache (``--mib 0.25 --calls 400``) memory drops out: the ratios are then
what the arithmetic costs, the part of a read from memory that prefetching cannot hide. The
row and the row and histogram are then the native kernel's own calls, as ``--baseline``'s
(the collector's few microseconds a call would be most of a cache-sized tensor's time).

The last line names the CPU, the native kernel's path and the load average.
"""

from __future__ import annotations

import argparse
import array
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from types import ModuleType

import torch

from benchmarks.bench_scan import table
from gradaudit.engine import native, native_rows
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.engine.stats import StatsCollector
from gradaudit.precision.formats import layout


def _row_and_histogram(values: torch.Tensor) -> torch.Tensor:
    collector = StatsCollector(histograms=True)
    ticket = collector.submit(values)
    collector.flush()
    return collector.histogram(ticket)


def native_build(path: str) -> ModuleType:
    """Another build of the native kernel, loaded beside this process's own: a second
    ``.so`` file is a second module with its own layout and path (the widest its CPU runs)."""
    name = "gradaudit.engine._native"
    before = sys.modules.get(name)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a native kernel build")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if before is not None:
        sys.modules[name] = before
    module.set_layout(array.array("I", layout().boundaries).tobytes())
    return module


def _build_call(
    module: ModuleType, values: torch.Tensor, threads: int, histogram: bool = True
) -> Callable[[], object]:
    """The row and the histogram (or the row alone) of ``values`` by ``module``'s stats_batch,
    buffers made once."""
    pointers = array.array("Q", [values.data_ptr()])
    counts = array.array("Q", [values.numel()])
    codes = array.array("i", [native.code(values.dtype)])
    row = torch.zeros(7, dtype=torch.float64)
    hist = torch.zeros(layout().bins, dtype=torch.int64)
    hist_ptr = hist.data_ptr() if histogram else 0
    # Default arguments keep the buffers alive as long as the call.
    return lambda row=row, hist=hist: module.stats_batch(
        pointers, counts, codes, row.data_ptr(), threads, hist_ptr
    )


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
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--baseline", help="another build's _native*.so, timed beside this one")
    parser.add_argument("--calls", type=int, default=1, help="calls per timing (cache-sized runs)")
    args = parser.parse_args(argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    baseline = native_build(args.baseline) if args.baseline else None
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
        own = native_rows.module()
        if args.calls > 1 and own is not None and native_rows.histogram_bins() > 0:
            candidates["row"] = _build_call(own, values, args.threads, histogram=False)
            candidates["one read"] = _build_call(own, values, args.threads)
        if baseline is not None:
            # Both builds by the same raw call: "one read" goes through a fresh collector
            # each time, ~0.1x a sum pass of a 64 MiB tensor more than the call alone.
            if own is not None:
                candidates["this build"] = _build_call(own, values, args.threads)
            candidates["baseline"] = _build_call(baseline, values, args.threads)
        best = dict.fromkeys(candidates, float("inf"))
        keys = list(candidates)
        for repeat in range(args.repeats):
            # Each repeat starts one further along: in a fixed order, whichever of two equal
            # builds ran second measured 0.04-0.09x a sum pass faster (docs/performance.md).
            turn = repeat % len(keys)
            for key in keys[turn:] + keys[:turn]:
                fn = candidates[key]
                start = clock()
                for _ in range(args.calls):
                    fn()
                best[key] = min(best[key], (clock() - start) / args.calls)
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "MiB": args.mib,
            # A cache-sized tensor's pass takes microseconds.
            **({"sum µs": 1e6 * best["sum"]} if args.calls > 1 else {"sum ms": 1e3 * best["sum"]}),
            "stats row × sum": best["row"] / best["sum"],
            "row + histogram × sum": best["one read"] / best["sum"],
            "histogram alone × sum": best["alone"] / best["sum"],
        }
        if baseline is not None:
            if "this build" in best:
                row["this build's call × sum"] = best["this build"] / best["sum"]
            row["baseline build's call × sum"] = best["baseline"] / best["sum"]
        rows.append(row)
    print(table(rows, 2))
    path = native.path() if native.available() else "not built"
    print(
        f"\nstats engine {collector.engine_used}, native path {path}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.clock} time, {cpu_model()}, "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


if __name__ == "__main__":
    main()
