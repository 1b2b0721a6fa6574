"""``gradaudit compare`` on dumps of a ~100M-parameter model's real backward pass.

    python -m benchmarks.bench_compare [--layers 12] [--width 768] [--vocab 8192] [--dir DIR]

Builds a GPT-style host (token embedding, ``--layers`` ``nn.TransformerEncoderLayer``
blocks, an output head) with a bottleneck seed grafted after the first block, runs one
forward and backward pass on a small batch, and writes four dumps: host, seed, both in
one file (``host.`` / ``seed.`` prefixes) and the whole model after a second step. It
then times, in one process with a warm page cache, the three ``compare`` invocations of
the README next to ``scan_paths`` over the same files and one ``torch.sum`` pass over
the same tensors (the yardstick), best of ``--rounds`` round-robin rounds. Machines
are noisy: compare the ratios.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import gradaudit
from fixtures.make_fixtures import Seed


class Host(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, width // 64, 4 * width, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab)


class Grafted(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.host = Host(vocab, width, layers)
        self.seed = Seed(width, bottleneck=64)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.host.embed(tokens)
        for index, layer in enumerate(self.host.layers):
            x = layer(x)
            if index == 0:
                x = self.seed(x)
        out: torch.Tensor = self.host.head(x)
        return out


def step(model: Grafted, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    tokens = torch.randint(0, model.vocab, (2, 17))
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, model.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()


def grads(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {
        prefix + name: p.grad.detach().clone()
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dir", type=Path, default=None, help="where the dumps are written")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="best of this many rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = Grafted(args.vocab, args.width, args.layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    step(model, optimizer)
    backward_s = time.perf_counter() - start
    first = {"host": grads(model.host), "seed": grads(model.seed), "whole": grads(model)}
    first["both"] = {**grads(model.host, "host."), **grads(model.seed, "seed.")}
    step(model, optimizer)
    second = grads(model)
    params = sum(p.numel() for p in model.parameters())
    seed_params = sum(p.numel() for p in model.seed.parameters())
    print(
        f"model: {params / 1e6:.1f}M parameters (seed {seed_params:,}), "
        f"{len(first['whole'])} gradient tensors, one forward+backward {backward_s:.2f} s"
    )

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        paths = {name: d / f"{name}.safetensors" for name in (*first, "second")}
        for name, tensors in first.items():
            save_file(tensors, str(paths[name]))
        save_file(second, str(paths["second"]))
        del first

        whole = list(second.values())

        def sum_pass() -> None:
            for t in whole:
                t.sum()

        sum_pass()
        t_sum = best_of(1, sum_pass)
        runs: list[tuple[str, Callable[[], object]]] = [
            (
                "compare host.safetensors seed.safetensors",
                lambda: gradaudit.compare_paths(paths["host"], paths["seed"], device="cpu"),
            ),
            (
                "compare both.safetensors --host-prefix host. --seed-prefix seed.",
                lambda: gradaudit.compare_paths(
                    paths["both"], host_prefix="host.", seed_prefix="seed.", device="cpu"
                ),
            ),
            (
                "compare whole.safetensors second.safetensors",
                lambda: gradaudit.compare_paths(paths["whole"], paths["second"], device="cpu"),
            ),
            (
                "scan whole.safetensors second.safetensors (yardstick)",
                lambda: gradaudit.scan_paths([paths["whole"], paths["second"]], device="cpu"),
            ),
        ]
        for _label, fn in runs:
            fn()  # warm the page cache
        # Round-robin rounds, best of each: a burst of load from elsewhere on a shared
        # machine then slows one round of every invocation, not every round of one.
        best = [float("inf")] * len(runs)
        for _ in range(args.rounds):
            t_sum = min(t_sum, best_of(1, sum_pass))
            for index, (_label, fn) in enumerate(runs):
                best[index] = min(best[index], best_of(1, fn))
        print(f"\none torch.sum pass over the model's gradients: {1e3 * t_sum:.0f} ms\n")
        print("invocation | seconds | × sum pass")
        print("--- | --- | ---")
        for (label, _fn), seconds in zip(runs, best, strict=True):
            print(f"{label} | {seconds:.2f} | {seconds / t_sum:.1f}")
        c = gradaudit.compare_paths(paths["host"], paths["seed"], device="cpu")
        print(
            f"\nhost {c.dual.host_params:,} params, norm {c.dual.host_norm:.4g}; "
            f"seed {c.dual.seed_params:,} params, norm {c.dual.seed_norm:.4g}; "
            f"normalized ratio {c.dual.normalized_ratio:.4g}"
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
