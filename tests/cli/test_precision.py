"""``scan --precision``: the headroom table, its findings in the exit code, and its figure."""

from __future__ import annotations

import json
import re
import shlex
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode, scan_paths
from gradaudit.cli import app
from gradaudit.precision.formats import Precision
from gradaudit.precision.judging import precision_report
from tests.conftest import FIXTURES, WriteDump, runner

LONG = "model.encoder.layers.11.self_attention.query_key_value.weight"


def scan(*args: str) -> Any:
    return runner.invoke(app, ["scan", *args], env={"COLUMNS": "80", "NO_COLOR": "1"})


def _dump(write_dump: WriteDump, tiny: float) -> Path:
    torch.manual_seed(0)
    return write_dump(
        {
            LONG: torch.randn(64, 64) * 1e-2,
            "head.weight": torch.cat([torch.randn(90) * 1e-2, torch.full((10,), tiny)]),
        }
    )


def test_underflow_fails_the_run_and_names_the_tensor(write_dump: WriteDump) -> None:
    result = scan(str(_dump(write_dump, 1e-9)), "--precision", "fp16")
    assert result.exit_code == ExitCode.FINDINGS
    assert "Headroom in fp16" in result.stdout
    assert "underflow: head.weight: 10.0% of 100 non-zero values flush" in result.stdout
    assert "(all tensors)" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()[-8:-1]) <= 80
    assert result.stderr == ""


def test_headroom_findings_wrap_at_the_terminal_width(write_dump: WriteDump) -> None:
    """A finding on a long name is two lines at 80 columns, not one of ~130."""
    torch.manual_seed(0)
    path = write_dump({LONG: torch.randn(64, 64) * 1e-9, "head.weight": torch.randn(8)})
    result = scan(str(path), "--precision", "fp16")
    headroom = result.stdout[result.stdout.index("Headroom in fp16") :].splitlines()
    assert any(line.startswith(f"underflow: {LONG}:") for line in headroom)
    assert max(len(line) for line in headroom) <= 80


def test_fraction_is_configurable_and_bf16_has_room(write_dump: WriteDump) -> None:
    path = str(_dump(write_dump, 1e-9))
    assert scan(path, "--precision", "fp16", "--max-underflow", "0.2").exit_code == ExitCode.OK
    result = scan(path, "--precision", "bf16")
    assert result.exit_code == ExitCode.OK
    assert "no tensor loses more than 0.01" in result.stdout


def test_overflow_in_fp8(write_dump: WriteDump) -> None:
    path = write_dump({"w": torch.tensor([1.0, 500.0, 1e5])})
    result = scan(str(path), "--precision", "fp8_e4m3fn")
    assert result.exit_code == ExitCode.FINDINGS
    assert "2 values overflow fp8_e4m3fn (saturates to ±448); scale by 2**-8" in result.stdout


def test_json_carries_the_headroom_and_its_findings(write_dump: WriteDump, tmp_path: Path) -> None:
    path = _dump(write_dump, 1e-9)
    out = tmp_path / "report.json"
    result = scan(str(path), "--precision", "fp16", "--format", "json", "--output", str(out))
    assert result.exit_code == ExitCode.FINDINGS
    assert result.stdout == ""
    document = json.loads(out.read_text())
    headroom = document["headroom"]
    expected = precision_report(scan_paths([path], histograms=True), Precision.FP16)
    assert headroom["precision"] == "fp16"
    assert headroom["format"]["overflow_from"] == 65520.0
    by_name = {row["name"]: row for row in headroom["tensors"]}
    for row in expected.tensors:
        got = by_name[row.name]
        assert (got["nonzero"], got["flushed"], got["subnormal"], got["overflowed"]) == (
            row.nonzero,
            row.flushed,
            row.subnormal,
            row.overflowed,
        )
    assert by_name["head.weight"]["flushed"] == 10
    assert headroom["total"]["nonzero"] == expected.total.nonzero == 64 * 64 + 100
    exponents = {e["exponent"]: e["count"] for e in headroom["histogram"]["exponents"]}
    assert exponents == expected.histogram.exponents()
    assert [(f["kind"], f["tensor"]) for f in headroom["findings"]] == [
        ("underflow", "head.weight")
    ]
    # The same finding counts in the verdict, as in the table format.
    assert document["exit_code"] == ExitCode.FINDINGS
    assert any(f["kind"] == "cast" for t in document["tensors"] for f in t["findings"])


def test_json_without_precision_has_no_headroom_key(write_dump: WriteDump) -> None:
    result = scan(str(_dump(write_dump, 1e-3)), "--format", "json")
    assert "headroom" not in json.loads(result.stdout)


@pytest.mark.parametrize(
    ("fmt", "shown", "finding"),
    [
        (
            "markdown",
            "| ❌ `head.weight` | 100 | 10.0% |",
            "- ❌ `head.weight`: underflow: 10.0% of 100 non-zero values flush",
        ),
        (
            "github",
            "::notice title=gradaudit%3A headroom in fp16::(all tensors): 4,196 non-zero",
            "title=gradaudit%3A cast in head.weight::head.weight: fp16 headroom: 10.0%25 of 100",
        ),
        (
            "junit",
            "fp16 headroom of this file: 4,196 non-zero values: 0.2% flush to zero",
            '<failure type="cast" message="cast: 1 failing finding">head.weight: fp16 headroom',
        ),
    ],
)
def test_every_format_carries_the_headroom(
    write_dump: WriteDump, tmp_path: Path, fmt: str, shown: str, finding: str
) -> None:
    """Once a usage error (exit 2): each format now shows the headroom, and its findings
    fail the run as in the table format; ``--output`` takes the whole report."""
    path = str(_dump(write_dump, 1e-9))
    result = scan(path, "--precision", "fp16", "--format", fmt)
    assert result.exit_code == ExitCode.FINDINGS
    assert shown in result.stdout
    assert finding in result.stdout
    assert result.stderr == ""
    target = tmp_path / f"report.{fmt}"
    written = scan(path, "--precision", "fp16", "--format", fmt, "--output", str(target))
    assert written.exit_code == ExitCode.FINDINGS
    assert written.stdout == ""
    assert shown in target.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--output", "out.txt"], "leave out --output (or use --format json, markdown"),
        (["--precision", "fp32"], "fp32"),
    ],
)
def test_usage_errors(write_dump: WriteDump, extra: list[str], message: str) -> None:
    path = str(_dump(write_dump, 1e-3))
    args = ["--precision", "fp16", *extra] if extra[0] != "--precision" else extra
    result = scan(path, *args)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert message in result.stderr
    assert result.stdout == ""


def test_errors_beat_precision_findings(write_dump: WriteDump, tmp_path: Path) -> None:
    result = scan(str(_dump(write_dump, 1e-9)), str(tmp_path / "missing.pt"), "--precision", "fp16")
    assert result.exit_code == ExitCode.INPUT_ERROR


def test_plot_is_the_headroom_figure(write_dump: WriteDump, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "headroom.png"
    result = scan(str(_dump(write_dump, 1e-9)), "--precision", "fp16", "--plot", str(target))
    assert result.exit_code == ExitCode.FINDINGS
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1200, 600)
    again = tmp_path / "again.png"
    scan(str(_dump(write_dump, 1e-9)), "--precision", "fp16", "--plot", str(again))
    assert again.read_bytes() == data  # deterministic


def test_library_report_layers_and_total() -> None:
    report = scan_paths([FIXTURES / "healthy_grads.safetensors"], histograms=True)
    headroom = precision_report(report, Precision.FP16)
    assert len(headroom.tensors) == len(report.tensors)
    assert headroom.total.nonzero == sum(t.numel - t.zeros for t in report.tensors)
    assert sum(layer.nonzero for layer in headroom.layers) == headroom.total.nonzero
    assert headroom.total.scale_log2 is not None
    plain = scan_paths([FIXTURES / "healthy_grads.safetensors"])
    assert plain.histograms == ()
    with pytest.raises(ValueError, match="without exponent histograms"):
        precision_report(plain, Precision.FP16)


def test_the_printed_verdict_is_the_exit_code_with_headroom_findings(
    write_dump: WriteDump,
) -> None:
    """With only an overflow finding it printed "OK: no failing findings" and exited 1."""
    path = write_dump({"w": torch.tensor([1.0, 500.0, 1e5])})
    result = scan(str(path), "--precision", "fp16", "--exploding-threshold", "1e9")
    assert result.exit_code == ExitCode.FINDINGS
    assert "OK:" not in result.stdout
    assert "FAIL: 1 failing finding (cast)" in result.stdout
    assert "│ cast " in result.stdout  # the tensor's status in the report's table
    ignored = scan(
        str(path), "--precision", "fp16", "--exploding-threshold", "1e9", "--ignore", "w"
    )
    assert ignored.exit_code == ExitCode.OK
    assert "OK: no failing findings" in ignored.stdout


def _documented_runs() -> list[tuple[str, str]]:
    """``(command, output)`` of each ``console`` example in docs/precision.md that names a
    machine format: those outputs hold no timing, so they are compared as printed."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "precision.md").read_text("utf-8")
    runs = []
    for body in re.findall(r"```console\n(.*?)```", page, flags=re.S):
        command, _, output = body.partition("\n")
        if "--format" in command:
            runs.append((command.removeprefix("$ "), output))
    return runs


@pytest.mark.parametrize(("command", "output"), _documented_runs())
def test_documented_format_examples_print_what_the_page_says(
    command: str, output: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(FIXTURES.parent)
    args = shlex.split(command)
    assert args[:2] == ["gradaudit", "scan"]
    result = scan(*args[2:])
    assert result.stdout == output


def test_the_page_has_a_format_example() -> None:
    assert _documented_runs()
