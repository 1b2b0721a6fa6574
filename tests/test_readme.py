"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_python_examples() -> None:
    assert python_blocks()


def test_readme_python_examples_run() -> None:
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})


def test_readme_documents_every_exit_code() -> None:
    from gradaudit import ExitCode

    text = README.read_text(encoding="utf-8")
    for code in ExitCode:
        assert f"| `{int(code)}` |" in text
