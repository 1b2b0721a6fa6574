"""A safetensors file of very many tiny tensors: time and peak memory of each step.

    python -m benchmarks.bench_many [--count 1000000] [--elements 4] [--dir DIR]
        [--formats table json markdown github junit] [--data random zeros] [--timeout 600]
        [--compare]

A LoRA-style or MoE dump can hold hundreds of thousands of tensors, and then
what costs is not the bytes (a million 4-element float32 tensors is 16 MB)
but everything done once per tensor: the header's JSON, its validation, the
bookkeeping of each tensor while streaming, and the report. For each kind of
data (``random``: nothing to report; ``zeros``: a dump taken after
``zero_grad(set_to_none=False)``, every tensor flagged vanishing) it prints,
each in a fresh child process:

* ``import torch`` alone: the floor every scan starts from;
* ``read_header`` alone (parsing and validating the header);
* ``gradaudit scan FILE --format F`` for each format, stdout to ``/dev/null``;
* with ``--python-reader``, the table scan again with the pure-Python header reader
  (what an install without the native extension runs);
* with ``--compare``, ``gradaudit compare`` of a random and an all-zero file of
  ``--count`` tensors each in each format, and of one file's two prefixes (half each);
* with ``--torch-path``, each scan again with the torch-free scan turned off (torch
  imported, as every scan did before :mod:`gradaudit.scan.torch_free`): before and
  after in one run;

with the wall time, the child's CPU time (user + system: on a shared machine the
wall time mostly measures the neighbours), its peak RSS (``VmHWM``) and its peak
anonymous memory (``RssAnon`` sampled from /proc: the file-backed pages of the
memory-mapped file are not counted), and that peak over ``--max-memory`` (256 MiB by
default): the target is a whole scan within 3x it, the torch floor included. The file
is written directly (header text
then one random block), so writing it costs neither the safetensors library's
per-tensor objects nor much memory. Machines are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.bench_scan import table

MIB = 1024 * 1024


def write_many(
    path: Path, count: int, elements: int, zeros: bool, prefixes: Sequence[str] = ("",)
) -> None:
    """``count`` float32 tensors of ``elements`` each (per prefix: ``h.`` and ``s.`` make
    the one-file form of ``compare``, ``count`` tensors per side).

    Short names keep a million entries under the format's 100 MB header limit.
    """
    nbytes = 4 * elements
    names = [f"{p}l.{i // 1000}.e.{i % 1000}" for p in prefixes for i in range(count)]
    count = len(names)
    entries = {
        name: {
            "dtype": "F32",
            "shape": [elements],
            "data_offsets": [i * nbytes, (i + 1) * nbytes],
        }
        for i, name in enumerate(names)
    }
    del names
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    del entries
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        rng = np.random.default_rng(0)
        total = count * elements
        step = 1 << 22
        for start in range(0, total, step):
            n = min(step, total - start)
            block = np.zeros(n, np.float32) if zeros else rng.standard_normal(n, np.float32)
            handle.write(block.tobytes())


def memory(pid: int) -> tuple[int, int]:
    """``(VmHWM, RssAnon)`` of a process in bytes (0 once it is gone)."""
    found = {"VmHWM:": 0, "RssAnon:": 0}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                key = line.split(maxsplit=1)[0] if line.strip() else ""
                if key in found:
                    found[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found["VmHWM:"], found["RssAnon:"]


#: ``--max-memory``'s default (MiB): a whole scan should stay within 3x it.
MAX_MEMORY_MIB = 256


def run(command: Sequence[str], timeout: float) -> dict[str, object]:
    """Wall time, exit code, peak RSS and peak RssAnon of one child process.

    The peak RSS is the child's own high-water mark (``VmHWM``, sampled until it
    exits), not ``ru_maxrss``: the child is started with ``vfork``, and Linux then
    counts the parent's high-water mark as the child's (the parent wrote the file).
    """
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_anon = peak_rss = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_anon, peak_rss
        while not done.is_set():
            high, anon = memory(process.pid)
            peak_rss, peak_anon = max(peak_rss, high), max(peak_anon, anon)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    timer.cancel()
    done.set()
    sampler.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.stderr is not None
    stderr = process.stderr.read().decode(errors="replace").strip().splitlines()
    return {
        "s": elapsed,
        "cpu s": usage.ru_utime + usage.ru_stime,
        "exit": process.returncode if elapsed < timeout else f"killed after {timeout:.0f} s",
        "peak RSS MiB": peak_rss / MIB,
        "peak RssAnon MiB": peak_anon / MIB,
        "× max-memory": peak_rss / MIB / MAX_MEMORY_MIB,
        "stderr": stderr[-1][:60] if stderr else "",
    }


def compare_steps(tmp: Path, args: argparse.Namespace) -> list[dict[str, object]]:
    """``gradaudit compare A B`` (``--count`` tensors each: A random, B all zeros, so every
    shared tensor is flagged and B's every tensor has a finding) in each format, then the
    one-file form (``--host-prefix h. --seed-prefix s.``, random, ``--count`` tensors in
    all: half per side) as a table and as JSON.
    """
    a, b, one = tmp / "a.safetensors", tmp / "b.safetensors", tmp / "prefixes.safetensors"
    write_many(a, args.count, args.elements, zeros=False)
    write_many(b, args.count, args.elements, zeros=True)
    # Half the count per prefix: two million entries would pass the format's 100 MB header.
    write_many(one, args.count // 2, args.elements, zeros=False, prefixes=("h.", "s."))
    gradaudit = [sys.executable, "-m", "gradaudit", "compare"]
    steps = [
        (f"compare A B --format {fmt}", [*gradaudit, str(a), str(b), "--format", fmt])
        for fmt in args.formats
    ]
    prefixes = [str(one), "--host-prefix", "h.", "--seed-prefix", "s."]
    steps += [
        (f"compare --host-prefix --format {fmt}", [*gradaudit, *prefixes, "--format", fmt])
        for fmt in ("table", "json")
    ]
    rows: list[dict[str, object]] = []
    size = a.stat().st_size + b.stat().st_size
    for label, command in steps:
        timed = run([*command, "--device", "cpu"], args.timeout)
        rows.append({"data": "compare", "MB": size / 1e6, "step": label, **timed})
        print(table(rows[-1:], 2).splitlines()[-1], flush=True)
    for path in (a, b, one):
        path.unlink()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1_000_000)
    parser.add_argument("--elements", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument(
        "--formats", nargs="+", default=["table", "json", "markdown", "github", "junit"]
    )
    parser.add_argument("--data", nargs="*", default=["random", "zeros"])
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--python-reader", action="store_true")
    parser.add_argument(
        "--torch-path", action="store_true", help="also each scan on the torch path"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also gradaudit compare: random vs all-zero files, and one file's two prefixes",
    )
    args = parser.parse_args(argv)
    rows: list[dict[str, object]] = []
    floor = run([sys.executable, "-c", "import torch"], args.timeout)
    rows.append({"data": "-", "MB": 0.0, "step": "import torch (floor)", **floor})
    print(table(rows, 2), flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for data in args.data:
            path = Path(tmp) / f"{data}.safetensors"
            write_many(path, args.count, args.elements, zeros=data == "zeros")
            size = path.stat().st_size
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            header = [
                sys.executable,
                "-c",
                "import sys; from gradaudit.io.safetensors_header import read_header; "
                "read_header(sys.argv[1])",
                str(path),
            ]
            steps: list[tuple[str, list[str]]] = [("read_header", header)]
            scan = ["scan", str(path), "--device", "cpu"]
            for fmt in args.formats:
                steps.append(
                    (
                        f"scan --format {fmt}",
                        [sys.executable, "-m", "gradaudit", *scan, "--format", fmt],
                    )
                )
            if args.torch_path:
                torch_path = (
                    "import sys; from gradaudit.scan import torch_free; "
                    "torch_free.applies = lambda **_: False; "
                    "from gradaudit.cli import run; sys.argv[0] = 'gradaudit'; run()"
                )
                for fmt in args.formats:
                    steps.append(
                        (
                            f"scan --format {fmt}, torch path",
                            [sys.executable, "-c", torch_path, *scan, "--format", fmt],
                        )
                    )
            if args.python_reader:
                python_reader = (
                    "import sys; import gradaudit.io.header_columns as h; h._NATIVE = None; "
                    "from gradaudit.cli import run; sys.argv[0] = 'gradaudit'; run()"
                )
                steps.append(
                    (
                        "scan --format table (Python header reader)",
                        [sys.executable, "-c", python_reader, *scan, "--format", "table"],
                    )
                )
            for label, command in steps:
                rows.append(
                    {"data": data, "MB": size / 1e6, "step": label, **run(command, args.timeout)}
                )
                print(table(rows[-1:], 2).splitlines()[-1], flush=True)
            path.unlink()
        if args.compare:
            rows += compare_steps(Path(tmp), args)
    print(f"\n{args.count} tensors of {args.elements} float32 elements each\n")
    print(table(rows, 2))


if __name__ == "__main__":
    main()
