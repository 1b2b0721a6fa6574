"""What locating a NaN costs a training step, against a plain step and ``detect_anomaly``.

    python -m benchmarks.bench_locate [--steps 30] [--threads 2] [--device cpu]

The small transformer of ``bench_monitor.py`` (2 encoder layers of width 256,
8 heads, batch 8 x 128 tokens). In one process, interleaved round by round so
that a noisy neighbour slows every variant alike, it times one forward +
backward:

* ``plain``: no hooks (the yardstick);
* ``NanLocator``: forward and full backward hooks armed, plus the one read;
* ``NanLocator(backward=False)``: forward hooks only, plus the read;
* ``detect_anomaly``: ``torch.autograd.detect_anomaly(check_nan=True)``;
* ``StepReplay armed``: what a monitor with ``locate=...`` and ``sync=True`` adds to every
  step, located or not: two hooks on the root that keep the batch, the random state and the
  gradient flowing into the output, so a NaN step can be replayed under the locator.

Medians, printed as milliseconds and as a ratio to ``plain``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator

import torch

import gradaudit
from benchmarks.bench_monitor import TinyTransformer
from benchmarks.bench_scan import table
from gradaudit.training.replay import StepReplay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    tokens = torch.randint(0, 1000, (8, 128), device=device)

    def step() -> None:
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def located(backward: bool) -> Iterator[None]:
        with gradaudit.NanLocator(model, backward=backward) as locator:
            yield
            locator.read()

    @contextlib.contextmanager
    def replayable() -> Iterator[None]:
        replay = StepReplay(model)
        replay.arm()
        yield
        replay.disarm()

    variants: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
        "plain": contextlib.nullcontext,
        "NanLocator": lambda: located(True),
        "NanLocator(backward=False)": lambda: located(False),
        "detect_anomaly": lambda: torch.autograd.detect_anomaly(check_nan=True),
        "StepReplay armed": replayable,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # detect_anomaly's and the hooks' notices
        for round_ in range(args.steps + 2):
            for name, context in variants.items():
                _sync(device)
                start = time.perf_counter()
                with context():
                    step()
                _sync(device)
                if round_ >= 2:  # warm-up rounds
                    times[name].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    rows = [
        {
            "variant": name,
            "ms per step": 1e3 * statistics.median(values),
            "× plain": statistics.median(values) / plain,
        }
        for name, values in times.items()
    ]
    print(table(rows, 2))
    modules = sum(1 for _ in model.modules())
    print(
        f"\n{modules} modules, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"device {device}, {args.steps} steps"
    )


if __name__ == "__main__":
    main()
