"""CI runs what the README says it runs, and its torch-floor leg follows the claimed floor."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from gradaudit._compat import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.findall(r"&& \.venv/bin/python (-m pytest[^\n]*)", readme)
    assert len(found) == 1, found
    return found[0]


def test_ci_runs_the_readmes_test_command() -> None:
    """The README's command is a prefix of CI's (CI adds only coverage options)."""
    command = _readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    runs = re.findall(r"^\.venv/bin/python (-m pytest[^\n]*)", ci, flags=re.M)
    assert len(runs) == 1, runs
    assert runs[0].startswith(command)
    assert set(runs[0][len(command) :].split()) <= {"--cov", "--cov-report=term:skip-covered"}


def test_the_torch_floor_leg_installs_the_claimed_floor() -> None:
    """Raising ``torch>=X.Y`` without re-pinning the leg fails here, not in CI's last minute."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (claim,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    floor = claim.removeprefix("torch>=")
    script = (ROOT / ".ci" / "torch-floor").read_text(encoding="utf-8")
    (pin,) = re.findall(rf'^ *{re.escape(floor)}\) torch_pin="torch==([\d.]+)"', script, re.M)
    assert pin.startswith(f"{floor}.")
    # The script reads the same claim: asked for nothing, it gets past the pin to its usage.
    result = subprocess.run(
        ["bash", str(ROOT / ".ci" / "torch-floor")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "usage" in result.stderr
