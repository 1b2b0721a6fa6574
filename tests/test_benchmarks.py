"""The GPU benchmark script runs (on the CPU here, as a smoke run) and prints its table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_gpu, gpu_check
from gradaudit.engine import native

ROOT = Path(__file__).resolve().parent.parent

#: Slow (not in the quick loop): every benchmark script run end to end at smoke size.
pytestmark = pytest.mark.slow


def test_gpu_benchmark_smoke_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    bench_gpu.main(
        ["--gib", "0.01", "--device", "cpu", "--repeats", "1", "--tiny", "20", "--warm-cache"]
    )
    engines, host_cost = capsys.readouterr().out.split("\n\n")[:2]
    lines = engines.splitlines()
    assert lines[0].split(" | ")[:4] == ["workload", "tensors", "MiB", "engine"]
    rows = [line.split(" | ") for line in lines[2:] if " | " in line]
    assert {row[0] for row in rows} == {
        "transformer-float32",
        "transformer-bfloat16",
        "transformer-float16",
        "20-tiny",
    }
    assert {row[3] for row in rows} == {"native" if native.available() else "eager", "eager"}
    # Throughputs are printed to 2 decimals: a slow, loaded machine may print 0.00.
    assert all(float(row[5]) >= 0 for row in rows)
    # The host cost per flush of the Triton path, with no-op kernels on the CPU.
    lines = host_cost.splitlines()
    assert lines[0].split(" | ")[:7] == [
        "workload",
        "tensors",
        "MiB",
        "kernels",
        "path",
        "queue ms",
        "launch ms",
    ]
    costs = [line.split(" | ") for line in lines[2:]]
    assert [(row[0], row[1], row[3], row[4]) for row in costs] == [
        (workload, count, "no-op", path)
        for workload, count in [
            ("transformer-float32", "10"),
            ("transformer-bfloat16", "10"),
            ("20-tiny", "20"),
        ]
        for path in ("per-tensor", "planned", "planned, binding")
    ]
    assert all(float(row[5]) > 0 and float(row[6]) > 0 for row in costs)


def test_gpu_benchmark_refuses_cuda_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device here"):
        bench_gpu.main(["--device", "cuda"])


def test_dcp_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Two gloo ranks save a tiny DCP checkpoint; the scan row is printed."""
    from benchmarks import bench_dcp

    bench_dcp.main(["--gib", "0.01", "--ranks", "2", "--split", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[:3] == ["ranks", "tensors", "MiB"]
    row = lines[2].split(" | ")
    assert row[0] == "2"
    assert int(row[1]) == 10  # one transformer layer
    assert float(row[4]) > 0
    split = [line.split(" | ") for line in lines[4:] if " | " in line]
    assert split[0] == ["scan ranks", "scan s", "× first"]
    assert [r[0] for r in split[2:]] == ["2"]
    assert split[2][2] == "1.00"


def test_peers_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Every workload and peer runs on the same tensors; start-up rows come back timed."""
    from benchmarks import bench_peers

    bench_peers.main(["--smoke", "--repeats", "1"])
    out = capsys.readouterr().out
    blocks = {block.split(" ", 1)[0]: block for block in out.split("\n\n")}
    peers, startup = blocks["workload"], blocks["start-up"]
    assert "fp32 in-memory audit:" in blocks["fp32"]
    lines = peers.splitlines()
    assert lines[0].split(" | ") == [
        "workload",
        "tensors",
        "MiB",
        "sum ms",
        "typical ×sum",
        "torch ×sum",
        "audit ×sum",
        "scan ×sum",
        "scan faults",
    ]
    rows = {line.split(" | ")[0]: line.split(" | ") for line in lines[2:]}
    assert set(rows) == {
        "transformer-float32",
        "transformer-bfloat16",
        "50-tiny",
        "200-tiny",
        "lora-like",
        "moe-like",
    }
    for row in rows.values():
        assert all(float(row[column]) >= 0 for column in (4, 6, 7))  # numbers, not "-"
        assert int(row[8]) >= 0  # page faults per scan: a count
    assert float(rows["transformer-float32"][5]) >= 0  # torch's built-ins take float32
    timed = {line.split(" | ")[0]: line.split(" | ") for line in startup.splitlines()[2:]}
    assert "gradaudit --version" in timed
    assert "gradaudit scan, torch path (same dump)" in timed
    assert all(float(row[1]) >= 0 for row in timed.values())


def test_peers_benchmark_runs_only_the_workloads_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import bench_peers

    bench_peers.main(
        ["--smoke", "--repeats", "1", "--no-startup", "--workloads", "moe-like", "50-tiny"]
    )
    out = capsys.readouterr().out
    peers = next(block for block in out.split("\n\n") if block.startswith("workload"))
    # In the table's order, not the order named; no fp32 row, so no fp32 budget line.
    assert [line.split(" | ")[0] for line in peers.splitlines()[2:]] == ["50-tiny", "moe-like"]
    assert "fp32 in-memory audit" not in out
    assert "targets: in memory" in out
    with pytest.raises(SystemExit, match="no such workload nope"):
        bench_peers.main(["--smoke", "--workloads", "nope"])
    with pytest.raises(SystemExit, match="--check judges transformer-float32"):
        bench_peers.main(["--smoke", "--check", "--workloads", "moe-like"])


def test_peers_benchmark_pairs_each_ratio_with_the_sum_pass_before_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--paired: each round times the sum pass, then audit, then the sum pass, then scan;
    the columns are the medians of those ratios, judged against the same targets."""
    from benchmarks import bench_peers

    ticks = iter(range(10**6))
    clock = lambda: float(next(ticks))  # noqa: E731  # every interval is 1: ratios of 1.0
    calls: list[str] = []
    sum_pass, audit = calls.append, calls.append
    medians = bench_peers.paired_ratios(
        3, lambda: sum_pass("sum"), {"audit": lambda: audit("audit")}, clock
    )
    assert medians == {"audit": 1.0}
    assert calls == ["sum", "audit"] * 3
    slow = iter([0.0, 1.0, 1.0, 3.0, 3.0, 4.0, 4.0, 9.0, 9.0, 10.0, 10.0, 12.0])
    assert bench_peers.paired_ratios(3, lambda: None, {"a": lambda: None}, lambda: next(slow)) == {
        "a": 2.0  # ratios 2, 5, 2: the median
    }

    bench_peers.main(
        ["--smoke", "--repeats", "1", "--no-startup", "--paired", "2", "--workloads", "50-tiny"]
    )
    out = capsys.readouterr().out
    peers = next(block for block in out.split("\n\n") if block.startswith("workload"))
    header, _, row = peers.splitlines()[:3]
    values = dict(zip(header.split(" | "), row.split(" | "), strict=True))
    assert float(values["audit paired"]) > 0
    assert float(values["scan paired"]) > 0
    assert "paired medians: in memory ≤ 1.1×, from a file ≤ 1.3×" in out


def test_peers_benchmark_names_the_machine_and_the_forced_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Figures from two machines or two kernel paths must never be confused: both are
    printed, first and last; a forced path is put back afterwards."""
    from benchmarks import bench_peers

    if not native.available():
        pytest.skip("the native kernel is not built")
    before = native.path()
    bench_peers.main(["--smoke", "--repeats", "1", "--no-scan", "--no-startup", "--isa=portable"])
    out = capsys.readouterr().out
    first, last = out.splitlines()[0], out.splitlines()[-1]
    assert first == f"CPU: {bench_peers.cpu_model()}; native kernel path: portable"
    assert "(path portable)" in last
    assert last.endswith(bench_peers.cpu_model())
    assert "targets: in memory ≤ 1.1×, from a file ≤ 1.3×" in out
    assert native.path() == before


def test_peers_benchmark_refuses_a_path_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_peers

    if not native.available():
        pytest.skip("the native kernel is not built")
    monkeypatch.setattr(native, "paths", lambda: ("portable",))
    with pytest.raises(SystemExit, match="no such path"):
        bench_peers.main(["--smoke", "--isa", "avx512", "--no-scan", "--no-startup"])


def test_typical_script_and_torch_builtins_agree_with_audit() -> None:
    """The peers measure the same thing: the same NaN/Inf verdict and global norm."""
    import math

    from benchmarks import bench_peers
    from gradaudit import audit

    tensors = bench_peers.lora_like(adapters=1, layers=1)
    tensors["base_model.model.layers.0.q_proj.lora_A.adapter0.weight"][0, 3] = math.inf
    typical = bench_peers.typical_script(tensors)
    total, found_inf = bench_peers.torch_builtins(tensors)
    report = audit(tensors)
    assert found_inf == 1.0
    assert [name for name, (nan, inf, _) in typical.items() if nan or inf] == [
        stats.name for stats in report.tensors if stats.nonfinite
    ]
    assert math.isinf(total)  # torch's total norm includes the Inf; gradaudit's skips it
    finite = {name: t.double().nan_to_num(posinf=0.0) for name, t in tensors.items()}
    expected = math.sqrt(sum(float(t.square().sum()) for t in finite.values()))
    assert math.isclose(report.summary.global_norm, expected, rel_tol=1e-12)


def test_precision_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_precision

    bench_precision.main(["--mib", "0.01", "--repeats", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[-2:] == ["row + histogram × sum", "histogram alone × sum"]
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["float32", "bfloat16", "float16"]


def test_ranks_benchmark_smoke_run(capfd: pytest.CaptureFixture[str]) -> None:
    """Two gloo ranks; rank 0 prints the three monitors' row (its stdout is this process's)."""
    from benchmarks import bench_ranks

    bench_ranks.main(["--tensors", "4", "--width", "8", "--repeats", "2"])
    lines = capfd.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines[2:5]] == [
        "group=, precision=None",
        "group=, precision=fp16",
        "precision=fp16, no group",
    ]
    assert lines[2].endswith(" | 1.00")
    assert lines[5].startswith("CPU: ")


def test_precision_benchmark_times_calls_back_to_back(capsys: pytest.CaptureFixture[str]) -> None:
    """``--calls``: the same table, each figure per call of a run of them."""
    from benchmarks import bench_precision

    bench_precision.main(["--mib", "0.01", "--repeats", "1", "--threads", "1", "--calls", "3"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:5]]
    assert [row[0] for row in rows] == ["float32", "bfloat16", "float16"]
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)


def test_roles_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_roles

    bench_roles.main(["--models", "4", "--seeds", "1", "--hidden", "48", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(
        "guess from values, 4 random stacks: gradient files read as weights 0/4"
    )
    assert [line.split(" | ")[0] for line in lines[2:4]] == ["weights", "gradients"]
    assert lines[4].startswith("checkpoint of ")


def test_many_tensors_benchmark_smoke_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every step of a 3,000-tensor file runs to exit 0, the pure-Python header reader too."""
    from benchmarks import bench_many

    options = ["--formats", "table", "--data", "zeros", "--python-reader"]
    bench_many.main(["--count", "3000", *options, "--dir", str(tmp_path)])
    final = capsys.readouterr().out.split("each\n\n")[-1]
    rows = [line.split(" | ") for line in final.splitlines()[2:]]
    assert [row[2] for row in rows] == [
        "import torch (floor)",
        "read_header",
        "scan --format table",
        "scan --format table (Python header reader)",
    ]
    assert [row[5] for row in rows] == ["0"] * 4  # vanishing is a warning by default
    assert all(float(row[6]) > 0 for row in rows)


def test_the_gpu_check_dry_run_runs_every_step_within_outs_limits(tmp_path: Path) -> None:
    """``GA_DRY_RUN=1 bash benchmarks/gpu_check.sh``: every step's logic on the CPU (Triton
    interpreted, tiny sizes, tests collected only); $OUT as the lending machine sends it back."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "GA_DRY_RUN": "1"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (out / "summary.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# gradaudit GPU check (DRY RUN")
    assert re.search(r", tree [0-9a-f]{12}$", lines[0]), lines[0]
    steps = {
        line.split()[1]: line.split()[0] for line in lines if not line.startswith(("#", "total"))
    }
    assert list(steps) == [step.name for step in gpu_check.STEPS]
    assert steps["install"] == "SKIP"  # the dry run says what it would install
    assert steps["sanitizer"] in ("SKIP", "PASS")
    assert {status for name, status in steps.items() if name not in ("install", "sanitizer")} == {
        "PASS"
    }
    assert lines[-1].startswith("total ")
    assert " 0 fail, 0 timeout" in lines[-1]
    summary = "\n".join(lines)
    assert "4 probes (offsets, longest_span, beyond_2_31, fp32_sums): 0 wrong" in summary
    assert "12 workloads" in summary
    assert "auto -> eager" in summary
    assert "tests collected" in summary
    # The lending machine's limits on what comes back: at most 8 files, no more than two
    # folders down, plain names.
    files = [path for path in out.rglob("*") if path.is_file()]
    assert 0 < len(files) <= 8
    assert all(len(path.relative_to(out).parts) <= 3 for path in files)
    assert all(
        re.fullmatch(r"[A-Za-z0-9._-]+", part)
        for path in files
        for part in path.relative_to(out).parts
    )
    bench = (out / "bench.txt").read_text(encoding="utf-8")
    assert bench.count("| yes") == 12  # one bandwidth row per layout and dtype
    assert bench.count("| agree") == 6  # the histogram's two ways, per dtype and data
    assert "histogram x sum: float32" in summary
    # Each launch variant's rows checked against the reference, per layout measured.
    assert "best launch over the shipped one: 7B-like 8 layers bfloat16" in summary
    assert bench.count(", 3 stages: ") == 6


def test_the_gpu_checks_tree_id_is_the_files_not_the_checkouts_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary's ``tree``: git's id of the files as sent, equal to the tree of the commit
    they are, even where the checkout's ``.git`` still names an older commit (a lent
    machine's copy), and different once a file differs."""

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("commit", "-qm", "one")
    old_head = git("rev-parse", "HEAD")
    (tmp_path / "a.txt").write_text("two\n")
    (tmp_path / "b.txt").write_text("new\n")
    git("add", "--all")
    git("commit", "-qm", "two")
    files_tree = git("rev-parse", "HEAD^{tree}")
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    assert gpu_check.tree() == files_tree[:12]
    git("reset", "-q", "--soft", old_head)  # .git names the older commit; the files are "two"
    assert gpu_check.tree() == files_tree[:12]
    assert gpu_check.commit().endswith("-dirty")
    (tmp_path / "b.txt").write_text("changed\n")
    assert gpu_check.tree() not in (files_tree[:12], "unknown")


def test_force_engine_pins_auto_except_for_tests_of_autos_own_choice(tmp_path: Path) -> None:
    (tmp_path / "test_demo.py").write_text(
        "import torch\n"
        "from gradaudit.engine import triton_kernel\n"
        "def test_forced():\n"
        "    assert triton_kernel.compile_worth(torch.device('cuda')) is False\n"
        "def test_auto_chooses():\n"
        "    assert triton_kernel.compile_worth.__name__ == 'compile_worth'\n",
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GA_CHECK_ENGINE": "eager"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "benchmarks.force_engine", "-o", "addopts=", str(tmp_path)]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout
    assert "figure: auto -> eager in 1 tests, 0 Triton flushes" in done.stdout
    done = subprocess.run(
        command,
        env={**env, "GA_CHECK_ENGINE": "compiled"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 4
    assert "GA_CHECK_ENGINE=compiled" in done.stderr


def test_monitor_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The table against a bare norm names the CPU, the kernel path and the load, one row
    per model."""
    from benchmarks import bench_monitor, bench_peers

    bench_monitor.main(["--steps", "2", "--repeats", "4", "--ratio-only"])
    lines = capsys.readouterr().out.splitlines()
    path = native.path() if native.available() else "not built (eager engine)"
    assert lines[0].startswith(f"CPU: {bench_peers.cpu_model()}; native kernel path: {path};")
    assert "load average" in lines[0]
    rows = [line.split(" | ") for line in lines[3:]]
    assert [(row[0], row[1]) for row in rows] == [("40", "0.73"), ("400", "7.07")]
    assert all(float(row[4]) > 0 and float(row[6]) > 0 for row in rows)


def test_monitor_benchmark_times_precision_against_the_same_monitors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--precision``: two more columns per mode, the monitor with it against without."""
    from benchmarks import bench_monitor

    bench_monitor.main(["--repeats", "4", "--ratio-only", "--precision", "fp16"])
    lines = capsys.readouterr().out.splitlines()
    assert "sync=True, precision=fp16 ms (IQR) | × without" in lines[1]
    rows = [line.split(" | ") for line in lines[3:]]
    assert [len(row) for row in rows] == [11, 11]
    assert all(float(row[8]) > 0 and float(row[10]) > 0 for row in rows)


def test_startup_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_startup

    bench_startup.main(["--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "load average" in lines[0]
    rows = dict(line.split(" | ", 1) for line in lines[3:])
    assert set(rows) == set(
        bench_startup.commands(dict.fromkeys(("small", "small2", "steps"), Path("x")))
    )
    assert all(float(value) > 0 for row in rows.values() for value in row.split(" | "))


def test_precision_benchmark_times_another_build_beside_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks import bench_precision
    from gradaudit.engine import native_rows

    module = native_rows.module()
    if module is None:
        pytest.skip("the native kernel is not built")
    argv = ["--mib", "0.01", "--repeats", "1", "--threads", "1", "--clock", "cpu"]
    bench_precision.main([*argv, "--baseline", str(module.__file__)])
    lines = capsys.readouterr().out.splitlines()
    # This build and the other by the same raw call: like with like.
    assert lines[0].split(" | ")[-2:] == ["this build's call × sum", "baseline build's call × sum"]
    assert "cpu time" in lines[-1]
