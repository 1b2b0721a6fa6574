"""What a GradientMonitor costs a training loop, as a ratio to a bare norm and to backward.

    python -m benchmarks.bench_monitor [--steps 300] [--repeats 300] [--threads 2]
                                       [--device cpu] [--ratio-only] [--precision FMT]

First, against a bare norm (issue 28 item 9): for a GPT-like module with 40 gradient
tensors (~0.7 M elements) and one with 400 (~7 M; width 128, blocks of 12 parameters), the
median time of one ``monitor.step()`` with ``every=1`` (every call collects), with
``sync=True`` (collect and read this step's stats in the call) and in the default mode
(``sync=False``: collect this step, read the previous one), beside the median
``torch.nn.utils.get_total_norm(grads).item()`` on the same gradients, and their ratio.
The gradients are swapped between two sets each step (as ``zero_grad(set_to_none=True)``
and a backward make fresh ones) and the calls interleave, in an order that rotates, so a
slow moment of a shared machine hits all of them alike. ``--precision fp16`` (or any
``GradientMonitor(precision=...)`` format) adds, in the same rotation, the same two monitors
with ``precision=`` on, and their ratio to the monitor without it (the cost of judging the
headroom on every collected step; ``precision=None`` runs exactly the code without it).
The CPU, the native kernel's
ISA path and the load average are printed with it. The monitor's own defaults
(``every=100``, ``sync=False``) collect one call in 100; the cost of that collecting call
is the ``every=1`` figure.

A small transformer (embedding, 2 encoder layers of width 256 with 8 heads and
a feed-forward of 1024, a vocabulary head; batch 8 x 128 tokens) is trained
with SGD. In the same process it measures:

* ``backward``: the median ``loss.backward()`` (the yardstick);
* ``monitor.step()``: the median time of one call, by kind of call, for
  ``every=1`` and ``every=100``, default and ``sync=True``: a collecting call
  (queue the stats; with ``sync=True`` or ``every=1`` also read them), the call
  after it (default mode: read the previous collection) and the other calls (a
  counter);
* the overhead per call amortised over ``every`` calls (median cost of a
  collecting call and of another call, weighted by how often each happens), as
  a ratio to the median ``backward`` of the same run. Medians, so that another
  process that slows the machine down for a moment does not skew the ratio.

Machines are noisy: compare the ratios, not the milliseconds. ``--ratio-only`` prints the
first table alone. With ``--precision`` the monitors of the second table judge that format
too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

import gradaudit
from benchmarks.bench_peers import cpu_model
from gradaudit.engine import native


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab: int = 1000, width: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(
            width, nhead=8, dim_feedforward=4 * width, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(tokens)))
        return out


class Block(torch.nn.Module):
    """A pre-norm transformer block's parameters: 12 tensors (no forward is run)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)


class GradientsOnly(torch.nn.Module):
    """A GPT-like module, ``12 * blocks + 4`` parameter tensors; gradients set, not computed."""

    def __init__(self, blocks: int, vocab: int, width: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)


#: (blocks, vocabulary): 40 tensors / 0.73 M elements and 400 tensors / 7.1 M elements.
RATIO_MODELS = ((3, 512), (33, 2048))


def norm_ratios(repeats: int, warmup: int = 20, precision: str | None = None) -> list[str]:
    """The rows of the table of ``monitor.step()`` against ``get_total_norm(...).item()``
    (with ``precision``, also against the same monitors judging that format)."""
    return [
        _norm_ratio(blocks, vocab, repeats, warmup, precision) for blocks, vocab in RATIO_MODELS
    ]


def _norm_ratio(
    blocks: int, vocab: int, repeats: int, warmup: int, precision: str | None = None
) -> str:
    torch.manual_seed(0)
    model = GradientsOnly(blocks, vocab)
    params = list(model.parameters())
    sets = [[torch.randn_like(p) * 1e-3 for p in params] for _ in range(2)]
    current = [sets[0]]  # the gradients of this step, for the bare norm
    synced = gradaudit.GradientMonitor(model, every=1, sync=True, dump_dir=None)
    default = gradaudit.GradientMonitor(model, every=1, dump_dir=None)
    calls: dict[str, Callable[[], object]] = {
        "norm": lambda: torch.nn.utils.get_total_norm(current[0]).item(),
        "sync": synced.step,
        "default": default.step,
    }
    with_precision: list[gradaudit.GradientMonitor] = []
    if precision is not None:
        for sync in (True, False):
            monitor = gradaudit.GradientMonitor(
                model,
                every=1,
                sync=sync,
                dump_dir=None,
                precision=precision,
                on_finding="ignore",
            )
            with_precision.append(monitor)
            calls[f"{'sync' if sync else 'default'}+precision"] = monitor.step
    times: dict[str, list[float]] = {name: [] for name in calls}
    orders = itertools.cycle(itertools.permutations(calls))
    for step in range(warmup + repeats):
        current[0] = sets[step % 2]
        for param, grad in zip(params, current[0], strict=True):
            param.grad = grad
        for name in next(orders):
            start = time.perf_counter()
            calls[name]()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    default.flush()
    for monitor in with_precision:
        monitor.flush()
    median = {name: statistics.median(values) for name, values in times.items()}
    spread = {name: _spread(values) for name, values in times.items()}
    cells = [f"{len(params)} | {sum(p.numel() for p in params) / 1e6:.2f}"]
    cells.append(f"{1e3 * median['norm']:.3f} ({spread['norm']})")
    for name in ("sync", "default"):
        ratio = median[name] / median["norm"]
        cells.append(f"{1e3 * median[name]:.3f} ({spread[name]}) | {ratio:.2f}")
    for name in ("sync", "default") if precision is not None else ():
        timed = median[f"{name}+precision"]
        spread_of = spread[f"{name}+precision"]
        cells.append(f"{1e3 * timed:.3f} ({spread_of}) | {timed / median[name]:.2f}")
    return " | ".join(cells)


def _spread(values: Sequence[float]) -> str:
    """The interquartile range in ms, ``p25-p75``."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{1e3 * q1:.3f}-{1e3 * q3:.3f}"


def _load() -> str:
    """The load average over 1, 5 and 15 minutes: other jobs on a shared machine skew the
    milliseconds (the ratios less, as the calls interleave)."""
    if not hasattr(os, "getloadavg"):
        return "load average unknown"
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _kernel_path() -> str:
    return native.path() if native.available() else "not built (eager engine)"


def run(
    steps: int, device: torch.device, monitor_kwargs: dict[str, object] | None
) -> tuple[list[float], list[float], list[str]]:
    """Train ``steps`` steps; times of backward and of monitor.step(), and each call's kind."""
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = (
        None
        if monitor_kwargs is None
        else gradaudit.GradientMonitor(model, dump_dir=None, **monitor_kwargs)  # type: ignore[arg-type]
    )
    tokens = torch.randint(0, 1000, (8, 128), device=device)
    backward: list[float] = []
    overhead: list[float] = []
    kinds: list[str] = []
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        optimizer.zero_grad()
        _sync(device)
        start = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        _sync(device)
        backward.append(time.perf_counter() - start)
        if monitor is not None:
            start = time.perf_counter()
            monitor.step()
            overhead.append(time.perf_counter() - start)
            phase = step % monitor.every
            kinds.append("collect" if phase == 0 else "read" if phase == 1 else "other")
        optimizer.step()
    if monitor is not None:
        monitor.flush()
    return backward, overhead, kinds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=300, help="calls timed per model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ratio-only", action="store_true", help="only the table against a norm")
    parser.add_argument(
        "--precision", default=None, help="also time monitors judging this format's headroom"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warmup = 20

    print(
        f"CPU: {cpu_model()}; native kernel path: {_kernel_path()}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {_load()}"
    )
    print(
        "tensors | M elements | get_total_norm().item() ms (IQR) "
        "| step() sync=True, every=1 ms (IQR) | × norm "
        "| step() default mode, every=1 ms (IQR) | × norm"
        + (
            ""
            if args.precision is None
            else f" | sync=True, precision={args.precision} ms (IQR) | × without"
            f" | default mode, precision={args.precision} ms (IQR) | × without"
        )
    )
    print(" | ".join(["---"] * (7 if args.precision is None else 11)))
    for row in norm_ratios(args.repeats, precision=args.precision):
        print(row)
    if args.ratio_only:
        return
    print()

    baseline, _, _ = run(warmup + args.steps, device, None)
    print(f"backward without a monitor: {1e3 * statistics.median(baseline[warmup:]):.2f} ms\n")
    kinds = ("collect", "read", "other")
    print(
        "mode | every | backward ms | step() ms: collecting call | the call after "
        "| other calls | step() per call, amortised × backward"
    )
    print("--- | --- | --- | --- | --- | --- | ---")
    for every in (1, 100):
        for sync in (False, True):
            options: dict[str, object] = {"every": every, "sync": sync}
            if args.precision is not None:
                options.update(precision=args.precision, on_finding="ignore")
            backward, overhead, kind_of = run(warmup + args.steps, device, options)
            t_backward = statistics.median(backward[warmup:])
            by_kind: dict[str, list[float]] = {kind: [] for kind in kinds}
            for seconds, kind in zip(overhead[warmup:], kind_of[warmup:], strict=True):
                by_kind[kind].append(seconds)
            medians = {k: statistics.median(v) for k, v in by_kind.items() if v}
            calls = sum(len(v) for v in by_kind.values())
            amortised = sum(medians[k] * len(by_kind[k]) for k in medians) / calls
            cells = [f"{1e3 * medians[k]:.3f}" if k in medians else "-" for k in kinds]
            print(
                f"{'sync' if sync else 'default'} | {every} | {1e3 * t_backward:.1f} | "
                f"{' | '.join(cells)} | {amortised / t_backward:.4f}"
            )
    params = list(TinyTransformer().parameters())
    print(
        f"\n{sum(p.numel() for p in params) / 1e6:.2f} M parameters in {len(params)} tensors, "
        f"torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {device}"
    )


if __name__ == "__main__":
    main()
