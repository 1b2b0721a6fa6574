"""Scan speed and memory as ratios measured in one process.

    python -m benchmarks.bench_scan [--gib 1.0] [--dir DIR]

For each workload it reports, in the same process:

* ``sum``: one ``torch.sum`` pass over the same tensors (the yardstick);
* ``audit``: ``gradaudit.audit`` over the tensors in memory;
* ``scan``: ``gradaudit.scan_paths`` over a safetensors dump of them (warm page cache);
* peak extra anonymous memory (``RssAnon``, not the file-backed pages of the
  memory-mapped dump) during audit and scan, next to the largest tensor's size.

Machines are noisy: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

import gradaudit

MIB = 1024 * 1024


def rss_anon() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakAnon:
    """Samples RssAnon in a thread; peak extra memory over the starting level."""

    def __enter__(self) -> PeakAnon:
        gc.collect()
        self.base = rss_anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def best_of(
    repeats: int, fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter
) -> float:
    """The shortest of ``repeats`` runs of ``fn`` by ``clock``: wall time, or
    ``time.process_time`` (CPU time of every thread of the process) on a shared machine,
    where wall time also counts the time other jobs held the cores."""
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def transformer_layout(
    total_bytes: int, itemsize: int, width: int = 1024
) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a transformer's layers whose sizes add up to about ``total_bytes``
    (``width``: the model's; smaller only for a dry run through Triton's interpreter)."""
    per_layer = 12 * width * width + 13 * width
    layers = max(1, total_bytes // (itemsize * per_layer))
    return [
        (f"layers.{i}.{name}", shape)
        for i in range(layers)
        for name, shape in [
            ("attn.qkv.weight", (3 * width, width)),
            ("attn.qkv.bias", (3 * width,)),
            ("attn.out.weight", (width, width)),
            ("attn.out.bias", (width,)),
            ("mlp.fc1.weight", (4 * width, width)),
            ("mlp.fc1.bias", (4 * width,)),
            ("mlp.fc2.weight", (width, 4 * width)),
            ("mlp.fc2.bias", (width,)),
            ("norm1.weight", (width,)),
            ("norm2.weight", (width,)),
        ]
    ]


def transformer_like(total_bytes: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layers of a transformer whose sizes add up to about ``total_bytes``, with planted faults."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in transformer_layout(total_bytes, itemsize):
        tensors[name] = (torch.randn(shape, generator=gen) * 1e-3).to(dtype)
    layers = len(tensors) // 10
    first = tensors["layers.0.attn.qkv.weight"]
    first.view(-1)[123] = math.nan
    first.view(-1)[456] = math.inf
    tensors[f"layers.{layers - 1}.mlp.fc1.weight"].view(-1)[7] = 1e4
    return tensors


def many_tiny(count: int = 5000) -> dict[str, torch.Tensor]:
    """``count`` tensors of 1k-10k float32 elements; beyond 5,000 tensors they shrink in
    proportion, so every tiny workload holds about the same ~110 MB."""
    gen = torch.Generator().manual_seed(1)
    scale = min(1.0, 5000 / count)
    low, high = max(1, int(1000 * scale)), max(2, int(10_000 * scale))
    sizes = torch.randint(low, high, (count,), generator=gen).tolist()
    return {f"p{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def measure(label: str, tensors: dict[str, torch.Tensor], directory: Path) -> dict[str, object]:
    values = list(tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in values)
    largest = max(t.numel() * t.element_size() for t in values)

    def sum_pass() -> None:
        for t in values:
            t.sum()

    sum_pass()
    t_sum = best_of(3, sum_pass)
    gradaudit.audit(tensors)  # warm-up
    with PeakAnon() as audit_mem:
        t_audit = best_of(3, lambda: gradaudit.audit(tensors))

    path = directory / f"{label}.safetensors"
    save_file(tensors, str(path))
    gradaudit.scan_paths([path], device="cpu")  # warm the page cache
    with PeakAnon() as scan_mem:
        t_scan = best_of(3, lambda: gradaudit.scan_paths([path], device="cpu"))
    path.unlink()
    return {
        "workload": label,
        "tensors": len(values),
        "MiB": nbytes / MIB,
        "sum ms": 1e3 * t_sum,
        "audit ×sum": t_audit / t_sum,
        "scan ×sum": t_scan / t_sum,
        "audit peak MiB": audit_mem.extra / MIB,
        "scan peak MiB": scan_mem.extra / MIB,
        "largest MiB": largest / MIB,
    }


def table(rows: Sequence[dict[str, object]], digits: int) -> str:
    """Rows of equal keys as a Markdown table, floats to ``digits`` decimals."""
    columns = list(rows[0])
    lines = [" | ".join(columns), " | ".join("---" for _ in columns)]
    for row in rows:
        cells = [f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the fp32 workload")
    parser.add_argument("--dir", type=Path, default=None, help="where the dumps are written")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tiny", type=int, nargs="+", default=[5000], help="counts of tiny-tensor workloads"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    total = int(args.gib * 1024 * MIB)
    from fixtures.make_fixtures import demo_gradients

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        demo = {k: v for k, v in demo_gradients().items() if v.is_floating_point()}
        rows = [measure("demo", demo, directory)]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            size = total if dtype == torch.float32 else total // 2
            tensors = transformer_like(size, dtype)
            rows.append(
                measure(f"transformer-{str(dtype).removeprefix('torch.')}", tensors, directory)
            )
            del tensors
        for count in args.tiny:
            rows.append(measure(f"{count}-tiny", many_tiny(count), directory))

    print(table(rows, digits=1))
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, engine "
        f"{gradaudit.audit({'x': torch.ones(1)}).engine}"
    )


if __name__ == "__main__":
    main()
