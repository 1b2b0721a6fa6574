"""The layering check (``.ci/layers.py``): the tree passes, and a wrong-way import fails it."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_layers", ROOT / ".ci" / "layers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def package(tmp_path: Path) -> Path:
    """A copy of the package's Python files, to plant imports in."""
    copy = tmp_path / "gradaudit"
    shutil.copytree(
        ROOT / "gradaudit", copy, ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__")
    )
    return copy


def test_the_package_follows_its_layers() -> None:
    assert _layers().problems(ROOT / "gradaudit") == []


@pytest.mark.parametrize(
    ("module", "planted", "expected"),
    [
        # A result type reaching up to a stage, at the top of the file.
        ("results/row.py", "from gradaudit.scan import judge\n", "gradaudit.scan.judge (top, up)"),
        # The same inside a function: lazy imports count too.
        (
            "io/files.py",
            "def _late() -> None:\n    from gradaudit.report import verdict\n",
            "gradaudit.report.verdict (lazy, up)",
        ),
        # Under TYPE_CHECKING as well.
        (
            "engine/options.py",
            "import typing\nif typing.TYPE_CHECKING:\n    from gradaudit.cli import app\n",
            "gradaudit.cli.app (typing, up)",
        ),
        # Siblings of one layer do not import each other.
        ("trend/builder.py", "from gradaudit.comparison import api\n", "(top, sideways)"),
    ],
)
def test_a_wrong_way_import_fails(package: Path, module: str, planted: str, expected: str) -> None:
    path = package / module
    path.write_text(path.read_text(encoding="utf-8") + "\n" + planted, encoding="utf-8")
    wrong_way = [line for line in _layers().problems(package) if expected in line]
    assert wrong_way, "the planted import was not reported"


def test_a_new_cycle_fails(package: Path) -> None:
    path = package / "results" / "column_view.py"
    path.write_text(
        path.read_text(encoding="utf-8") + "\nfrom gradaudit.results import stats_table\n",
        encoding="utf-8",
    )
    found = _layers().problems(package)
    assert any(line.startswith("import cycle:") and "column_view" in line for line in found)
