"""What a GradientMonitor costs a training loop, as a ratio to the backward pass.

    python -m benchmarks.bench_monitor [--steps 300] [--threads 2] [--device cpu]

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

Machines are noisy: compare the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradaudit


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warmup = 20

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
