"""Start-up of the torch-free CLI: wall and CPU of fresh processes, next to their floor.

A small run is all start-up: ``gradaudit scan small.pt`` (a 28 KB MLP state dict) audits
its tensors in a millisecond. Each command runs ``--repeats`` times in a fresh
interpreter, the commands interleaved so that another job's load falls on all of them
alike; the median wall (``perf_counter`` around ``subprocess.run``) and CPU
(``RUSAGE_CHILDREN``) are printed, with the load average and the CPU model, since a
loaded 2-core machine doubles wall time. The floor rows are what no torch-free run can
skip: the interpreter, and Typer, Rich and numpy imported together.

    python -m benchmarks.bench_startup --repeats 9

Run it with the bytecode compiled (``python -m compileall gradaudit``): an installed
package has it, and ``PYTHONDONTWRITEBYTECODE`` would otherwise make every run compile
every module again (~0.2 s).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "fixtures" / "demo_grads.safetensors"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_inputs(folder: Path) -> dict[str, Path]:
    """``small.pt``, a second one to compare with, and four ``.pt`` step dumps to trend."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )
    torch.save(model.state_dict(), folder / "small.pt")
    torch.save({k: v * 2 for k, v in model.state_dict().items()}, folder / "small2.pt")
    steps = folder / "steps"
    steps.mkdir()
    for step in range(4):
        grads = {name: torch.randn_like(p) * (step + 1) for name, p in model.named_parameters()}
        torch.save(grads, steps / f"step_{step}.pt")
    return {"small": folder / "small.pt", "small2": folder / "small2.pt", "steps": steps}


def commands(inputs: dict[str, Path]) -> dict[str, list[str]]:
    """Each row's arguments to the interpreter."""
    cli = ["-m", "gradaudit"]
    return {
        "python -c pass": ["-c", "pass"],
        "floor: import typer, rich, numpy": ["-c", "import typer, rich.console, rich.table, numpy"],
        "import gradaudit.cli": ["-c", "import gradaudit.cli"],
        "gradaudit --version": [*cli, "--version"],
        "gradaudit scan small.pt": [*cli, "scan", str(inputs["small"])],
        "gradaudit scan demo_grads.safetensors": [*cli, "scan", str(DEMO)],
        "gradaudit compare small.pt small2.pt": [
            *cli,
            "compare",
            str(inputs["small"]),
            str(inputs["small2"]),
        ],
        "gradaudit trend steps/ (4 .pt)": [*cli, "trend", str(inputs["steps"])],
    }


def measure(rows: dict[str, list[str]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall s, CPU s) of each row, the rows interleaved ``repeats`` times."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, args in rows.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, *args], env=env, capture_output=True, check=False, timeout=300
            )
            wall[name].append(time.perf_counter() - started)
            if done.returncode not in (0, 1):  # a failed run would time its error message
                raise SystemExit(f"{name}: exit {done.returncode}: {done.stderr[-500:]!r}")
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        results = measure(commands(write_inputs(Path(folder))), args.repeats)
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{_cpu_model()}, {os.cpu_count()} CPUs, load average {load}; median of {args.repeats}")
    print("command | wall s | cpu s")
    print("--- | --- | ---")
    for name, (wall, cpu) in results.items():
        print(f"{name} | {wall:.3f} | {cpu:.3f}")


if __name__ == "__main__":
    main()
