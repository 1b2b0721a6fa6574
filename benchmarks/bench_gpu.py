"""GPU throughput of the engines against the device's own copy bandwidth, and H2D streaming.

    python -m benchmarks.bench_gpu [--gib 2] [--device cuda] [--dir DIR] [--host-cost-only]

Everything is measured in one process, best of ``--repeats``:

* ``copy``: one device-to-device copy of a buffer of the same bytes; its
  bandwidth counts the bytes read and the bytes written (as CUDA's
  ``bandwidthTest`` does), so a single-pass reduction at full memory speed
  scores about 100 % against it;
* each engine (``triton``, ``eager``, ``compiled``) collecting and
  materialising the stats of the tensors already on the device: GB/s of
  gradient bytes read, and that as a percentage of the copy bandwidth
  (issue 6's target: at least 70 %). Engines are timed warm; the first call
  of each is reported apart (``first call s``): with empty Triton and
  Inductor caches (fresh directories, unless ``--warm-cache``) it is what a
  fresh CI container pays to compile, the figure that decides whether
  ``auto`` should compile for a small scan;
* H2D streaming of a safetensors dump (warm page cache): ``scan_paths`` onto the
  device, against a pinned host-to-device copy of the same bytes (the link's
  limit) and against the plain way (``tensor.to(device)`` per tensor, then the
  same stats).

With ``--device cpu`` the same table is made for the CPU engines (a smoke
run; ``benchmarks/bench_scan.py`` is the CPU benchmark).

Host cost per flush (``host_cost_rows``, printed on every device): the host
time of collecting the workload with the Triton engine (``queue``: the
per-tensor work, ``launch``: the flush's table, launches and merge), against
the time an H100's HBM (3.35 TB/s) takes to read the same bytes; the
issue-20 target is ``launch × HBM`` ≤ 0.3. On a GPU the real kernels are
launched and the host time is taken before the device finishes. On the CPU
the same host code runs on CPU tensors (``torch.empty``: never touched, so
they cost no memory) routed to the Triton path as ``TRITON_INTERPRET=1``
routes them, with the two Triton kernels replaced by launchers that do
nothing: what is left is exactly the Python and torch work of the path,
minus what only CUDA does (the launch itself inside Triton's launcher, the
pinned table copy and one ``record_stream`` per tensor), which the table
leaves out and ``docs/gpu.md`` estimates.

Both paths to the flush are measured, alternately: ``per-tensor`` (one
``PendingStats.queue`` per tensor: a scan, ``audit``) and ``planned`` (a training
loop's columns through ``PendingStats.add_tensors`` with the same collector every
step, as ``GradientMonitor`` does: the flush planned once, :mod:`gradaudit.engine.
triton_plan`); for it ``queue`` is everything before its launch, and ``planning
step`` the step that makes the plan (the collector's first list where torch's C shim is
bound, else its second). The planned path
runs twice: each step's facts read through torch's C shim (``planned``, where
:mod:`gradaudit.engine.torch_shim` binds it) and through torch's binding (``planned,
binding``, what runs where it does not).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import gradaudit
from benchmarks.bench_scan import best_of as cpu_best_of
from benchmarks.bench_scan import many_tiny, table, transformer_layout, transformer_like
from gradaudit.engine import native, torch_shim, triton_kernel
from gradaudit.engine.stats import StatsCollector
from gradaudit.engine.triton_plan import TritonPlan
from gradaudit.scan.pending import PendingStats

GB = 1e9
MIB = 1024 * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(repeats: int, device: torch.device, fn: Callable[[], object]) -> float:
    """bench_scan's best-of, with the device's queue drained before and inside each timing."""
    synchronize(device)
    return cpu_best_of(repeats, lambda: (fn(), synchronize(device)))


def once(device: torch.device, fn: Callable[[], object]) -> float:
    return best_of(1, device, fn)


def copy_time(nbytes: int, source: torch.device, target: torch.device, repeats: int) -> float:
    """Best time to copy ``nbytes`` between two buffers (pinned when the source is the host)."""
    pinned = source.type == "cpu" and target.type == "cuda"
    origin = torch.empty(nbytes, dtype=torch.uint8, device=source, pin_memory=pinned)
    landing = torch.empty(nbytes, dtype=torch.uint8, device=target)
    return best_of(repeats, target, lambda: landing.copy_(origin, non_blocking=pinned))


def engines_for(device: torch.device) -> list[str]:
    if device.type == "cuda":
        names = ["triton"] if triton_kernel.installed() else []
        return [*names, "eager", "compiled"]
    return (["native"] if native.available() else []) + ["eager"]


def engine_rows(
    label: str, tensors: dict[str, torch.Tensor], device: torch.device, repeats: int
) -> list[dict[str, object]]:
    on_device = {name: t.to(device) for name, t in tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in on_device.values())
    copy_bandwidth = 2 * nbytes / copy_time(nbytes, device, device, repeats)
    rows: list[dict[str, object]] = []
    for engine in engines_for(device):
        t_first = once(device, lambda e=engine: gradaudit.audit(on_device, engine=e))
        t_engine = best_of(repeats, device, lambda e=engine: gradaudit.audit(on_device, engine=e))
        ran = gradaudit.audit(on_device, engine=engine).engine
        rows.append(
            {
                "workload": label,
                "tensors": len(on_device),
                "MiB": nbytes / MIB,
                "engine": ran,
                "copy GB/s": copy_bandwidth / GB,
                "stats GB/s": nbytes / t_engine / GB,
                "% of copy": 100 * (nbytes / t_engine) / copy_bandwidth,
                "first call s": t_first,
            }
        )
    return rows


#: H100 SXM HBM3 bandwidth, bytes per second: the yardstick of the host cost.
H100_HBM = 3.35e12


#: The ways a list of tensors reaches the Triton flush: one ``PendingStats.queue`` per
#: tensor (a scan, ``audit``), and a training loop's columns (``add_tensors``, planned once),
#: whose facts are read through torch's C shim where it is bound (``planned``) or through
#: torch's binding (``planned, binding``: what runs where the shim is not bound).
PATHS = ("per-tensor", "planned", "planned, binding")


@contextlib.contextmanager
def binding_reader(on: bool) -> Iterator[None]:
    """While ``on``, plans are made and checked as where torch's C shim is not bound (through
    torch's binding)."""
    saved = torch_shim.bound
    if on:
        torch_shim.bound = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch_shim.bound = saved  # type: ignore[method-assign]


class _NoopKernel:
    """A Triton kernel whose launches do nothing: the host side of the path, alone."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def noop_kernels() -> None:
    """Route CPU tensors to the Triton flush (as ``TRITON_INTERPRET=1`` does) with both
    kernels replaced by launchers that do nothing: the host side alone, on a CPU. For a
    process that measures only that (the caller restores what it needs)."""
    os.environ["TRITON_INTERPRET"] = "1"
    triton_kernel._kernels = lambda: (_NoopKernel(), _NoopKernel())  # type: ignore[assignment]


def host_cost_rows(
    device: torch.device, gib: float, tiny: int, repeats: int
) -> list[dict[str, object]]:
    """Host time per flush of the Triton path, both ways a list of tensors reaches it
    (see the module doc for the CPU method), measured alternately in one run."""
    real = device.type == "cuda"
    workloads = [
        (
            f"transformer-{name}",
            [torch.empty(shape, dtype=dtype, device=device) for _, shape in layout],
        )
        for name, dtype, layout in [
            ("float32", torch.float32, transformer_layout(int(gib * 1024 * MIB), 4)),
            ("bfloat16", torch.bfloat16, transformer_layout(int(gib * 512 * MIB), 2)),
        ]
    ]
    sizes = torch.randint(1000, 10_000, (tiny,), generator=torch.Generator().manual_seed(1))
    workloads.append((f"{tiny}-tiny", [torch.empty(int(n), device=device) for n in sizes]))
    saved = (os.environ.get("TRITON_INTERPRET"), triton_kernel._kernels, TritonPlan.launch)
    if not real:
        noop_kernels()
    # When the planned path's launch starts: what comes before it is its queue.
    marks: list[float] = []

    def marked(plan: TritonPlan, *args: Any) -> torch.Tensor:
        marks.append(time.perf_counter())
        return saved[2](plan, *args)

    TritonPlan.launch = marked  # type: ignore[method-assign]
    rows: list[dict[str, object]] = []
    try:
        for label, tensors in workloads:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            names = [str(i) for i in range(len(tensors))]
            # The plan is kept between steps, one collector per planned path.
            collectors = {path: StatsCollector(engine="triton") for path in PATHS}
            best = {path: (math.inf, math.inf) for path in PATHS}
            first = {path: math.nan for path in PATHS}
            # The first step compiles on a GPU (on the per-tensor path, which runs first). A
            # collector plans its first list where torch's C shim is bound (planning is then
            # cheaper than the per-tensor flush), else its second (the first goes the
            # per-tensor way): that step is the planning step, the later ones are timed.
            planning = {
                path: 0 if path == "planned" and torch_shim.bound() else 1 for path in PATHS
            }
            for repeat in range(repeats + 2):
                for path in PATHS:
                    synchronize(device)
                    marks.clear()
                    start = time.perf_counter()
                    if path == "per-tensor":
                        pending = PendingStats(engine="triton")
                        for name, tensor in zip(names, tensors, strict=True):
                            pending.queue(name, tensor)
                        queued = time.perf_counter()
                        pending.settle()
                    else:
                        pending = PendingStats(collector=collectors[path].fresh())
                        with binding_reader(path == "planned, binding"):
                            pending.add_tensors(names, tensors)
                        if repeat < planning[path]:
                            continue
                        assert len(marks) == 1, "the planned path did not take the list"
                        queued = marks[0]
                    done = time.perf_counter()
                    if repeat == planning[path] and path != "per-tensor":
                        first[path] = done - start
                    elif repeat:
                        queue, launch = best[path]
                        best[path] = (min(queue, queued - start), min(launch, done - queued))
            hbm = nbytes / H100_HBM
            for path in PATHS:
                queue, launch = best[path]
                rows.append(
                    {
                        "workload": label,
                        "tensors": len(tensors),
                        "MiB": nbytes / MIB,
                        "kernels": "real" if real else "no-op",
                        "path": path,
                        "queue ms": queue * 1e3,
                        "launch ms": launch * 1e3,
                        "H100 HBM read ms": hbm * 1e3,
                        "launch × HBM": launch / hbm,
                        "queue+launch × HBM": (queue + launch) / hbm,
                        "planning step ms": first[path] * 1e3,
                    }
                )
    finally:
        if saved[0] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[0]
        triton_kernel._kernels = saved[1]  # type: ignore[assignment]
        TritonPlan.launch = saved[2]  # type: ignore[method-assign]
    return rows


def streaming_row(
    tensors: dict[str, torch.Tensor], device: torch.device, directory: Path, repeats: int
) -> dict[str, object]:
    path = directory / "stream.safetensors"
    save_file(tensors, str(path))
    nbytes = path.stat().st_size
    t_h2d = copy_time(nbytes, torch.device("cpu"), device, repeats)

    def plain() -> None:
        from safetensors import safe_open

        pending = gradaudit.PendingStats()
        with safe_open(str(path), framework="pt") as dump:
            for name in dump.keys():  # noqa: SIM118 (safe_open has no __iter__)
                pending.add(name, dump.get_tensor(name).to(device))
        pending.materialize()

    gradaudit.scan_paths([path], device=device)  # warm the page cache and the kernels
    t_scan = best_of(repeats, device, lambda: gradaudit.scan_paths([path], device=device))
    t_plain = best_of(repeats, device, plain)
    return {
        "file MiB": nbytes / MIB,
        "pinned H2D GB/s": nbytes / t_h2d / GB,
        "scan GB/s": nbytes / t_scan / GB,
        "scan × pinned H2D": t_scan / t_h2d,
        "plain .to() GB/s": nbytes / t_plain / GB,
        "plain × scan": t_plain / t_scan,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the fp32 workload")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", type=Path, default=None, help="where the dump is written")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", type=int, default=5000, help="tensors in the tiny workload")
    parser.add_argument(
        "--warm-cache", action="store_true", help="keep Triton's and Inductor's on-disk caches"
    )
    parser.add_argument(
        "--host-cost-only", action="store_true", help="only the host cost per flush (any machine)"
    )
    args = parser.parse_args(argv)
    if not args.warm_cache:
        for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
            os.environ[variable] = tempfile.mkdtemp(prefix="bench-gpu-cache-")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here (use --device cpu for a smoke run)")
    if args.host_cost_only:
        print(table(host_cost_rows(device, args.gib, args.tiny, args.repeats), digits=3))
        return
    total = int(args.gib * 1024 * MIB)
    rows: list[dict[str, object]] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        size = total if dtype == torch.float32 else total // 2
        label = f"transformer-{str(dtype).removeprefix('torch.')}"
        rows += engine_rows(label, transformer_like(size, dtype), device, args.repeats)
    rows += engine_rows(f"{args.tiny}-tiny", many_tiny(args.tiny), device, args.repeats)
    print(table(rows, digits=2))
    if triton_kernel.installed():
        print()
        print(table(host_cost_rows(device, args.gib, args.tiny, args.repeats), digits=3))
    if device.type == "cuda":
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            tensors = transformer_like(total, torch.float32)
            print()
            print(table([streaming_row(tensors, device, Path(tmp), args.repeats)], digits=2))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}, triton installed: {triton_kernel.installed()}")


if __name__ == "__main__":
    main()
