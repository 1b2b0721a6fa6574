"""The CI-gating examples of the README and docs/ run as written: console output, CI jobs,
pre-commit hooks, configuration."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner
from tests.docs.examples import REPO, blocks, text

DOCS = text()
HOOKS = (REPO / ".pre-commit-hooks.yaml").read_text(encoding="utf-8")


def console_blocks() -> list[tuple[str, str]]:
    """``(command, output)`` of every ```console block that runs gradaudit."""
    return re.findall(r"```console\n\$ (gradaudit [^\n]*)\n(.*?)```", DOCS, flags=re.S)


def ci_jobs() -> list[str]:
    """The ```yaml blocks that train a model and run gradaudit."""
    return [block for _, block in blocks("yaml") if "python - <<'EOF'" in block]


def normalise(text: str) -> str:
    return re.sub(r'time="[0-9.]+"', 'time="…"', text)


def test_readme_shows_every_ci_format() -> None:
    commands = [command for command, _ in console_blocks()]
    for fmt in ("markdown", "github", "junit"):
        assert f"gradaudit scan fixtures/demo_grads.safetensors --format {fmt}" in commands
    compare = [c for c in commands if c.startswith("gradaudit compare fixtures/grafted_grads")]
    for fmt in ("markdown", "github"):
        assert any(c.endswith(f"--format {fmt}") for c in compare)


@pytest.mark.parametrize(("command", "expected"), console_blocks())
def test_console_examples_print_what_the_readme_shows(
    command: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    args = shlex.split(command)[1:]
    result = runner.invoke(app, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code in (ExitCode.OK, ExitCode.FINDINGS), result.stderr
    assert normalise(result.stdout) == normalise(expected)


def heredoc(job: str) -> str:
    lines = job.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("python - <<'EOF'"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "EOF")
    return textwrap.dedent("\n".join(lines[start + 1 : end]))


def gradaudit_commands(job: str) -> list[str]:
    return re.findall(r"^\s*(?:run: |- )(gradaudit .*)$", job, flags=re.M)


def test_readme_has_a_github_and_a_gitlab_job_and_a_compare_gate() -> None:
    jobs = ci_jobs()
    assert len(jobs) == 3
    assert "runs-on:" in jobs[0]
    assert "GITHUB_STEP_SUMMARY" in jobs[0]
    assert "reports:\n      junit: gradaudit.xml" in jobs[1]
    assert "runs-on:" in jobs[2]
    assert all(c.startswith("gradaudit compare ") for c in gradaudit_commands(jobs[2]))
    assert "--min-ratio" in jobs[2]


@pytest.mark.slow
@pytest.mark.parametrize("job", ci_jobs(), ids=["github", "gitlab", "github-compare"])
def test_ci_jobs_run_as_written(job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The training step, in this process (torch is already imported).
    monkeypatch.chdir(tmp_path)
    exec(compile(heredoc(job), "README training step", "exec"), {"__name__": "readme"})
    assert (tmp_path / "grads.safetensors").is_file()
    # The gradaudit steps, through a shell as CI runs them, with this checkout's gradaudit.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "gradaudit"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gradaudit "$@"\n')
    shim.chmod(0o755)
    summary = tmp_path / "step-summary.md"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "PYTHONPATH": str(REPO),
        "GITHUB_STEP_SUMMARY": str(summary),
    }
    commands = gradaudit_commands(job)
    assert len(commands) == 2
    for command in commands:
        result = subprocess.run(
            ["bash", "-e", "-c", command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, (command, result.stdout, result.stderr)
    if "gradaudit compare" in job:
        assert summary.read_text(encoding="utf-8").startswith("### ✅ gradaudit compare: OK")
    elif "GITHUB_STEP_SUMMARY" in job:
        assert summary.read_text(encoding="utf-8").startswith("### ✅ gradaudit: OK")
    else:
        root = ET.parse(tmp_path / "gradaudit.xml").getroot()
        assert root.get("failures") == "0"
        assert root.get("tests") == "4"


def hook_args() -> dict[str, list[str]]:
    """``id -> entry words + args`` from .pre-commit-hooks.yaml (a flat, simple YAML list)."""
    hooks: dict[str, list[str]] = {}
    for block in HOOKS.split("\n- ")[1:]:
        fields = dict(re.findall(r"^\s*(\w+): (.*)$", "- " + block, flags=re.M))
        ident = re.search(r"id: (\S+)", block)
        assert ident is not None
        args = [a.strip() for a in fields["args"].strip("[]").split(",")]
        hooks[ident.group(1)] = [*fields["entry"].split(), *args]
        assert fields["files"] == r"\.safetensors$"
    return hooks


def test_pre_commit_hooks_run_on_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    hooks = hook_args()
    assert set(hooks) == {"gradaudit", "gradaudit-system"}
    for words in hooks.values():
        assert words[0] == "gradaudit"
        healthy = runner.invoke(app, [*words[1:], "fixtures/healthy_grads.safetensors"])
        assert healthy.exit_code == ExitCode.OK, healthy.stderr
        demo = runner.invoke(app, [*words[1:], "fixtures/demo_grads.safetensors"])
        assert demo.exit_code == ExitCode.FINDINGS


DEMO = "fixtures/demo_grads.safetensors"


def test_readme_pre_commit_example_args_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    match = re.search(r"- id: gradaudit\n(?:\s*#.*\n)*\s*args: \[(.*)\]", DOCS)
    assert match is not None
    args = [a.strip().strip('"') for a in match.group(1).split(",")]
    demo = runner.invoke(app, ["scan", *args, DEMO])
    assert demo.exit_code == ExitCode.FINDINGS  # the NaN
    # No gradient thresholds for weights: what is flagged exploding read as weights is a
    # scale no initialisation gives (a diverged run), not a norm above 100.
    as_weights = runner.invoke(app, ["scan", *args, "--format", "json", DEMO])
    document = json.loads(as_weights.stdout)
    exploding = [
        f["message"] for t in document["tensors"] for f in t["findings"] if f["kind"] == "exploding"
    ]
    assert all("the run diverged" in message for message in exploding)
    healthy = runner.invoke(app, ["scan", *args, "fixtures/healthy_grads.safetensors"])
    assert healthy.exit_code == ExitCode.OK
    # --quiet shows flagged rows only: none (the two key biases, 5 decades below the
    # matrices, are 1-D weights, which start at zero and are not outlier-compared).
    flagged = [line for line in healthy.stdout.splitlines() if line.startswith("│")]
    assert flagged == []


def test_readme_config_examples_are_valid_for_every_command(tmp_path: Path) -> None:
    from gradaudit.cli.config import COMMANDS, load_config

    tomls = [block for _, block in blocks("toml")]
    assert len(tomls) >= 2
    for index, block in enumerate(tomls):
        path = tmp_path / str(index) / "pyproject.toml"
        path.parent.mkdir()
        path.write_text(block, encoding="utf-8")
        for command in COMMANDS:
            settings = load_config(path, command)
            settings.thresholds()
            settings.compare_policy()
            settings.trend_policy()
    compare = load_config(tmp_path / "1" / "pyproject.toml", "compare")
    scan = load_config(tmp_path / "1" / "pyproject.toml", "scan")
    assert compare.min_ratio == 0.1
    assert scan.min_ratio is None
    assert compare.output != scan.output
    # docs/trend.md: trend's own keys in its sub-table, and its own report file.
    (index,) = [i for i, block in enumerate(tomls) if "[tool.gradaudit.trend]" in block]
    trend = load_config(tmp_path / str(index) / "pyproject.toml", "trend")
    assert trend.trend_policy().spike_factor == 5
    assert len(trend.trend_policy().fail_on) == 3
    assert trend.output != load_config(tmp_path / str(index) / "pyproject.toml", "scan").output


def test_the_config_bounds_examples_print_what_docs_ci_shows(tmp_path: Path) -> None:
    shown = [line for line in DOCS.splitlines() if "must be within" in line or "(got inf)" in line]
    assert len(shown) == 2
    project = tmp_path / "repo"
    project.mkdir()
    config = project / "pyproject.toml"
    config.write_text("[tool.gradaudit]\nexploding-threshold = " + "9" * 400 + "\n")
    dump = str(REPO / "fixtures" / "demo_grads.safetensors")
    from_file = runner.invoke(app, ["scan", "--config", str(config), dump])
    assert from_file.exit_code == ExitCode.USAGE_ERROR
    assert from_file.stderr.strip() == shown[0].replace("/repo/", f"{project}/")
    from_flag = runner.invoke(app, ["compare", "--no-config", "--max-ratio", "1e999", dump, dump])
    assert from_flag.exit_code == ExitCode.USAGE_ERROR
    assert from_flag.stderr.strip() == shown[1]
