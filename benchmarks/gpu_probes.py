"""What only a GPU shows about the Triton path: correctness probes and kernel-only bandwidth.

    python -m benchmarks.gpu_probes {env,warm-up,correctness,bandwidth,launch-shapes,
                                     histogram,host-cost,host-profile,graph,kernels} [--dry-run]

``benchmarks/gpu_check.py`` runs each subcommand under its own timeout. Each prints its
details, then one ``figure: ...`` line that the check's summary quotes; it exits 1 when a
result is wrong, 2 without CUDA.

* ``correctness``: the engine (``audit(..., engine="triton")``) against a float64
  reference computed on the device, chunk by chunk (``reference_rows``), on what the
  CPU suite cannot reach: views at every element offset 0..15 of three dtypes, addressed
  from the highest-addressed tensor (negative offsets); the longest span with this
  device's real SM count; a bf16 tensor of more than 2**31 elements; the float32-sums
  variant on a data-centre GPU. ``--small``: small sizes only (under compute-sanitizer).
* ``bandwidth``: the stats kernels of one flush alone, timed with CUDA events while
  the host is kept ahead (the stream sleeps while the launches are queued) and L2 is
  flushed before each repeat, against a device-to-device copy (bytes read + written)
  and ``torch.sum`` of a flat buffer of the same bytes and dtype, and the card's spec
  HBM, for float32/bfloat16/float16 on four layouts.
* ``launch-shapes``: the same GB/s with other launch settings (a pipelined loop, more
  programs per SM) beside the shipped ones, on the layouts short of their targets, each
  checked against the float64 reference.
* ``histogram``: the exponent histogram's Triton launch and the torch ops it replaces,
  × ``torch.sum`` of the same 256 MiB tensor, per dtype, and whether their counts agree.
* ``host-cost``: ``bench_gpu.host_cost_rows`` with real launches, in µs per tensor.
* ``graph``: a planned flush launched and replayed from the product's captured CUDA graph
  (``gradaudit.engine.triton_graph``): host ms per step and whether the rows are the same.
* ``kernels``: the launches the check's ``kernel-profile`` step runs under Nsight Compute.

``--dry-run``: on the CPU at tiny sizes, Triton through its interpreter (set here), one
SM assumed (so the longest span is 128 steps of a few hundred thousand elements):
every line of logic runs, and the timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import gradaudit
from benchmarks.bench_gpu import host_cost_rows, noop_kernels
from benchmarks.bench_scan import table, transformer_layout
from benchmarks.gpu_check import spec_hbm
from gradaudit.engine import triton_kernel
from gradaudit.scan.pending import PendingStats

MIB = 1 << 20
#: Triton's 128-bit loads: a group's base must be 16-byte aligned.
VECTOR_BYTES = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Shape = tuple[int, ...]
#: One tensor's float64 reference: NaN, +Inf, -Inf and zero counts, finite max|x|, norm.
Expected = tuple[int, int, int, int, float, float]


@dataclass(frozen=True)
class Probe:
    """What the probes run on: the device, and whether this is a dry run (tiny sizes)."""

    device: torch.device
    dry: bool
    small: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sms(self) -> int:
        if self.cuda:
            return int(torch.cuda.get_device_properties(self.device).multi_processor_count)
        return int(triton_kernel.DEFAULT_SMS)

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu (dry run)"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def setup(dry: bool, small: bool) -> Probe | None:
    """The probe's device; ``None`` without CUDA on a real run."""
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
        triton_kernel.DEFAULT_SMS = 1  # the longest span in a few hundred thousand elements
        return Probe(torch.device("cpu"), dry=True, small=small)
    if not torch.cuda.is_available():
        return None
    return Probe(torch.device("cuda", torch.cuda.current_device()), dry=False, small=small)


def nvidia_smi(query: str) -> str:
    """One ``nvidia-smi --query-gpu`` answer for the first GPU, or ``""``."""
    if shutil.which("nvidia-smi") is None:
        return ""
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.stdout.splitlines()[0].strip() if done.stdout else ""


# -- env, warm-up -----------------------------------------------------------------


def env(probe: Probe) -> int:
    try:
        import triton  # an optional dependency: its version only

        triton_version = str(triton.__version__)
    except ImportError as error:
        triton_version = f"not importable ({error})"
    print(f"python {platform.python_version()} {sys.executable}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}")
    print(f"gradaudit from {os.path.dirname(gradaudit.__file__)}")
    figure = f"{probe.name()}, torch {torch.__version__}, triton {triton_version}"
    if probe.cuda:
        props = torch.cuda.get_device_properties(probe.device)
        cc = torch.cuda.get_device_capability(probe.device)
        driver = nvidia_smi("driver_version")
        spec = spec_hbm(props.name)
        l2 = getattr(props, "L2_cache_size", 0) / MIB
        print(
            f"device {props.name} cc {cc[0]}.{cc[1]}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.1f} GiB, L2 {l2:.0f} MiB, "
            f"{torch.cuda.device_count()} device(s), spec HBM {spec or 'unknown'} B/s"
        )
        print(f"driver {driver}; clocks: {nvidia_smi('clocks.sm,clocks.max.sm,clocks.mem')}")
        figure = (
            f"{props.name} cc{cc[0]}.{cc[1]} {props.multi_processor_count} SMs "
            f"{props.total_memory / 2**30:.0f} GiB, driver {driver}, torch {torch.__version__}"
            f" (CUDA {torch.version.cuda}), triton {triton_version}"
        )
    print(f"figure: {figure}")
    return 0


def warm_up(probe: Probe) -> int:
    """Compile the kernels once per dtype (the first launch of each), timed."""
    times = []
    for dtype in DTYPES:
        tensor = torch.randn(5000, device=probe.device).to(dtype)
        start = time.perf_counter()
        gradaudit.audit({"w": tensor}, engine="triton")
        probe.synchronize()
        times.append(f"{str(dtype).removeprefix('torch.')} {time.perf_counter() - start:.1f}s")
    warm = triton_kernel.compile_worth(probe.device)
    print(f"figure: first launches {', '.join(times)}; auto warm now: {warm}")
    return 0


# -- correctness ------------------------------------------------------------------


def reference_rows(tensors: Sequence[torch.Tensor], chunk: int = 1 << 27) -> list[Expected]:
    """Float64 stats of each tensor, on its device, ``chunk`` elements at a time, read once.

    Squares of float32/16/bf16 values cannot overflow float64; the chunks keep a
    tensor of 2**31 elements from needing a 17 GB float64 copy.
    """
    rows = []
    for tensor in tensors:
        flat = tensor.reshape(-1)
        acc = torch.zeros(6, dtype=torch.float64, device=tensor.device)
        for start in range(0, flat.numel(), chunk):
            x = flat[start : start + chunk].to(torch.float64)
            finite = torch.where(torch.isfinite(x), x, 0.0)
            counts = [x.isnan().sum(), (x == math.inf).sum(), (x == -math.inf).sum()]
            acc[:4] += torch.stack([*counts, (x == 0).sum()]).to(torch.float64)
            acc[4] = torch.maximum(acc[4], finite.abs().max())
            acc[5] += (finite * finite).sum()
        rows.append(acc)
    host = torch.stack(rows).cpu().tolist() if rows else []  # the one read
    return [(int(a), int(b), int(c), int(d), e, math.sqrt(f)) for a, b, c, d, e, f in host]


def planted(n: int, dtype: torch.dtype, scale: float, probe: Probe, seed: int) -> torch.Tensor:
    """Random values with NaN, ±Inf and zeros planted at fixed strides (never all zeros)."""
    gen = torch.Generator(device=probe.device).manual_seed(seed)
    x = (torch.randn(n, generator=gen, device=probe.device) * scale).to(dtype)
    x[::101] = math.nan
    x[5::997] = math.inf
    x[7::1999] = -math.inf
    x[11::13] = 0
    return x


def highest_first(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Descending addresses, each dtype's highest 16-byte-aligned tensor first: it becomes
    its group's base, and the others sit at negative element offsets from it."""
    items = sorted(tensors.items(), key=lambda item: -item[1].data_ptr())
    bases: dict[torch.dtype, str] = {}
    for name, tensor in items:
        if tensor.data_ptr() % VECTOR_BYTES == 0:
            bases.setdefault(tensor.dtype, name)
    first = set(bases.values())
    return {name: tensors[name] for name in bases.values()} | {
        name: tensor for name, tensor in items if name not in first
    }


def check(label: str, tensors: dict[str, torch.Tensor], rel: float = 1e-9) -> list[str]:
    """Audit with Triton asked for by name; what differs from the float64 reference."""
    report = gradaudit.audit(tensors, engine="triton")
    got = {stats.name: stats for stats in report.tensors}
    wrong = []
    for (name, tensor), want in zip(
        tensors.items(), reference_rows(list(tensors.values())), strict=True
    ):
        stats = got.get(name)
        have = None
        if stats is not None:
            have = (stats.nan, stats.pos_inf, stats.neg_inf, stats.zeros, stats.max_abs, stats.norm)
        if have is None or have[:5] != want[:5] or not math.isclose(have[5], want[5], rel_tol=rel):
            wrong.append(f"  MISMATCH {label} {name} numel={tensor.numel()} got {have} want {want}")
    if report.engine != "triton":
        wrong.append(f"  {label}: engine {report.engine}, not Triton alone")
    print(f"{'ok  ' if not wrong else 'FAIL'} {label}: {len(tensors)} tensors, {len(wrong)} wrong")
    print("\n".join(wrong[:20]))
    return wrong


def probe_offsets(probe: Probe) -> tuple[str, dict[str, torch.Tensor]]:
    """Views at every element offset 0..15 of three dtypes, with edges of every length."""
    length = 2_000 if probe.small or probe.dry else 70_000
    views = {}
    for dtype in DTYPES:
        short = str(dtype).removeprefix("torch.")
        for k in range(16):
            parent = planted(length + 37 * k, dtype, 10.0 ** (k % 9 - 4), probe, seed=k)
            views[f"{short}.{k}.tail"] = parent[k:]
            views[f"{short}.{k}.steps"] = parent[k : k + 3 * 1024 + 7]
            views[f"{short}.{k}.short"] = parent[k : k + 5]
    return "views at offsets 0..15, 3 dtypes, negative offsets", highest_first(views)


def probe_longest_span(probe: Probe) -> tuple[str, dict[str, torch.Tensor]]:
    """Byte counters at the longest span (every lane sees its most elements of one class),
    sized from this device's real SM count."""
    sms = probe.sms()
    n = (triton_kernel.MAX_STEPS - 1) * 4 * sms * triton_kernel.BLOCK + 3
    steps = triton_kernel.span_for(n, sms) // triton_kernel.BLOCK
    device = probe.device
    nan = torch.full((n + 1,), math.nan, dtype=torch.bfloat16, device=device)
    inf = torch.full((n + 3,), math.inf, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    tensors = {
        "bf16.anchor": torch.ones(8, dtype=torch.bfloat16, device=device),
        "fp32.anchor": torch.ones(8, dtype=torch.float32, device=device),
        "bf16.nan": nan[1:],  # a misaligned start: both edges masked
        "fp32.inf": inf[3:],
        "fp32.random": torch.randn(n, generator=gen, device=device),
        "fp16.zeros": torch.zeros(n, dtype=torch.float16, device=device),
    }
    return f"longest span: n={n}, {steps} steps per program, {sms} SMs", tensors


def probe_beyond_2_31(probe: Probe) -> tuple[str, dict[str, torch.Tensor]] | None:
    """More than 2**31 bf16 elements, faults planted past 2**31; ``None`` without memory."""
    m = 5_001 if probe.dry else 2**31 + 1001
    if probe.cuda and torch.cuda.mem_get_info(probe.device)[0] < 6 * m * 2 + (4 << 30):
        print("skip >2**31: not enough free device memory")
        return None
    gen = torch.Generator(device=probe.device).manual_seed(2)
    big = torch.randn(m, generator=gen, dtype=torch.bfloat16, device=probe.device)
    past = m - 996  # 2**31 + 5 on a GPU
    big[0] = big[past] = math.nan
    big[past + 2] = math.inf
    big[m - 2] = -math.inf
    big[m - 1] = 0
    return f"{m} bf16 elements (faults past index {past})", {"big": big}


def probe_fp32_sums(probe: Probe) -> tuple[str, dict[str, torch.Tensor]]:
    """The float32-sums variant's tensors: bf16 and fp32 over their exponent ranges, fp16
    subnormals."""
    n = 3_001 if probe.small or probe.dry else 300_001
    tensors = {
        f"{str(dtype).removeprefix('torch.')}.1e{exponent}": planted(
            n, dtype, 10.0**exponent, probe, seed=exponent + 40
        )
        for dtype, exponents in (
            (torch.bfloat16, (-30, 0, 30)),
            (torch.float16, (-6, 0)),
            (torch.float32, (-40, 0, 30)),
        )
        for exponent in exponents
    }
    # And the same without NaN or ±Inf: a program that meets one takes the exact path, so
    # only healthy tensors check the fast path.
    for name, tensor in list(tensors.items()):
        tensors[f"{name}.healthy"] = tensor.nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0)
    return "float32-sums variant, bf16 1e-30..1e30, fp16 subnormals, fp32 1e-40..1e30", tensors


def correctness(probe: Probe) -> int:
    failed: list[str] = []
    passed: list[str] = []
    probes: list[Callable[[Probe], tuple[str, dict[str, torch.Tensor]] | None]] = [
        probe_offsets,
        probe_fp32_sums,
    ]
    if not probe.small:
        probes[1:1] = [probe_longest_span, probe_beyond_2_31]
    for make in probes:
        fp32_sums = make is probe_fp32_sums
        saved = triton_kernel.FP32_ACCUMULATE
        try:
            made = make(probe)
            if made is None:
                passed.append(f"{make.__name__} skipped")
                continue
            label, tensors = made
            triton_kernel.FP32_ACCUMULATE = True if fp32_sums else saved
            wrong = check(label, tensors)
        except Exception as error:  # noqa: BLE001 (one broken probe must not hide the others)
            print(f"FAIL {make.__name__}: {error!r}")
            wrong = [repr(error)]
        finally:
            triton_kernel.FP32_ACCUMULATE = saved
        (failed if wrong else passed).append(make.__name__.removeprefix("probe_"))
        if probe.cuda:
            torch.cuda.empty_cache()
    verdict = f"FAILED {', '.join(failed)}" if failed else "0 wrong"
    print(f"figure: {len(passed) + len(failed)} probes ({', '.join(passed)}): {verdict}")
    return 1 if failed else 0


# -- bandwidth ----------------------------------------------------------------------


def llama_layout(layers: int, hidden: int = 4096, ffn: int = 11008) -> list[Shape]:
    """The weights of ``layers`` blocks of a 7B Llama-like model, in model order."""
    square: Shape = (hidden, hidden)
    block: list[Shape] = [square] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn)]
    return [*block, (hidden,), (hidden,)] * layers


def tiny_shapes(count: int, low: int, high: int) -> list[Shape]:
    """bench_gpu's tiny workload: ``count`` tensors of ``low``..``high`` elements."""
    sizes = torch.randint(low, high, (count,), generator=torch.Generator().manual_seed(1))
    return [(int(n),) for n in sizes]


def layouts(probe: Probe) -> list[tuple[str, Callable[[torch.dtype], list[Shape]]]]:
    """The four layouts, the real ones on a GPU (the transformer: bench_gpu's 420 tensors,
    2 GiB in float32 and 1 GiB in 2-byte dtypes), shrunk on a dry run."""
    dry = probe.dry
    width = 32 if dry else 1024

    def transformer(dtype: torch.dtype) -> list[Shape]:
        itemsize = dtype.itemsize
        total = (2 * width * width * 12 * 4 if dry else 2048 * MIB) * itemsize // 4
        return [shape for _, shape in transformer_layout(total, itemsize, width)]

    return [
        ("transformer", transformer),
        ("7B-like 8 layers", lambda _: llama_layout(2, 64, 172) if dry else llama_layout(8)),
        ("one 4096x4096", lambda _: [(64, 64)] if dry else [(4096, 4096)]),
        (
            "5000 tiny",
            lambda _: tiny_shapes(20, 10, 100) if dry else tiny_shapes(5000, 1000, 10_000),
        ),
    ]


class Timer:
    """Timing of device work: CUDA events, L2 flushed first, on a GPU; the host clock on a
    dry run."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.flush: torch.Tensor | None = None
        if probe.cuda:  # larger than any L2 (H100 50 MB, H200 60 MB)
            self.flush = torch.empty(256 * MIB, dtype=torch.uint8, device=probe.device)

    def once(self, fn: Callable[[], object], sleep_s: float = 0.0) -> tuple[float, bool]:
        """Seconds of ``fn``'s device work, and whether the host had queued all of it
        before the device started (``sleep_s``: the stream first waits about that long,
        so that the host's time stays out of the measurement)."""
        if self.flush is None:
            start_s = time.perf_counter()
            fn()
            return time.perf_counter() - start_s, True
        self.flush.zero_()
        if sleep_s:
            torch.cuda._sleep(int(sleep_s * 2e9))  # type: ignore[no-untyped-call]  # ~2 GHz
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        ahead = not sleep_s or not start.query()  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(self.probe.device)
        return start.elapsed_time(end) / 1e3, ahead

    def best(self, repeats: int, fn: Callable[[], object]) -> float:
        """The best of ``repeats`` timings of ``fn`` after one untimed warm-up."""
        fn()
        self.probe.synchronize()
        return min(self.once(fn)[0] for _ in range(repeats))


def flush_seconds(tensors: list[torch.Tensor], timer: Timer, repeats: int) -> tuple[float, bool]:
    """The best device time of one flush of the Triton path over ``tensors`` (its table
    copy, launches and merge), and whether the host was always ahead: the tensors are
    queued before the timed region, and the stream sleeps while the launches are made."""
    named = [(str(i), tensor) for i, tensor in enumerate(tensors)]

    def queued() -> PendingStats:
        pending = PendingStats(engine="triton")
        for name, tensor in named:
            pending.queue(name, tensor)
        return pending

    queued().settle()  # compiles if cold
    timer.probe.synchronize()
    pending = queued()
    start = time.perf_counter()
    pending.settle()
    host_s = time.perf_counter() - start  # the host's time to launch one warm flush
    timer.probe.synchronize()
    sleep_s = min(0.5, max(0.005, 3 * host_s))
    best, ahead = math.inf, True
    for _ in range(repeats):
        seconds, host_ahead = timer.once(queued().settle, sleep_s)
        best, ahead = min(best, seconds), ahead and host_ahead
    return best, ahead


def baselines(nbytes: int, dtype: torch.dtype, timer: Timer, repeats: int) -> tuple[float, float]:
    """Best seconds of a device-to-device copy and of ``torch.sum`` over one flat buffer
    of ``nbytes`` of ``dtype``: the ceilings a single-pass reduction is measured against."""
    gen = torch.Generator(device=timer.probe.device).manual_seed(4)
    flat = torch.randn(nbytes // dtype.itemsize, generator=gen, device=timer.probe.device)
    flat = flat.to(dtype)
    target = torch.empty_like(flat)
    return timer.best(repeats, lambda: target.copy_(flat)), timer.best(repeats, flat.sum)


def gradient_like(
    shapes: list[Shape], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Seeded normal values of scale 1e-3 (gradient-like) in each shape: the same tensors
    for every probe that times a flush of a layout."""
    gen = torch.Generator(device=device).manual_seed(3)
    return [(torch.randn(shape, generator=gen, device=device) * 1e-3).to(dtype) for shape in shapes]


def workload_row(
    label: str, dtype: torch.dtype, shapes: list[Shape], timer: Timer, repeats: int
) -> dict[str, object]:
    device = timer.probe.device
    tensors = gradient_like(shapes, dtype, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    kernel_s, ahead = flush_seconds(tensors, timer, repeats)
    del tensors
    copy_s, sum_s = baselines(nbytes, dtype, timer, repeats)
    if timer.probe.cuda:
        torch.cuda.empty_cache()
    rate = nbytes / kernel_s
    spec = spec_hbm(timer.probe.name())
    return {
        "workload": label,
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(shapes),
        "MiB": nbytes / MIB,
        "kernel ms": kernel_s * 1e3,
        "GB/s": rate / 1e9,
        "copy r+w GB/s": 2 * nbytes / copy_s / 1e9,
        "% of copy": 100 * rate * copy_s / (2 * nbytes),
        "% of sum": 100 * rate * sum_s / nbytes,
        "% of spec": 100 * rate / spec if spec else math.nan,
        "host ahead": "yes" if ahead else "NO",
    }


def bandwidth(probe: Probe) -> int:
    repeats = 1 if probe.dry else 10
    timer = Timer(probe)
    rows = [
        workload_row(f"{label}", dtype, shapes(dtype), timer, repeats)
        for label, shapes in layouts(probe)
        for dtype in DTYPES
    ]
    spec = spec_hbm(probe.name())
    print(table(rows, digits=1))
    print(f"\n{probe.name()}: spec HBM {spec / 1e12 if spec else 'unknown'} TB/s")
    if probe.cuda:
        clocks = nvidia_smi("clocks.sm,clocks.max.sm,clocks.mem")
        print(f"clocks after the runs (sm, max sm, mem): {clocks}")
    rates = [float(str(row["GB/s"])) for row in rows]
    slow = min(rows, key=lambda row: float(str(row["GB/s"])))
    share = [float(str(row["% of spec"])) for row in rows]
    figure = f"{len(rows)} workloads: kernel {min(rates):.3g}-{max(rates):.3g} GB/s"
    if spec:
        figure += f" = {min(share):.0f}-{max(share):.0f} % of spec {spec / 1e12:.2f} TB/s"
    figure += f"; slowest {slow['workload']} {slow['dtype']}"
    if any(row["host ahead"] != "yes" for row in rows):
        figure += "; host NOT always ahead (see bench.txt)"
    print(f"figure: {figure}")
    return 0


#: Other launch settings of the stats kernels (module constants of
#: :mod:`gradaudit.engine.triton_kernel`), measured beside the shipped ones on the layouts
#: short of issue 31's targets: a loop that keeps its next iterations' loads in flight
#: (Triton's ``cp.async`` pipelining), and more, shorter programs per SM.
LAUNCH_VARIANTS: dict[str, dict[str, int]] = {
    "2 stages": {"STAGES": 2},
    "3 stages": {"STAGES": 3},
    "8 programs/SM": {"PROGRAMS_PER_SM": 8},
    "3 stages, 8/SM": {"STAGES": 3, "PROGRAMS_PER_SM": 8},
}
#: The layouts (of :func:`layouts`) and dtypes they are measured on: those short of their
#: targets, and the 7B-like layout, which meets them, so that a setting that helps the
#: others is seen not to cost it.
LAUNCH_WORKLOADS: tuple[tuple[str, torch.dtype], ...] = (
    ("7B-like 8 layers", torch.bfloat16),
    ("transformer", torch.bfloat16),
    ("one 4096x4096", torch.float32),
    ("one 4096x4096", torch.bfloat16),
    ("5000 tiny", torch.float32),
    ("5000 tiny", torch.bfloat16),
)


def launch_shapes(probe: Probe) -> int:
    """Kernel-only GB/s of one flush with each of :data:`LAUNCH_VARIANTS` beside the launch
    as shipped (timed as ``bandwidth`` times it), and each variant's rows against the
    float64 reference: which setting, if any, should ship."""
    repeats = 1 if probe.dry else 10
    timer = Timer(probe)
    spec = spec_hbm(probe.name())
    shapes_of = dict(layouts(probe))
    rows: list[dict[str, object]] = []
    wrong: list[str] = []
    failed: list[str] = []
    figures: list[str] = []
    for label, dtype in LAUNCH_WORKLOADS:
        tensors = gradient_like(shapes_of[label](dtype), dtype, probe.device)
        named = {f"t{i}": tensor for i, tensor in enumerate(tensors)}
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        name = f"{label} {str(dtype).removeprefix('torch.')}"
        rates = {"as shipped": nbytes / flush_seconds(tensors, timer, repeats)[0]}
        for variant, settings in LAUNCH_VARIANTS.items():
            try:
                with _settings(triton_kernel, settings):
                    rates[variant] = nbytes / flush_seconds(tensors, timer, repeats)[0]
                    wrong += check(f"{name}, {variant}", named)
            except Exception as error:  # noqa: BLE001 (one variant failing must not end the step)
                failed.append(f"{name}, {variant}: {type(error).__name__}: {error}"[:300])
                print(f"FAIL {failed[-1]}")
        del tensors, named
        best = max(rates, key=rates.__getitem__)
        row: dict[str, object] = {"workload": name, "MiB": nbytes / MIB}
        for variant in ("as shipped", *LAUNCH_VARIANTS):
            rate = rates.get(variant)
            row[f"{variant} GB/s"] = "failed" if rate is None else rate / 1e9
        row["best"] = best
        row["best % of spec"] = 100 * rates[best] / spec if spec else math.nan
        rows.append(row)
        figures.append(f"{name} {best} x{rates[best] / rates['as shipped']:.2f}")
    print(table(rows, digits=1))
    verdict = f"; {len(wrong)} rows WRONG" if wrong else "; rows right"
    if failed:
        verdict += f"; {len(failed)} variants FAILED (see bench.txt)"
    print(f"figure: best launch over the shipped one: {'; '.join(figures)}{verdict}")
    return 1 if wrong or failed else 0


#: Other settings of the histogram launch, measured beside the shipped one: the full
#: histogram for every block (``WINDOW`` 0, the launch of 2026-11-27), a narrower window,
#: more programs per SM (what the time goes with, for the next change).
HISTOGRAM_VARIANTS: dict[str, dict[str, int]] = {
    "no window": {"WINDOW": 0},
    "window 32": {"WINDOW": 32},
    "16 programs/SM": {"PROGRAMS_PER_SM": 16},
}


@contextlib.contextmanager
def _settings(module: Any, settings: dict[str, int]) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def histogram(probe: Probe) -> int:
    """The exponent histogram's cost (``--precision``, a monitor's ``precision=``), × one
    ``torch.sum`` of the same tensor: the Triton launch
    (:func:`gradaudit.engine.triton_histogram.counts`) and the torch path it replaces
    (:func:`gradaudit.engine.histogram.exponent_histogram`), 256 MiB of each dtype (kernel
    time, CUDA events, L2 flushed), and whether the two give the same counts."""
    from gradaudit.engine import triton_histogram
    from gradaudit.engine.histogram import exponent_histogram

    repeats = 1 if probe.dry else 10
    timer = Timer(probe)
    rows: list[dict[str, object]] = []
    for dtype, data in itertools.product(DTYPES, ("gradient-like", "random bits")):
        n = 4_099 if probe.dry else (256 * MIB) // dtype.itemsize
        gen = torch.Generator(device=probe.device).manual_seed(5)
        if data == "random bits":  # every block beyond any window: the fallback's cost
            tensor = torch.randint(
                -(1 << 15),
                1 << 15,
                (n * dtype.itemsize // 2,),
                generator=gen,
                device=probe.device,
                dtype=torch.int16,
            ).view(dtype)
        else:
            tensor = (torch.randn(n, generator=gen, device=probe.device) * 1e-3).to(dtype)
        triton_histogram.counts(tensor)  # compiled before it is timed
        probe.synchronize()
        same = triton_histogram.counts(tensor).tolist() == exponent_histogram(tensor).tolist()
        summed = timer.best(repeats, tensor.sum)
        launched = timer.best(repeats, lambda t=tensor: triton_histogram.counts(t))
        torch_ops = timer.best(repeats, lambda t=tensor: exponent_histogram(t))
        row: dict[str, object] = {
            "dtype": str(dtype).removeprefix("torch."),
            "data": data,
            "MiB": n * dtype.itemsize / MIB,
            "sum ms": summed * 1e3,
            "triton × sum": launched / summed,
            "torch ops × sum": torch_ops / summed,
            "counts": "agree" if same else "DIFFER",
        }
        for label, settings in HISTOGRAM_VARIANTS.items():
            with _settings(triton_histogram, settings):
                triton_histogram.counts(tensor)  # each compiles its own variant
                took = timer.best(repeats, lambda t=tensor: triton_histogram.counts(t))
            row[f"{label} × sum"] = took / summed
        rows.append(row)
    print(table(rows, digits=2))
    parts = [
        f"{row['dtype']} {float(str(row['triton × sum'])):.2f}x"
        f" (torch ops {float(str(row['torch ops × sum'])):.1f}x)"
        for row in rows
        if row["data"] == "gradient-like"
    ]
    worst = max(float(str(row["triton × sum"])) for row in rows if row["data"] == "random bits")
    parts.append(f"random bits up to {worst:.2f}x")
    wrong = [f"{row['dtype']} {row['data']}" for row in rows if row["counts"] != "agree"]
    verdict = f"; counts DIFFER for {', '.join(wrong)}" if wrong else "; same counts"
    print(f"figure: histogram x sum: {'; '.join(parts)}{verdict}")
    return 1 if wrong else 0


def host_cost(probe: Probe) -> int:
    """Host µs per tensor of one flush with real launches: 420 and 10,000 tensors, per-tensor
    and planned (a training loop's columns)."""
    gib, tiny, repeats = (0.002, 100, 2) if probe.dry else (2.0, 10_000, 10)
    rows = host_cost_rows(probe.device, gib, tiny, repeats)
    for row in rows:
        total_ms = float(str(row["queue ms"])) + float(str(row["launch ms"]))
        row["µs/tensor"] = 1e3 * total_ms / int(str(row["tensors"]))
    print(table(rows, digits=3))
    parts = [
        f"{row['tensors']} {row['workload']} {row['path']}: {float(str(row['µs/tensor'])):.2f}"
        for row in rows
    ]
    print(f"figure: host µs per tensor ({rows[0]['kernels']} kernels): {'; '.join(parts)}")
    return 0


def host_profile(probe: Probe) -> int:
    """Where a planned flush's host time goes with real launches: ``cProfile`` of a training
    loop's steady state (the 420-tensor transformer, float32, and 10,000 tiny tensors), the
    functions that take the most time of their own. ``host-cost`` says how much; this, why."""
    import cProfile
    import pstats

    from gradaudit.engine.stats import StatsCollector

    gib, tiny, steps = (0.002, 100, 5) if probe.dry else (2.0, 10_000, 200)
    if not probe.cuda:
        noop_kernels()
    sizes = torch.randint(1000, 10_000, (tiny,), generator=torch.Generator().manual_seed(1))
    workloads = {
        "transformer-float32": [
            torch.empty(shape, device=probe.device)
            for _, shape in transformer_layout(int(gib * 1024 * 2**20), 4)
        ],
        f"{tiny}-tiny": [torch.empty(int(n), device=probe.device) for n in sizes],
    }
    figures = []
    for label, tensors in workloads.items():
        names = [str(i) for i in range(len(tensors))]
        collector = StatsCollector(engine="triton")

        def step() -> None:
            PendingStats(collector=collector.fresh()).add_tensors(names, tensors)  # noqa: B023

        for _ in range(3):  # compile, then plan, then the plan taken
            step()
        probe.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
        probe.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        probe.synchronize()
        print(f"{label}: {len(tensors)} tensors, {wall * 1e3:.3f} ms per step unprofiled")
        stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs()
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(15)
        figures.append(f"{label} {wall * 1e3:.3f} ms/step")
    print(f"figure: planned steps, host wall: {'; '.join(figures)}")
    return 0


def kernels(probe: Probe) -> int:
    """The launches that the ``kernel-profile`` step profiles under Nsight Compute (``ncu``,
    when the machine has it): what the other steps measured short of its target, once each
    after a warm-up, with ``torch.sum`` of the same bytes beside each (``reduce_kernel``).
    The exponent histogram of 64 MiB of gradient-like bfloat16 and float32 values (10-14x a
    sum pass on an H100 and an H200), and one flush of 5,000 tiny bfloat16 tensors
    (25-33 % of HBM) and of the 420-tensor bfloat16 transformer (77-81 %)."""
    from gradaudit.engine import triton_histogram

    gen = torch.Generator(device=probe.device).manual_seed(6)
    launched = []
    for dtype in (torch.bfloat16, torch.float32):
        n = 4_099 if probe.dry else (64 * MIB) // dtype.itemsize
        tensor = (torch.randn(n, generator=gen, device=probe.device) * 1e-3).to(dtype)
        triton_histogram.counts(tensor)  # compiles
        probe.synchronize()
        triton_histogram.counts(tensor)
        tensor.sum()
        probe.synchronize()
        launched.append(f"histogram {str(dtype).removeprefix('torch.')}")
    for label, shapes in layouts(probe):
        if label not in ("5000 tiny", "transformer"):
            continue
        tensors = [
            torch.randn(shape, generator=gen, device=probe.device).to(torch.bfloat16)
            for shape in shapes(torch.bfloat16)
        ]
        for _ in range(2):  # compiles, then the profiled one
            pending = PendingStats(engine="triton")
            for i, tensor in enumerate(tensors):
                pending.queue(str(i), tensor)
            pending.settle()
            probe.synchronize()
        torch.cat([t.reshape(-1) for t in tensors]).sum()
        probe.synchronize()
        launched.append(f"flush of {label} bfloat16 ({len(tensors)} tensors)")
    print(f"figure: launched {'; '.join(launched)}")
    return 0


def graph(probe: Probe) -> int:
    """The product's CUDA-graph replay of a planned flush (:mod:`gradaudit.engine.
    triton_graph`) against its launch: per step, the plan's checks and addresses, then
    either the launch (a pinned copy of the table, the Triton launches, two allocations)
    or the captured graph replayed (the table into its pinned buffer, one graph launch, a
    copy of the rows). Rows checked equal to the launch's, for the values the graph was
    captured with and after new values are written in place; then a step with the
    tensors moved must launch (its bases differ) and still be right. On a dry run there
    are no graphs: the launch path runs for its logic."""
    from gradaudit.engine import triton_graph, triton_kernel, triton_plan

    steps = 5 if probe.dry else 200
    if not probe.cuda:
        noop_kernels()
    count = 100 if probe.dry else 10_000
    sizes = torch.randint(1000, 10_000, (count,), generator=torch.Generator().manual_seed(1))
    gib = 0.002 if probe.dry else 1.0
    workloads = {
        "transformer-bfloat16": [
            torch.empty(shape, device=probe.device, dtype=torch.bfloat16)
            for _, shape in transformer_layout(int(gib * 1024 * MIB), 2)
        ],
        f"{len(sizes)}-tiny float32": [torch.empty(int(n), device=probe.device) for n in sizes],
    }
    figures, wrong = [], []
    for label, tensors in workloads.items():
        for tensor in tensors:
            tensor.normal_()
        plan = triton_plan.plan_for(tensors, triton_kernel.sms_of(probe.device))
        assert plan is not None, "the probe's tensors are for the planned path"
        graphs = plan.replays

        def flushed(listed: list[torch.Tensor]) -> torch.Tensor:
            found = plan.pointers(listed)  # noqa: B023
            assert found is not None
            host = plan.table(found)  # noqa: B023
            assert host is not None
            return plan.launch(listed, host)  # noqa: B023

        def host_ms() -> float:
            """The host's time per step, each step queued once the GPU has run the last
            (as in a training loop, where a step's flush has long run by the next)."""
            total = 0.0
            for _ in range(steps):
                probe.synchronize()
                start = time.perf_counter()
                flushed(tensors)  # noqa: B023
                total += time.perf_counter() - start
            probe.synchronize()
            return total / steps * 1e3

        # Each tensor's row (a dtype group's sentinel row is never written for a reader).
        real = torch.as_tensor(plan.rows_of, device=probe.device)
        on = graphs.enabled
        graphs.enabled = False
        expected = flushed(tensors)[real]  # compiles
        launch_ms = host_ms()
        if not (probe.cuda and on):
            why = "no graph on a dry run" if not probe.cuda else f"{triton_graph.ENVIRONMENT}=0"
            figures.append(f"{label} launch {launch_ms:.3f} ms/step ({why})")
            continue
        graphs.enabled = True
        for _ in range(triton_graph.STABLE_LAUNCHES):
            flushed(tensors)
        probe.synchronize()
        if graphs.captured is None:
            print(f"{label}: not captured (the capture failed: graphs off for the plan)")
            figures.append(f"{label} capture FAILED")
            wrong.append(label)
            continue
        checks = {"replayed": torch.equal(flushed(tensors)[real], expected)}
        before = graphs.replays
        graph_ms = host_ms()
        replayed = graphs.replays - before
        for tensor in tensors:  # new values in place: the same bases, replayed
            tensor.mul_(-2.0)
        rows = flushed(tensors)[real]
        graphs.enabled = False
        graphs_captured, graphs.captured = graphs.captured, None
        checks["new values"] = torch.equal(rows, flushed(tensors)[real])
        graphs.captured, graphs.enabled = graphs_captured, True
        moved = [tensor.clone() for tensor in tensors]  # other bases: launched, not replayed
        before = graphs.replays
        # Not bit for bit: a tensor below its group's base (a negative offset) starts its
        # aligned body a vector later (the kernel's division truncates toward zero), so its
        # elements meet the lanes in another order and the float64 sums of squares may
        # differ in their last bits (seen on the H200, 2026-11-27, and through the
        # interpreter: only rows with a negative offset on one side differ).
        checks["moved, right"] = torch.allclose(flushed(moved)[real], rows, rtol=1e-12, atol=0)
        checks["moved, launched"] = graphs.replays == before
        probe.synchronize()
        same = all(checks.values())
        wrong_checks = ", ".join(name for name, ok in checks.items() if not ok)
        print(
            f"{label}: {len(tensors)} tensors, host per step: launch {launch_ms:.3f} ms, "
            f"graph replay {graph_ms:.3f} ms ({replayed} of {steps} steps replayed); rows "
            f"{'the same' if same else 'DIFFER: ' + wrong_checks}"
        )
        figures.append(f"{label} launch {launch_ms:.3f} / replay {graph_ms:.3f} ms/step")
        if not same:
            wrong.append(label)
    verdict = f"; NOT RIGHT (capture failed or rows differ) for {', '.join(wrong)}" if wrong else ""
    print(f"figure: {'; '.join(figures)}{verdict}")
    return 1 if wrong else 0


COMMANDS: dict[str, Callable[[Probe], int]] = {
    "env": env,
    "warm-up": warm_up,
    "correctness": correctness,
    "bandwidth": bandwidth,
    "launch-shapes": launch_shapes,
    "histogram": histogram,
    "host-cost": host_cost,
    "host-profile": host_profile,
    "kernels": kernels,
    "graph": graph,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=sorted(COMMANDS))
    parser.add_argument(
        "--dry-run", action="store_true", default=os.environ.get("GA_DRY_RUN") == "1"
    )
    parser.add_argument("--small", action="store_true", help="small sizes (compute-sanitizer)")
    args = parser.parse_args(argv)
    probe = setup(args.dry_run, args.small)
    if probe is None:
        print("figure: no CUDA device (torch.cuda.is_available() is False); see env.txt")
        return 2
    return COMMANDS[args.what](probe)


if __name__ == "__main__":
    sys.exit(main())
