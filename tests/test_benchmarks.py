"""The GPU benchmark script runs (on the CPU here, as a smoke run) and prints its table."""

from __future__ import annotations

import pytest

from benchmarks import bench_gpu
from gradaudit import native


def test_gpu_benchmark_smoke_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    bench_gpu.main(
        ["--gib", "0.01", "--device", "cpu", "--repeats", "1", "--tiny", "20", "--warm-cache"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[:4] == ["workload", "tensors", "MiB", "engine"]
    rows = [line.split(" | ") for line in lines[2:] if " | " in line]
    assert {row[0] for row in rows} == {
        "transformer-float32",
        "transformer-bfloat16",
        "transformer-float16",
        "20-tiny",
    }
    assert {row[3] for row in rows} == {"native" if native.available() else "eager", "eager"}
    assert all(float(row[5]) > 0 for row in rows)


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


def test_precision_benchmark_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_precision

    bench_precision.main(["--mib", "0.01", "--repeats", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[-1] == "histogram × sum"
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["float32", "bfloat16", "float16"]
