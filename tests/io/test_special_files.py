"""Files that would block or never end are refused at once: FIFOs, /dev/zero, loops, escapes.

Each scan runs in a thread with a deadline far beyond what a refusal takes; a
reader that opened a FIFO (blocks until a writer comes) or read /dev/zero (never
ends) would miss it. Every case exits 3 with one line naming the file, and a good
file in the same run is still audited.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner
from tests.hostile import good_safetensors, sharded

#: Seconds: a refusal takes milliseconds; a blocked open or an endless read takes forever.
DEADLINE = 60.0


def scan_soon(*args: str) -> Any:
    outcome: dict[str, Any] = {}

    def target() -> None:
        outcome["result"] = runner.invoke(app, ["scan", *args, "--no-config", "-f", "json"])

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"gradaudit scan {args} is still running"
    return outcome["result"]


def _fifo(tmp: Path) -> tuple[Path, Path]:
    os.mkfifo(tmp / "pipe.safetensors")
    return tmp / "pipe.safetensors", tmp / "pipe.safetensors"


def _fifo_in_directory(tmp: Path) -> tuple[Path, Path]:
    folder = tmp / "dumps"
    folder.mkdir()
    os.mkfifo(folder / "step1.pt")
    return folder, folder / "step1.pt"


def _dev_zero_linked(tmp: Path) -> tuple[Path, Path]:
    (tmp / "zero.safetensors").symlink_to("/dev/zero")
    return tmp / "zero.safetensors", tmp / "zero.safetensors"


def _dev_zero(tmp: Path) -> tuple[Path, Path]:
    return Path("/dev/zero"), Path("/dev/zero")


def _shard_is_dev_zero(tmp: Path) -> tuple[Path, Path]:
    index = sharded(tmp / "sh")
    shard = tmp / "sh" / "m-2.safetensors"
    shard.unlink()
    shard.symlink_to("/dev/zero")
    return index, index


def _loop(tmp: Path) -> tuple[Path, Path]:
    (tmp / "a.safetensors").symlink_to(tmp / "b.safetensors")
    (tmp / "b.safetensors").symlink_to(tmp / "a.safetensors")
    return tmp / "a.safetensors", tmp / "a.safetensors"


def _escape(tmp: Path) -> tuple[Path, Path]:
    index = sharded(tmp / "sh")
    document = json.loads(index.read_text())
    document["weight_map"]["b"] = "../../etc/passwd.safetensors"
    index.write_text(json.dumps(document))
    return index, index


CASES: dict[str, tuple[Callable[[Path], tuple[Path, Path]], str]] = {
    "fifo": (_fifo, "not a regular file (FIFO)"),
    "fifo found in a directory": (_fifo_in_directory, "not a regular file (FIFO)"),
    "/dev/zero": (_dev_zero, "not a regular file (character device)"),
    "symlink to /dev/zero": (_dev_zero_linked, "not a regular file (character device)"),
    "shard linked to /dev/zero": (_shard_is_dev_zero, "not a regular file (character device)"),
    "symlink loop": (_loop, "symlink loop"),
    "shard escaping its directory": (_escape, "escapes the index's directory"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_at_once_next_to_a_good_file(name: str, tmp_path: Path) -> None:
    build, cause = CASES[name]
    given, named = build(tmp_path)
    good = good_safetensors(tmp_path)

    result = scan_soon(str(given), str(good))

    assert result.exit_code == ExitCode.INPUT_ERROR, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"gradaudit: error: {named}: "), line
    assert cause in line
    assert [t["name"] for t in json.loads(result.stdout)["tensors"]] == ["good.weight"]


def test_a_directory_symlink_loop_ends(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    (folder / "sub").mkdir(parents=True)
    good_safetensors(folder / "sub")
    (folder / "sub" / "back").symlink_to(folder)
    result = scan_soon(str(folder), "--recursive")
    assert result.exit_code == ExitCode.OK, result.output
    document = json.loads(result.stdout)
    assert [t["name"] for t in document["tensors"]] == ["good.weight"]
    assert any("symlink loop" in s["reason"] for s in document["skipped"])
