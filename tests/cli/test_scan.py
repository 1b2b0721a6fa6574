"""The CLI through Typer's CliRunner: exit code, stdout and stderr asserted separately."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.engine import native
from tests.conftest import FIXTURES, GRADIENT_DUMP, WriteDump, runner


def scan(*args: str) -> Any:
    return runner.invoke(app, ["scan", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def strict_json(text: str) -> Any:
    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=reject)


def test_healthy_dump_exits_0(write_dump: WriteDump) -> None:
    path = write_dump({"a.weight": torch.randn(8, 4), "a.bias": torch.randn(4)})
    result = scan(str(path))
    assert result.exit_code == ExitCode.OK
    assert "a.weight" in result.stdout
    assert "OK: no failing findings" in result.stdout
    assert result.stderr == ""


def test_findings_exit_1_and_name_every_offender(write_dump: WriteDump) -> None:
    grads = {f"layer{i}.weight": torch.randn(16) for i in range(40)}
    grads["layer7.weight"][3] = math.nan
    grads["layer31.weight"][0] = -math.inf
    grads["layer12.weight"] *= 1e6
    result = scan(str(write_dump(grads)))
    assert result.exit_code == ExitCode.FINDINGS
    for name in ("layer7.weight", "layer31.weight", "layer12.weight"):
        assert name in result.stdout
    assert "FAIL" in result.stdout
    assert result.stderr == ""


def test_demo_fixture_names_nan_exploding_and_vanishing() -> None:
    result = scan(str(FIXTURES / "demo_grads.safetensors"), "--format", "json")
    assert result.exit_code == ExitCode.FINDINGS
    doc = strict_json(result.stdout)
    # Today's verdicts; the scale-free outlier check may add warnings beside them.
    flagged = {
        t["name"]: sorted(f["kind"] for f in t["findings"] if f["kind"] != "outlier")
        for t in doc["tensors"]
        if t["findings"]
    }
    assert flagged["head.weight"] == ["nan"]
    assert flagged["layers.1.fc2.weight"] == ["exploding"]
    assert flagged["layers.0.k.bias"] == ["vanishing"]
    outliers = [f for t in doc["tensors"] for f in t["findings"] if f["kind"] == "outlier"]
    assert all(f["severity"] == "warning" for f in outliers)
    assert doc["skipped"] == [
        {
            "name": "step",
            "file": str(FIXTURES / "demo_grads.safetensors"),
            "reason": "dtype int64 is not floating-point; not audited",
            "unaudited": False,  # an integer cannot hide a NaN: no finding
            "findings": [],
        }
    ]


def test_json_is_complete_and_strict(write_dump: WriteDump) -> None:
    path = write_dump(
        {
            "w": torch.tensor([3.0, 4.0, math.nan, math.inf, 0.0]),
            "all_nan": torch.full((2,), math.nan),
            "steps": torch.arange(3),
        }
    )
    result = scan(str(path), "--format", "json")
    assert result.exit_code == ExitCode.FINDINGS
    assert result.stderr == ""
    doc = strict_json(result.stdout)
    assert doc["schema_version"] == 2
    assert doc["exit_code"] == 1
    assert doc["device"] == "cpu"
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert w == {
        **w,
        "shape": [5],
        "dtype": "float32",
        "numel": 5,
        "nan": 1,
        "pos_inf": 1,
        "neg_inf": 0,
        "zeros": 1,
        "max_abs": 4.0,
        "norm": 5.0,
    }
    assert w["rms"] == pytest.approx(5.0 / math.sqrt(3))
    assert {f["kind"] for f in w["findings"]} == {"nan", "inf"}
    all_nan = next(t for t in doc["tensors"] if t["name"] == "all_nan")
    assert all_nan["rms"] is None
    assert doc["skipped"][0]["name"] == "steps"
    assert doc["summary"]["global_norm"] == 5.0
    assert doc["summary"]["nan_tensors"] == 2
    assert doc["files"][0]["path"] == str(path)


def test_json_encodes_non_finite_numbers_as_strings(write_dump: WriteDump) -> None:
    # Two float64 values near the top of the range: the true norm exceeds float64.
    path = write_dump({"huge": torch.tensor([1.7e308, 1.7e308], dtype=torch.float64)})
    result = scan(str(path), "--format", "json", "--fail-on", "none")
    doc = strict_json(result.stdout)
    assert doc["tensors"][0]["norm"] == "Infinity"
    assert result.exit_code == ExitCode.OK


def test_thresholds_and_fail_on_change_the_verdict(write_dump: WriteDump) -> None:
    path = write_dump({"w": torch.full((4,), 1e-9)}, metadata=GRADIENT_DUMP)
    assert scan(str(path)).exit_code == ExitCode.OK
    assert scan(str(path), "--fail-on", "vanishing").exit_code == ExitCode.FINDINGS
    assert scan(str(path), "--vanishing-threshold", "1e-12").exit_code == ExitCode.OK
    loud = write_dump({"w": torch.full((4,), 10.0)}, "loud.safetensors", GRADIENT_DUMP)
    assert scan(str(loud)).exit_code == ExitCode.OK
    assert scan(str(loud), "--exploding-threshold", "5").exit_code == ExitCode.FINDINGS
    assert scan(str(loud), "--exploding-threshold", "5", "--fail-on", "none").exit_code == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--fail-on", "bogus"],
        ["--vanishing-threshold", "10", "--exploding-threshold", "1"],
        ["--device", "tpu"],
        ["--device", "meta"],
        ["--format", "xml"],
        ["--nonsense"],
    ],
)
def test_usage_errors_exit_2(write_dump: WriteDump, args: list[str]) -> None:
    path = write_dump({"w": torch.ones(2)})
    result = scan(str(path), *args)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_usage_error_not_a_silent_cpu_run(write_dump: WriteDump) -> None:
    result = scan(str(write_dump({"w": torch.ones(2)})), "--device", "cuda:0")
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "CUDA is not available" in result.stderr


def test_missing_file_exits_3_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    result = scan(str(missing))
    assert result.exit_code == ExitCode.INPUT_ERROR
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(missing) in lines[0]
    assert "Traceback" not in result.stderr


def test_bad_file_does_not_hide_the_good_ones(write_dump: WriteDump, tmp_path: Path) -> None:
    good = write_dump({"w": torch.tensor([math.nan, 1.0])})
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(good.read_bytes()[:-3])
    result = scan(str(corrupt), str(good), "--format", "json")
    assert result.exit_code == ExitCode.INPUT_ERROR  # errors beat findings
    doc = strict_json(result.stdout)
    assert [t["name"] for t in doc["tensors"]] == ["w"]
    assert doc["tensors"][0]["nan"] == 1
    assert doc["errors"][0]["file"] == str(corrupt)
    assert str(corrupt) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_input_files_are_never_modified(write_dump: WriteDump) -> None:
    path = write_dump({"w": torch.tensor([math.nan, 1.0])})
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    scan(str(path))
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == mtime


def test_nothing_to_audit_exits_3(write_dump: WriteDump) -> None:
    path = write_dump({"step": torch.tensor(3), "ids": torch.arange(4)})
    result = scan(str(path))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "nothing to audit" in result.stderr


def test_int_only_file_is_fine_when_others_were_audited(write_dump: WriteDump) -> None:
    ints = write_dump({"step": torch.tensor(3)}, "ints.safetensors")
    floats = write_dump({"w": torch.ones(3)}, "floats.safetensors")
    assert scan(str(ints), str(floats)).exit_code == ExitCode.OK


def test_internal_error_exits_4_with_a_hint(
    write_dump: WriteDump, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug")

    # scan imports the core when it runs; patch where it looks the function up
    monkeypatch.setattr(importlib.import_module("gradaudit.scan.paths"), "scan_paths", boom)
    monkeypatch.setattr(
        importlib.import_module("gradaudit.scan.torch_free"), "scan_torch_free", boom
    )
    result = scan(str(write_dump({"w": torch.ones(2)})))
    assert result.exit_code == ExitCode.INTERNAL_ERROR
    assert "internal error" in result.stderr
    assert "--debug" in result.stderr
    assert "Traceback" not in result.stderr
    debug = scan(str(write_dump({"w": torch.ones(2)})), "--debug")
    assert debug.exit_code == ExitCode.INTERNAL_ERROR
    assert "Traceback" in debug.stderr


def test_hostile_names_are_printed_literally(write_dump: WriteDump) -> None:
    names = ["markup[/bold]", "[red]x[/red]", "esc\x1b[31mred", "bidi\u202egnp.exe"]
    path = write_dump({name: torch.full((2,), math.nan) for name in names})
    result = scan(str(path), "--all")
    assert result.exit_code == ExitCode.FINDINGS
    assert "markup[/bold]" in result.stdout
    assert "[red]x[/red]" in result.stdout
    assert "\x1b" not in result.stdout
    assert "esc\\x1b[31mred" in result.stdout
    assert "\u202e" not in result.stdout
    assert "bidi\\u202egnp.exe" in result.stdout


def test_all_shows_every_row_and_default_shows_flagged_plus_top(write_dump: WriteDump) -> None:
    grads = {f"p{i:02d}": torch.full((4,), float(i + 1)) for i in range(30)}
    grads["p00"][0] = math.nan
    path = write_dump(grads)
    default = scan(str(path), "--top", "3")
    shown = [f"p{i:02d}" for i in range(30) if f"p{i:02d} " in default.stdout]
    assert shown == ["p00", "p27", "p28", "p29"]
    assert "26 more tensors not shown" in default.stdout
    everything = scan(str(path), "--all")
    assert all(f"p{i:02d} " in everything.stdout for i in range(30))


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.startswith("gradaudit ")


def test_help_documents_exit_codes() -> None:
    result = runner.invoke(app, ["scan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for code in ("0 audited", "1 failing findings", "2 usage error", "3 an input", "4 internal"):
        assert code in text


def test_forced_progress_keeps_stdout_pure_json(write_dump: WriteDump) -> None:
    result = scan(str(write_dump({"w": torch.ones(3)})), "--progress", "--format", "json")
    assert result.exit_code == ExitCode.OK
    assert strict_json(result.stdout)["summary"]["tensors"] == 1


def test_engine_option_is_reported(write_dump: WriteDump) -> None:
    result = scan(str(write_dump({"w": torch.ones(3)})), "--engine", "eager", "--format", "json")
    assert strict_json(result.stdout)["engine"] == "eager"
    assert scan(str(write_dump({"w": torch.ones(3)})), "--engine", "turbo").exit_code == 2


def test_auto_engine_is_native_on_the_cpu_where_built(write_dump: WriteDump) -> None:
    result = scan(str(write_dump({"w": torch.ones(3)})), "--format", "json")
    assert strict_json(result.stdout)["engine"] == ("native" if native.available() else "eager")


def test_without_the_native_build_auto_is_eager_and_native_is_a_usage_error(
    write_dump: WriteDump, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gradaudit.engine.native_rows._module", None)
    path = str(write_dump({"w": torch.ones(3)}))
    result = scan(path, "--format", "json")
    assert result.exit_code == ExitCode.OK
    assert strict_json(result.stdout)["engine"] == "eager"
    refused = scan(path, "--engine", "native")
    assert refused.exit_code == ExitCode.USAGE_ERROR
    assert refused.stderr.startswith("gradaudit: error: the native kernel is not built")
    assert "Traceback" not in refused.stderr
