"""Names are escaped once, at render time, by one function (``report.text.printable``).

The readers quote and cut names in their messages (``show``) but leave control
characters alone: the message is data. Escaping in both layers showed an ESC in a
tensor name as ``bad\\\\x1bname`` on stderr while JSON said ``bad\\x1bname``.
"""

from __future__ import annotations

import json
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.io.files import show
from tests.conftest import runner

ESCAPED = "bad\\x1bname"  # what a person sees: one backslash


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """A safetensors file whose only tensor has an ESC in its name and an unknown dtype."""
    header = json.dumps(
        {"bad\x1bname": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}
    ).encode()
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return path


def scan(path: Path, fmt: str) -> tuple[str, str]:
    result = runner.invoke(app, ["scan", str(path), "--no-config", "-f", fmt], env={})
    assert result.exit_code == ExitCode.INPUT_ERROR, result.output
    return result.stdout, result.stderr


def test_stderr_escapes_a_control_character_once(hostile: Path) -> None:
    _, stderr = scan(hostile, "table")
    assert f'tensor "{ESCAPED}": unknown dtype' in stderr
    assert "\\\\x1b" not in stderr
    assert "\x1b" not in stderr


def test_json_carries_the_exact_name(hostile: Path) -> None:
    stdout, _ = scan(hostile, "json")
    (error,) = json.loads(stdout)["errors"]
    assert 'tensor "bad\x1bname"' in error["message"]


def test_every_human_format_escapes_it_once(hostile: Path) -> None:
    github, _ = scan(hostile, "github")
    assert f'"{ESCAPED}"' in github
    assert "\x1b" not in github
    junit, _ = scan(hostile, "junit")
    (error,) = ET.fromstring(junit).iter("error")
    assert f'"{ESCAPED}"' in (error.text or "")
    markdown, _ = scan(hostile, "markdown")
    # Markdown escapes the backslash itself, so the page shows one: bad\x1bname.
    assert '"bad\\\\x1bname"' in markdown
    assert "\x1b" not in markdown


def test_show_quotes_and_cuts_but_does_not_escape() -> None:
    assert show("bad\x1bname") == '"bad\x1bname"'
    assert show("x" * 10, limit=4) == '"xxxx..."'
