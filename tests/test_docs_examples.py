"""docs/locate.md and docs/precision.md: their Python runs and their console output is real."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradaudit.cli import app

DOCS = Path(__file__).resolve().parent.parent / "docs"
ROOT = DOCS.parent


def _blocks(page: str, language: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("page", ["locate.md", "precision.md"])
def test_python_examples_run(page: str) -> None:
    blocks = _blocks(page, "python")
    assert blocks
    namespace: dict[str, object] = {"__name__": "docs"}
    for block in blocks:
        exec(compile(block, str(DOCS / page), "exec"), namespace)


def test_precision_console_output_is_what_the_command_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    (command,) = _blocks("precision.md", "console")
    args = shlex.split(command.strip().removeprefix("$ gradaudit "))
    args[args.index("--plot") + 1] = str(tmp_path / "figure.png")
    args = [str(ROOT / a) if a.startswith("fixtures/") else a for a in args]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80", "NO_COLOR": "1"})
    shown = _blocks("precision.md", "text")[0]
    assert shown in result.stdout
    # Not compared with the committed image: its bytes depend on matplotlib's version.
    assert (tmp_path / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
