"""Scan each file named in a manifest with the CLI, in one process, one JSON line per file.

Run by ``tests/io/test_fuzz.py`` as ``python -m tests.fuzz_worker MANIFEST`` (and by
``tests/io/test_object_fuzz.py`` with a healthy file to scan beside each case): a separate
process, so that a signal (SIGSEGV, SIGBUS) that kills it is seen by the test as a
failure of the case in flight rather than taking pytest down, and one process for all
cases, so that torch is imported once. Before each case it prints ``start NAME``; a
case that runs longer than ``PER_CASE_SECONDS`` is interrupted and reported as a hang.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import FrameType

from typer.testing import CliRunner

from gradaudit.cli import app

#: Far longer than any of these tiny files needs; a blocked read never ends.
PER_CASE_SECONDS = 20


class Hang(BaseException):  # not an Exception: the per-input boundary must not catch it
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang


def main(manifest: Path, healthy: str | None = None) -> None:
    """Scan each file of ``manifest``; with ``healthy``, each next to that file (first)."""
    runner = CliRunner()
    signal.signal(signal.SIGALRM, _alarm)
    for line in manifest.read_text(encoding="utf-8").splitlines():
        print(f"start {line}", flush=True)
        signal.alarm(PER_CASE_SECONDS)
        try:
            result = runner.invoke(
                app,
                ["scan", *([healthy] if healthy else []), line, "--format", "json", "--no-config"],
                env={"COLUMNS": "120"},
            )
            outcome = {
                "path": line,
                "exit_code": result.exit_code,
                "stdout": result.stdout,
                "stderr": result.stderr,
                # CliRunner keeps an exception that escaped the CLI (a traceback).
                "exception": None
                if result.exception is None or isinstance(result.exception, SystemExit)
                else repr(result.exception),
            }
        except Hang:
            outcome = {"path": line, "hang": True}
        finally:
            signal.alarm(0)
        print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
