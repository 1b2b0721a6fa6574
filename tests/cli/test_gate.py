"""The CLI as a CI gate: policy flags, config precedence, --output, --quiet, colour, pipes."""

from __future__ import annotations

import importlib
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.cli.app import output_width, use_color
from tests.conftest import GRADIENT_DUMP, WriteDump, runner

REPO = Path(__file__).resolve().parents[2]


def scan(*args: str, **env: str) -> Any:
    return runner.invoke(app, ["scan", *args], env={"COLUMNS": "120", "NO_COLOR": "1", **env})


def configure(project: Path, table: str) -> None:
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "demo"\n\n[tool.gradaudit]\n{table}\n', encoding="utf-8"
    )


@pytest.fixture
def vanishing_dump(write_dump: WriteDump) -> Path:
    """One dead layer of four in a gradient dump: vanishing, which warns by default."""
    grads = {f"l{i}.weight": torch.ones(4) for i in range(3)}
    grads["dead.weight"] = torch.zeros(4)
    return write_dump(grads, "vanishing.safetensors", GRADIENT_DUMP)


# --- policy flags ---------------------------------------------------------------------


def test_fail_on_nonfinite(write_dump: WriteDump, project: Path) -> None:
    inf = write_dump({"w": torch.tensor([1.0, math.inf]), "x": torch.full((2,), 1e4)})
    assert scan(str(inf), "--fail-on", "nonfinite").exit_code == ExitCode.FINDINGS
    loud = write_dump({"x": torch.full((2,), 1e4)}, "loud.safetensors")
    result = scan(str(loud), "--fail-on", "nonfinite")
    assert result.exit_code == ExitCode.OK
    assert "OK: no failing findings (1 warning)" in result.stdout


def test_max_vanishing_fraction(vanishing_dump: Path, project: Path) -> None:
    base = [str(vanishing_dump), "--fail-on", "vanishing"]
    assert scan(*base).exit_code == ExitCode.FINDINGS
    tolerant = scan(*base, "--max-vanishing-fraction", "0.25")
    assert tolerant.exit_code == ExitCode.OK, tolerant.stdout
    strict = scan(*base, "--max-vanishing-fraction", "0.2", "-f", "json")
    assert strict.exit_code == ExitCode.FINDINGS
    (limit,) = json.loads(strict.stdout)["limits"]
    assert limit["kind"] == "vanishing-fraction"
    assert limit["value"] == 0.25


def test_max_global_norm(write_dump: WriteDump, project: Path) -> None:
    path = write_dump({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})
    assert scan(str(path), "--max-global-norm", "5").exit_code == ExitCode.OK
    result = scan(str(path), "--max-global-norm", "4.99")
    assert result.exit_code == ExitCode.FINDINGS
    assert "LIMIT: global norm 5 in" in result.stdout
    assert "FAIL: 1 failing finding (global-norm)" in result.stdout


def test_ignore_is_repeatable_and_counted(write_dump: WriteDump, project: Path) -> None:
    path = write_dump(
        {"a.key.bias": torch.tensor([math.nan]), "b.key.bias": torch.tensor([math.inf])}
    )
    assert scan(str(path), "--ignore", "a.*").exit_code == ExitCode.FINDINGS
    result = scan(str(path), "--ignore", "a.*", "--ignore", "b.*", "-f", "json")
    assert result.exit_code == ExitCode.OK
    document = json.loads(result.stdout)
    assert [t["ignored_by"] for t in document["tensors"]] == ["a.*", "b.*"]
    assert document["summary"]["ignored_findings"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fail-on", "nonfinit"], "--fail-on: unknown kind 'nonfinit'"),
        (["--max-global-norm", "0"], "--max-global-norm: must be > 0 (got 0.0)"),
        (["--max-vanishing-fraction", "1.5"], "--max-vanishing-fraction: must be between 0 and 1"),
        (["--ignore", " "], "--ignore: a pattern cannot be empty"),
        (["--vanishing-threshold", "-1"], "--vanishing-threshold: must be >= 0"),
        (["--device", "tpu"], "--device: unknown device 'tpu'"),
        (["--config", "missing.toml"], "missing.toml: cannot read the config file"),
        (["--config", "pyproject.toml", "--no-config"], "cannot be combined"),
    ],
)
def test_bad_policy_flags_are_usage_errors_naming_the_flag(
    write_dump: WriteDump, project: Path, args: list[str], message: str
) -> None:
    result = scan(str(write_dump({"w": torch.ones(2)})), *args)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert result.stderr.startswith("gradaudit: error: ")
    assert message in result.stderr
    assert len(result.stderr.splitlines()) == 1


# --- configuration precedence ---------------------------------------------------------


def test_config_sets_the_policy_and_flags_override_it(vanishing_dump: Path, project: Path) -> None:
    assert scan(str(vanishing_dump)).exit_code == ExitCode.OK  # defaults: vanishing warns
    configure(project, 'fail-on = ["vanishing"]')
    assert scan(str(vanishing_dump)).exit_code == ExitCode.FINDINGS  # the file applies
    assert scan(str(vanishing_dump), "--fail-on", "none").exit_code == ExitCode.OK  # flag wins
    assert scan(str(vanishing_dump), "--no-config").exit_code == ExitCode.OK


def test_config_thresholds_and_flag_override(vanishing_dump: Path, project: Path) -> None:
    configure(project, 'fail-on = "all"\nvanishing-threshold = 0.0')
    assert scan(str(vanishing_dump)).exit_code == ExitCode.OK  # norm 0 is not < 0
    flagged = scan(str(vanishing_dump), "--vanishing-threshold", "1e-3")
    assert flagged.exit_code == ExitCode.FINDINGS


def test_config_format_quiet_and_ignore(vanishing_dump: Path, project: Path) -> None:
    configure(project, 'format = "json"\nignore = ["dead.*"]')
    document = json.loads(scan(str(vanishing_dump)).stdout)
    assert document["summary"]["ignored_findings"] == 1
    table = scan(str(vanishing_dump), "--format", "table")
    assert "OK: no failing findings (1 ignored)" in table.stdout
    # A flag's list replaces the file's list.
    replaced = json.loads(scan(str(vanishing_dump), "--ignore", "l0.*").stdout)
    assert replaced["summary"]["ignored_findings"] == 0
    assert replaced["thresholds"]["ignore"] == ["l0.*"]
    configure(project, 'quiet = true\nformat = "github"')
    quiet = scan(str(vanishing_dump))
    # After the notice that the file was read as gradients on thin evidence (no metadata).
    annotations = [line for line in quiet.stdout.splitlines() if not line.startswith("::notice")]
    assert annotations[0].startswith("::warning ")
    assert len(annotations) == 1
    loud = scan(str(vanishing_dump), "--no-quiet")
    assert len([line for line in loud.stdout.splitlines() if not line.startswith("::notice")]) == 2


def test_config_is_found_from_a_subdirectory(
    vanishing_dump: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure(project, 'fail-on = ["vanishing"]')
    sub = project / "runs" / "nightly"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert scan(str(vanishing_dump)).exit_code == ExitCode.FINDINGS


def test_explicit_config_file(vanishing_dump: Path, project: Path) -> None:
    configure(project, 'fail-on = ["vanishing"]')
    other = project / "ci" / "gradaudit.toml"
    other.parent.mkdir()
    other.write_text('fail-on = "none"\nmax-vanishing-fraction = 0.1\n', encoding="utf-8")
    result = scan(str(vanishing_dump), "--config", str(other))
    assert result.exit_code == ExitCode.FINDINGS  # the named file, not the discovered one
    assert "vanishing-fraction" in result.stdout


def test_bad_config_is_a_one_line_usage_error(vanishing_dump: Path, project: Path) -> None:
    configure(project, "max-vanishing-fraction = 2")
    result = scan(str(vanishing_dump))
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert result.stderr == (
        f"gradaudit: error: {project / 'pyproject.toml'}: [tool.gradaudit] "
        "max-vanishing-fraction: must be between 0 and 1 (got 2.0)\n"
    )
    # A broken file is an error even when a flag would override the key.
    overridden = scan(str(vanishing_dump), "--max-vanishing-fraction", "0.5")
    assert overridden.exit_code == ExitCode.USAGE_ERROR
    assert scan(str(vanishing_dump), "--no-config").exit_code == ExitCode.OK


# --- --output -------------------------------------------------------------------------


def test_output_writes_the_same_text_as_stdout(vanishing_dump: Path, project: Path) -> None:
    target = project / "report.md"
    written = scan(str(vanishing_dump), "-f", "markdown", "--output", str(target))
    assert written.exit_code == ExitCode.OK
    assert written.stdout == ""
    assert written.stderr == f"gradaudit: wrote markdown report to {target}\n"
    printed = scan(str(vanishing_dump), "-f", "markdown")
    assert target.read_text(encoding="utf-8") == printed.stdout
    assert sorted(p.name for p in project.iterdir()) == [
        "pyproject.toml",
        "report.md",
        "vanishing.safetensors",
    ]


def test_output_from_config_is_relative_to_the_config(vanishing_dump: Path, project: Path) -> None:
    configure(project, 'format = "junit"\noutput = "reports/gradaudit.xml"')
    (project / "reports").mkdir()
    sub = project / "sub"
    sub.mkdir()
    os.chdir(sub)
    result = scan(str(vanishing_dump), "--quiet")
    assert result.exit_code == ExitCode.OK
    assert result.stderr == ""  # --quiet: no "wrote" note either
    assert (project / "reports" / "gradaudit.xml").read_text().startswith("<?xml")


def test_output_replaces_atomically_and_keeps_the_mode(vanishing_dump: Path, project: Path) -> None:
    target = project / "report.json"
    target.write_text("old", encoding="utf-8")
    target.chmod(0o640)
    assert scan(str(vanishing_dump), "-f", "json", "-o", str(target)).exit_code == 0
    assert json.loads(target.read_text())["summary"]["tensors"] == 4
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    fresh = project / "fresh.json"
    scan(str(vanishing_dump), "-f", "json", "-o", str(fresh))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    vanishing_dump: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = project / "report.json"
    target.write_text("previous report", encoding="utf-8")

    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gradaudit.cli.output.os.replace", refuse)
    result = scan(str(vanishing_dump), "-f", "json", "-o", str(target))
    assert result.exit_code == ExitCode.OUTPUT_ERROR  # after the audit: not a usage error
    assert "cannot write: No space left on device" in result.stderr
    assert target.read_text() == "previous report"
    assert sorted(p.name for p in project.iterdir()) == [
        "pyproject.toml",
        "report.json",
        "vanishing.safetensors",
    ]


def test_no_file_unless_results_exist(
    vanishing_dump: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = project / "report.md"
    bad_flag = scan(str(vanishing_dump), "-o", str(target), "--fail-on", "bogus")
    assert bad_flag.exit_code == ExitCode.USAGE_ERROR

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(importlib.import_module("gradaudit.scan.paths"), "scan_paths", crash)
    monkeypatch.setattr(
        importlib.import_module("gradaudit.scan.torch_free"), "scan_torch_free", crash
    )
    crashed = scan(str(vanishing_dump), "-o", str(target))
    assert crashed.exit_code == ExitCode.INTERNAL_ERROR
    assert sorted(p.name for p in project.iterdir()) == ["pyproject.toml", "vanishing.safetensors"]


def test_an_incomplete_audit_still_writes_its_report(vanishing_dump: Path, project: Path) -> None:
    target = project / "report.json"
    missing = project / "missing.safetensors"
    result = scan(str(vanishing_dump), str(missing), "-f", "json", "-o", str(target))
    assert result.exit_code == ExitCode.INPUT_ERROR
    document = json.loads(target.read_text())
    assert document["errors"][0]["file"] == str(missing)
    assert str(missing) in result.stderr


def test_output_paths_that_are_refused(vanishing_dump: Path, project: Path) -> None:
    link = project / "link.md"
    link.symlink_to(project / "real.md")
    (project / "dir.md").mkdir()
    cases = {
        str(vanishing_dump): "is an input; gradaudit never writes to inputs",
        str(link): "is a symbolic link",
        str(project / "dir.md"): "not a regular file",
        "/dev/stdout": "is a symbolic link",
        str(project / "nowhere" / "r.md"): "does not exist",
        str(project / ("x" * 5000 + ".md")): "File name too long",  # was exit 4
    }
    before = vanishing_dump.read_bytes()
    for target, message in cases.items():
        result = scan(str(vanishing_dump), "-o", target)
        assert result.exit_code == ExitCode.USAGE_ERROR, target
        assert message in result.stderr, result.stderr
        assert result.stdout == ""
    assert vanishing_dump.read_bytes() == before
    assert not (project / "real.md").exists()


# --- quiet, colour, width -------------------------------------------------------------


def test_quiet_prints_only_findings(vanishing_dump: Path, project: Path) -> None:
    result = scan(str(vanishing_dump), "--quiet")
    assert result.exit_code == ExitCode.OK
    assert "dead.weight" in result.stdout
    assert "l0.weight" not in result.stdout
    assert "Audited" not in result.stdout
    healthy = scan(str(vanishing_dump), "-q", "--ignore", "dead.*")
    assert healthy.stdout == ""
    assert healthy.exit_code == ExitCode.OK


def test_no_colour_off_a_terminal_and_with_no_color(
    vanishing_dump: Path, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = runner.invoke(app, ["scan", str(vanishing_dump)], env={"NO_COLOR": ""})
    assert "\x1b[" not in plain.stdout  # CliRunner's stdout is not a terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color()


def test_width_comes_from_columns(vanishing_dump: Path, project: Path) -> None:
    narrow = scan(str(vanishing_dump), COLUMNS="70")
    wide = scan(str(vanishing_dump), COLUMNS="200")
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 70
    assert max(len(line) for line in wide.stdout.splitlines()) > 70


def test_files_get_120_columns_not_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert output_width(terminal=False) == 120


# --- broken pipe ----------------------------------------------------------------------


@pytest.fixture
def many_tensors(write_dump: WriteDump) -> Path:
    """Enough rows (--all) to overflow a pipe buffer, so the reader really goes away first."""
    return write_dump({f"layer{i:04d}.weight": torch.ones(2) for i in range(2500)})


@pytest.mark.slow
def test_broken_pipe_ends_quietly_with_the_verdict(many_tensors: Path) -> None:
    command = (
        f"{sys.executable} -m gradaudit scan {many_tensors} --all --no-config | head -1; "
        'echo "status=${PIPESTATUS[0]}"'
    )
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "120"},
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("┏")
    assert lines[1] == "status=0"
    assert result.stderr == ""


@pytest.mark.slow
def test_broken_pipe_after_a_partial_read(many_tensors: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "gradaudit", "scan", str(many_tensors), "--all", "--no-config"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "120"},
    )
    assert process.stdout is not None
    assert process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == ExitCode.OK
    assert first.startswith("┏".encode())
    assert stderr == b""
