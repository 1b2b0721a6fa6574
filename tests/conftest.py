"""Shared fixtures: gradient dumps written into ``tmp_path``, never the working tree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from fixtures.make_series import write_series
from gradaudit import __version__

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

#: The one Click runner every CLI test invokes: stdout and stderr are kept apart, so a
#: test asserts each on its own (habit 10). Stateless between invocations.
runner = CliRunner()

#: The one skip for tests that need a GPU (marker ``cuda`` selects or deselects them).
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WriteDump = Callable[..., Path]


@pytest.fixture(scope="session")
def series(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo series of ``fixtures/make_series.py`` (a spike, a NaN, a collapse planted),
    written once per worker for every module that reads it (it trains a small model: a few
    seconds). Read-only: a test that needs a changed series writes its own."""
    directory = tmp_path_factory.mktemp("series")
    write_series(directory)
    return directory


#: The metadata a dump by ``gradaudit.save_gradients`` carries that says what it holds: a
#: file written with it is read as gradients on firm evidence, so the gradient checks gate.
#: Without it a flat file is read as gradients on thin evidence, where a role-dependent
#: finding (exploding, vanishing) only warns (docs/roles.md).
GRADIENT_DUMP = {"gradaudit_content": "gradients"}


@pytest.fixture
def write_dump(tmp_path: Path) -> WriteDump:
    """Write a safetensors dump of the given tensors and return its path (no metadata
    unless given: ``metadata=GRADIENT_DUMP`` for a dump that says it holds gradients)."""

    def write(
        tensors: dict[str, torch.Tensor],
        name: str = "grads.safetensors",
        metadata: dict[str, str] | None = None,
    ) -> Path:
        path = tmp_path / name
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
        return path

    return write


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="Rewrite golden files from the current output instead of comparing.",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """Compare text with ``tests/golden/NAME``; ``pytest --update-golden`` rewrites it."""
    update = bool(request.config.getoption("--update-golden"))

    def check(name: str, text: str) -> None:
        path = Path(__file__).resolve().parent / "golden" / name
        # The version is the package's, not the renderer's: a release must not rewrite goldens.
        text = text.replace(
            f'"gradaudit_version": "{__version__}"', '"gradaudit_version": "<version>"'
        )
        if update:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
        assert path.exists(), f"missing golden file {path}: run pytest --update-golden"
        assert text == path.read_text(encoding="utf-8")

    return check


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory (the current directory) with a pyproject.toml to fill in."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "demo"\n', encoding="utf-8")
    return tmp_path
