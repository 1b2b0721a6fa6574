"""Start-up: the CLI imports torch only for a command that reads tensors.

``import torch`` costs about 1.2 s of CPU; ``--help``, ``--version`` and every
Tab of shell completion used to pay it. Each case runs in a fresh interpreter
(this test process has long imported torch) and looks at ``sys.modules`` after
the command ran. The timings are in ``benchmarks/bench_startup.py``, not here.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

HEAVY = ("torch", "numpy", "safetensors", "triton", "matplotlib", "pydantic")

_RUN_CLI = f"""
import sys
sys.argv = ["gradaudit", *sys.argv[1:]]
from gradaudit.cli import run
try:
    run()
except SystemExit as exit:
    code = exit.code
else:
    code = 0
heavy = sorted(name for name in {HEAVY!r} if name in sys.modules)
sys.stderr.write(f"\\nHEAVY={{heavy!r}} CODE={{code!r}}\\n")
"""


def run_cli(*args: str, **env: str) -> tuple[str, list[str], object]:
    """Run the CLI in a fresh interpreter: its stdout, the heavy modules it imported, its code."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    marker = done.stderr.rsplit("HEAVY=", 1)
    assert len(marker) == 2, done.stderr
    heavy_text, code_text = marker[1].strip().split(" CODE=")
    return done.stdout, ast.literal_eval(heavy_text), ast.literal_eval(code_text)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--version",), "gradaudit "),
        (("--help",), "Usage"),
        (("scan", "--help"), "--format"),
        (("compare", "--help"), "--min-ratio"),
        (("trend", "--help"), "--spike-factor"),
    ],
)
def test_help_and_version_import_no_torch(args: tuple[str, ...], expected: str) -> None:
    stdout, heavy, code = run_cli(*args)
    assert code in (0, None)
    assert expected in stdout
    assert heavy == []


def test_shell_completion_works_and_imports_no_torch() -> None:
    """Every Tab runs the CLI: it must answer without torch."""
    stdout, heavy, code = run_cli(
        _GRADAUDIT_COMPLETE="complete_bash",
        COMP_WORDS="gradaudit scan --engine ",
        COMP_CWORD="3",
    )
    assert code == 0
    assert stdout.split() == ["native", "triton", "eager", "compiled", "auto"]
    assert heavy == []


@pytest.mark.slow
def test_a_scan_does_import_torch() -> None:
    """The check above can fail: the same harness sees torch once a command reads tensors
    with torch (the eager kernel here; a CPU scan of safetensors files with the native
    kernel needs no torch: tests/scan/test_torch_free.py)."""
    path = str(Path(FIXTURES) / "healthy_grads.safetensors")
    _, heavy, code = run_cli("scan", "-q", "--engine", "eager", path)
    assert code == 0
    assert "torch" in heavy


_API = """
import sys, types
import gradaudit
assert "torch" not in sys.modules, "import gradaudit imported torch"
function = gradaudit.compare  # the name first, then the submodules: still the function
import gradaudit.scan.pending, gradaudit.scan.paths, gradaudit.comparison.api
import gradaudit.comparison as imported
audit_module = sys.modules["gradaudit.scan.pending"]
compare_module = sys.modules["gradaudit.comparison.api"]
assert gradaudit.audit is audit_module.audit, gradaudit.audit
assert gradaudit.compare is function is compare_module.compare, gradaudit.compare
assert isinstance(imported, types.ModuleType) and imported is gradaudit.comparison
from gradaudit import audit, compare, scan_paths
assert audit is audit_module.audit and compare is function
assert scan_paths is sys.modules["gradaudit.scan.paths"].scan_paths
for name in gradaudit.__all__:
    value = getattr(gradaudit, name)
    assert not isinstance(value, types.ModuleType), name
assert set(gradaudit.__all__) <= set(dir(gradaudit))
namespace = {}
exec("from gradaudit import *", namespace)
assert set(gradaudit.__all__) <= set(namespace)
assert gradaudit.engine.stats.ROW_WIDTH == 7  # submodules still reachable as attributes
try:
    gradaudit.no_such_name
except AttributeError as error:
    assert "no_such_name" in str(error)
else:
    raise AssertionError("no AttributeError")
print("ok")
"""


@pytest.mark.slow
def test_public_api_resolves_lazily_to_the_same_objects() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _API], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
