"""``gradaudit scan`` on a multi-GiB safetensors file against ``cat``, as separate processes.

    python -m benchmarks.bench_file [--gib 4] [--dir DIR] [--engine auto]

Marginal scan time = scan of the big file minus scan of a tiny file, so that
interpreter and import start-up cancel out; it is compared with
``cat file > /dev/null`` on the same, warm, page cache. Peak anonymous memory
(``RssAnon``, which excludes the file-backed pages of the memory-mapped dump)
is sampled from /proc while each scan runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.bench_many import MIB, run


def write_dump(path: Path, gib: float) -> None:
    """A transformer-like fp32 dump written shard by shard of layers, never all in memory."""
    width = 2048
    per_layer = 12 * width * width
    layers = max(1, int(gib * 1024 * MIB) // (4 * per_layer))
    gen = torch.Generator().manual_seed(0)
    # save_file needs all tensors at once; build them as views of one buffer
    # per layer group is not possible with safetensors, so we write in one go
    # but generate lazily-cheap data (a repeated random block).
    block = torch.randn(width * width, generator=gen) * 1e-3
    tensors = {}
    for i in range(layers):
        tensors[f"layers.{i}.attn.qkv.weight"] = block.repeat(3).view(3 * width, width)
        tensors[f"layers.{i}.attn.out.weight"] = block.clone().view(width, width)
        tensors[f"layers.{i}.mlp.fc1.weight"] = block.repeat(4).view(4 * width, width)
        tensors[f"layers.{i}.mlp.fc2.weight"] = block.repeat(4).view(width, 4 * width)
    tensors["layers.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(tensors, str(path))


def best(command: list[str], repeats: int) -> tuple[float, int]:
    """Best wall time and largest peak RssAnon (bytes) of ``repeats`` runs of a command."""
    runs = [run(command, timeout=3600) for _ in range(repeats)]
    seconds = min(float(r["s"]) for r in runs)
    return seconds, int(max(float(r["peak RssAnon MiB"]) for r in runs) * MIB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        big, tiny = Path(tmp) / "big.safetensors", Path(tmp) / "tiny.safetensors"
        write_dump(big, args.gib)
        save_file({"w": torch.randn(16)}, str(tiny))
        scan = [sys.executable, "-m", "gradaudit", "scan", "--format", "json", "--device", "cpu"]
        scan += ["--engine", args.engine]
        subprocess.run(["cat", str(big)], stdout=subprocess.DEVNULL, check=True)  # warm cache
        t_cat, _ = best(["cat", str(big)], args.repeats)
        t_tiny, m_tiny = best([*scan, str(tiny)], args.repeats)
        t_big, m_big = best([*scan, str(big)], args.repeats)
        size = big.stat().st_size
    marginal = t_big - t_tiny
    print(f"file {size / 2**30:.2f} GiB, engine {args.engine}, torch {torch.__version__}")
    print(f"cat {t_cat:.3f} s ({size / t_cat / 1e9:.1f} GB/s)")
    print(f"scan tiny {t_tiny:.3f} s, scan big {t_big:.3f} s, marginal {marginal:.3f} s")
    print(f"marginal / cat = {marginal / t_cat:.2f}")
    print(f"peak RssAnon: tiny {m_tiny / MIB:.0f} MiB, big {m_big / MIB:.0f} MiB")


if __name__ == "__main__":
    main()
