"""``gradaudit compare`` as a CI gate: shared settings, [tool.gradaudit.compare], output, pipes."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import GRADIENT_DUMP, WriteDump, runner

REPO = Path(__file__).resolve().parents[2]


def run(command: str, *args: str, **env: str) -> Any:
    return runner.invoke(app, [command, *args], env={"COLUMNS": "120", "NO_COLOR": "1", **env})


def compare(*args: str, **env: str) -> Any:
    return run("compare", *args, **env)


def configure(project: Path, text: str) -> None:
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "demo"\n\n{text}\n', encoding="utf-8"
    )


@pytest.fixture
def grafted(write_dump: WriteDump) -> Path:
    """One dump split by host./seed.: host norm 8 over 68 elements, seed norm 12 over 20;
    vanishing key biases on both sides; a shared ``w`` whose norm grows 3×."""
    return write_dump(
        {
            "host.embed": torch.ones(48),
            "host.w": torch.ones(16),
            "host.attn.k.bias": torch.zeros(4),
            "seed.w": torch.full((16,), 3.0),
            "seed.attn.k.bias": torch.zeros(4),
        },
        "grafted.safetensors",
        GRADIENT_DUMP,
    )


SPLIT = ("--host-prefix", "host.", "--seed-prefix", "seed.")


def gate(grafted: Path, *args: str, **env: str) -> Any:
    return compare(str(grafted), *SPLIT, *args, **env)


def test_the_fixture_ratio(grafted: Path, project: Path) -> None:
    document = json.loads(gate(grafted, "-f", "json").stdout)
    # (12 / 8) * sqrt(68 / 20): every element of a side counts, the zero biases too.
    assert document["dual"]["normalized_ratio"] == pytest.approx(1.5 * math.sqrt(68 / 20))
    changes = {change["name"]: change for change in document["parameters"]["changes"]}
    assert changes["w"]["ratio"] == pytest.approx(3.0)
    assert changes["attn.k.bias"]["note"] == "both norms are 0"


# --- [tool.gradaudit] and [tool.gradaudit.compare] ------------------------------------


def test_the_compare_table_gates_and_flags_override_it(grafted: Path, project: Path) -> None:
    assert gate(grafted).exit_code == ExitCode.OK
    configure(project, "[tool.gradaudit.compare]\nmin-ratio = 3.0")
    failing = gate(grafted)
    assert failing.exit_code == ExitCode.FINDINGS
    assert "FAIL: 1 failing finding (ratio_below_min)" in failing.stdout
    assert "< --min-ratio 3" in failing.stdout
    assert gate(grafted, "--min-ratio", "1").exit_code == ExitCode.OK  # the flag wins
    assert gate(grafted, "--no-config").exit_code == ExitCode.OK


def test_change_settings_from_the_compare_table(grafted: Path, project: Path) -> None:
    configure(project, "[tool.gradaudit.compare]\nmax-change = 2\nfail-on-change = true")
    failing = gate(grafted)
    assert failing.exit_code == ExitCode.FINDINGS
    assert "large_change" in failing.stdout
    assert gate(grafted, "--no-fail-on-change").exit_code == ExitCode.OK
    assert gate(grafted, "--max-change", "3.5").exit_code == ExitCode.OK


def test_shared_settings_apply_to_compare(grafted: Path, project: Path) -> None:
    configure(project, '[tool.gradaudit]\nfail-on = ["vanishing"]\nformat = "github"')
    result = gate(grafted)
    assert result.exit_code == ExitCode.FINDINGS
    assert result.stdout.startswith("::error file=")  # format from the file
    assert "vanishing in host.attn.k.bias" in result.stdout
    ignored = gate(grafted, "--ignore", "*.k.bias")
    assert ignored.exit_code == ExitCode.OK
    assert "(2 ignored)" in ignored.stdout


def test_one_pyproject_for_both_commands(grafted: Path, project: Path) -> None:
    configure(
        project,
        '[tool.gradaudit]\nfail-on = "nonfinite"\nformat = "json"\n\n'
        '[tool.gradaudit.compare]\nmin-ratio = 0.5\nformat = "markdown"\n\n'
        '[tool.gradaudit.scan]\nformat = "github"\n',
    )
    scan = run("scan", str(grafted))
    assert scan.exit_code == ExitCode.OK  # the compare gate does not bother scan
    annotations = [line for line in scan.stdout.splitlines() if not line.startswith("::notice")]
    assert annotations[0].startswith("::warning file=")  # the scan table's format: github
    assert scan.stdout.splitlines()[-1].startswith("gradaudit: OK")
    compared = gate(grafted)
    assert compared.exit_code == ExitCode.OK
    assert compared.stdout.startswith("### ✅ gradaudit compare: OK")
    assert "min ratio 0.5" in compared.stdout
    assert "fail on: inf, nan" in compared.stdout


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            "[tool.gradaudit]\nmax-ratio = 10",
            "[tool.gradaudit] max-ratio: only compare reads it: put it in [tool.gradaudit.compare]",
        ),
        (
            "[tool.gradaudit.compare]\nmin-ratio = -1",
            "[tool.gradaudit.compare] min-ratio: must be >= 0 (got -1.0)",
        ),
        (
            "[tool.gradaudit.scan]\nfail-on-change = true",
            "[tool.gradaudit.scan] fail-on-change: scan does not read it (only compare)",
        ),
    ],
)
def test_a_bad_compare_setting_fails_every_command(
    grafted: Path, project: Path, table: str, message: str
) -> None:
    configure(project, table)
    for result in (gate(grafted), run("scan", str(grafted))):
        assert result.exit_code == ExitCode.USAGE_ERROR
        assert result.stdout == ""
        assert result.stderr == f"gradaudit: error: {project / 'pyproject.toml'}: {message}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-ratio", "-1"], "gradaudit: error: --min-ratio: must be >= 0 (got -1.0)\n"),
        (["--max-ratio", "nan"], "gradaudit: error: --max-ratio: must be > 0 (got nan)\n"),
        (
            ["--max-change", "0.5"],
            "gradaudit: error: --max-change: must be >= 1, the band is [1/k, k] (got 0.5)\n",
        ),
        (
            ["--min-ratio", "2", "--max-ratio", "1"],
            "gradaudit: error: min-ratio: must not exceed max-ratio (2 > 1)\n",
        ),
        (["--fail-on", "nonfinit"], "gradaudit: error: --fail-on: unknown kind 'nonfinit'"),
        (["--max-global-norm", "0"], "gradaudit: error: --max-global-norm: must be > 0"),
        (["--ignore", " "], "gradaudit: error: --ignore: a pattern cannot be empty\n"),
        (["--device", "tpu"], "gradaudit: error: --device: unknown device 'tpu'"),
        (["--config", "pyproject.toml", "--no-config"], "cannot be combined"),
    ],
)
def test_bad_flags_are_one_line_usage_errors_naming_the_flag(
    grafted: Path, project: Path, args: list[str], message: str
) -> None:
    result = gate(grafted, *args)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert message in result.stderr
    assert len(result.stderr.splitlines()) == 1


# --- policy flags ---------------------------------------------------------------------


def test_fail_on_nonfinite_and_limits(write_dump: WriteDump, project: Path) -> None:
    host = write_dump({"w": torch.ones(4)}, "host.safetensors", GRADIENT_DUMP)
    loud = write_dump({"w": torch.full((4,), 1e3)}, "loud.safetensors", GRADIENT_DUMP)
    inf = write_dump({"w": torch.tensor([1.0, math.inf])}, "inf.safetensors", GRADIENT_DUMP)
    assert compare(str(host), str(loud)).exit_code == ExitCode.FINDINGS  # exploding
    relaxed = compare(str(host), str(loud), "--fail-on", "nonfinite")
    assert relaxed.exit_code == ExitCode.OK
    assert "OK: no failing findings (2 warnings)" in relaxed.stdout  # exploding, large change
    assert compare(str(host), str(inf), "--fail-on", "nonfinite").exit_code == ExitCode.FINDINGS
    limited = compare(str(host), str(loud), "--fail-on", "none", "--max-global-norm", "10")
    assert limited.exit_code == ExitCode.FINDINGS
    assert "LIMIT: global norm 2e+03 in seed > max-global-norm 10" in limited.stdout
    assert "FAIL: 1 failing finding (global-norm)" in limited.stdout


def test_every_format_gives_the_same_verdict(grafted: Path, project: Path) -> None:
    for args, code in ((("--min-ratio", "3"), ExitCode.FINDINGS), ((), ExitCode.OK)):
        for fmt in ("table", "json", "markdown", "github", "junit"):
            assert gate(grafted, *args, "-f", fmt).exit_code == code, fmt


# --- --output and --quiet -------------------------------------------------------------


def test_output_writes_the_same_text_as_stdout(grafted: Path, project: Path) -> None:
    target = project / "compare.md"
    written = gate(grafted, "-f", "markdown", "-o", str(target))
    assert written.exit_code == ExitCode.OK
    assert written.stdout == ""
    assert written.stderr == f"gradaudit: wrote markdown comparison to {target}\n"
    printed = gate(grafted, "-f", "markdown")
    assert target.read_text(encoding="utf-8") == printed.stdout
    assert sorted(p.name for p in project.iterdir()) == [
        "compare.md",
        "grafted.safetensors",
        "pyproject.toml",
    ]


def test_output_from_the_compare_table_is_relative_to_the_config(
    grafted: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure(
        project,
        '[tool.gradaudit]\noutput = "reports/scan.xml"\nformat = "junit"\n\n'
        '[tool.gradaudit.compare]\noutput = "reports/compare.xml"\n',
    )
    (project / "reports").mkdir()
    sub = project / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    assert gate(grafted, "--quiet").stderr == ""
    assert run("scan", str(grafted), "-q").exit_code == ExitCode.OK
    compared = (project / "reports" / "compare.xml").read_text(encoding="utf-8")
    scanned = (project / "reports" / "scan.xml").read_text(encoding="utf-8")
    assert '<testsuites name="gradaudit compare"' in compared
    assert '<testsuites name="gradaudit"' in scanned  # not overwritten by compare


def test_output_is_never_an_input_and_never_half_written(
    grafted: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = grafted.read_bytes()
    refused = gate(grafted, "-o", str(grafted))
    assert refused.exit_code == ExitCode.USAGE_ERROR
    assert "is an input; gradaudit never writes to inputs" in refused.stderr
    assert grafted.read_bytes() == before
    target = project / "compare.json"
    assert gate(grafted, "-o", str(target), "--max-change", "0").exit_code == 2

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug")

    # A bug on either path (torch-free on the CPU, torch elsewhere).
    monkeypatch.setattr(importlib.import_module("gradaudit.comparison.api"), "compare_paths", crash)
    files = importlib.import_module("gradaudit.comparison.files")
    monkeypatch.setattr(files, "compare_paths_torch_free", crash)
    crashed = gate(grafted, "-o", str(target))
    assert crashed.exit_code == ExitCode.INTERNAL_ERROR
    assert not target.exists()
    assert sorted(p.name for p in project.iterdir()) == ["grafted.safetensors", "pyproject.toml"]


def test_an_incomplete_comparison_still_writes_its_report(grafted: Path, project: Path) -> None:
    target = project / "compare.json"
    missing = project / "missing.safetensors"
    result = compare(str(grafted), str(missing), "-f", "json", "-o", str(target))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr.startswith(f"gradaudit: error: {missing}: no such file\n")
    assert json.loads(target.read_text())["errors"][0]["file"] == str(missing)


def test_quiet_prints_only_findings(grafted: Path, project: Path) -> None:
    healthy = gate(grafted, "--quiet")
    assert healthy.exit_code == ExitCode.OK
    assert healthy.stdout.splitlines() == [
        "warning: host.attn.k.bias (host): vanishing: norm 0 < vanishing threshold 1e-07",
        "warning: seed.attn.k.bias (seed): vanishing: norm 0 < vanishing threshold 1e-07",
    ]
    assert gate(grafted, "-q", "--ignore", "*.k.bias").stdout == ""
    failing = gate(grafted, "-q", "--max-ratio", "1", "--ignore", "*.k.bias", "-f", "markdown")
    assert failing.exit_code == ExitCode.FINDINGS
    assert failing.stdout.startswith("- ❌ normalized ratio 2.766 > --max-ratio 1\n")


# --- pipes ----------------------------------------------------------------------------


@pytest.fixture
def many_tensors(write_dump: WriteDump) -> Path:
    """Enough rows (--all) to overflow a pipe buffer, so the reader really goes away first."""
    return write_dump(
        {f"{side}.layer{i:04d}.weight": torch.ones(2) for side in ("a", "b") for i in range(1500)},
        "many.safetensors",
    )


def _command(path: Path) -> list[str]:
    args = ["compare", str(path), "--host-prefix", "a.", "--seed-prefix", "b.", "--all"]
    return [sys.executable, "-m", "gradaudit", *args, "--no-config"]


ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "120"}


@pytest.mark.slow
def test_broken_pipe_ends_quietly_with_the_verdict(many_tensors: Path) -> None:
    command = " ".join(_command(many_tensors)) + ' | head -1; echo "status=${PIPESTATUS[0]}"'
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=ENV,
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("┏")
    assert lines[1] == "status=0"
    assert result.stderr == ""


@pytest.mark.slow
def test_broken_pipe_after_a_partial_read(many_tensors: Path) -> None:
    process = subprocess.Popen(
        _command(many_tensors),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=ENV,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == ExitCode.OK
    assert first.startswith("┏".encode())
    assert stderr == b""
