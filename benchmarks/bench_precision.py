"""What ``--precision`` costs: the exponent histogram's extra pass, × one ``torch.sum`` pass.

    python -m benchmarks.bench_precision [--mib 128] [--repeats 3] [--threads 2]

For float32, bfloat16 and float16 tensors of ``--mib`` MiB (gradient-like
values, normal with scale 1e-3), in one process: the best of ``--repeats``
runs of one ``torch.sum`` pass (the yardstick), of the default stats row
(``StatsCollector.row``, the engine ``auto`` picks) and of
:func:`gradaudit.engine.histogram.exponent_histogram`. The histogram is opt-in
and not part of the single pass; folding it into the kernels is left for later.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_scan import best_of, table
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.engine.stats import StatsCollector


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
        t_sum = best_of(args.repeats, values.sum)
        t_row = best_of(args.repeats, lambda v=values: collector.row(v))
        t_hist = best_of(args.repeats, lambda v=values: exponent_histogram(v))
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "MiB": args.mib,
                "sum ms": 1e3 * t_sum,
                "stats row × sum": t_row / t_sum,
                "histogram × sum": t_hist / t_sum,
            }
        )
    print(table(rows, 1))
    print(
        f"\nstats engine {collector.engine_used}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


if __name__ == "__main__":
    main()
