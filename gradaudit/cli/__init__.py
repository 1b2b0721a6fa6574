"""The ``gradaudit`` command line; each command lives in its own module."""

from __future__ import annotations

import sys

from gradaudit.cli import compare as _compare  # noqa: F401  (registers the command)
from gradaudit.cli import scan as _scan  # noqa: F401  (registers the command)
from gradaudit.cli import streams
from gradaudit.cli import trend as _trend  # noqa: F401  (registers the command)
from gradaudit.cli.app import app
from gradaudit.errors import ExitCode

__all__ = ["app", "run"]

#: Typer's exit code for Ctrl-C; an interrupted run stays interrupted.
INTERRUPTED = 130


def run() -> None:
    """Console-script entry point: the command's exit code, unless output failed.

    stdout and stderr are guarded first (:mod:`gradaudit.cli.streams`): a report
    or message that could not be written (stream closed, disk full) ends the run
    with :attr:`ExitCode.OUTPUT_ERROR` whatever the verdict was, so a CI job
    never reads a lost report as a pass or as findings. A reader that went away
    (``| head``) keeps the verdict. Ctrl-C keeps Typer's 130.
    """
    streams.guard()
    try:
        app(prog_name="gradaudit")
        code: int | str | None = 0
    except SystemExit as exit_:
        code = exit_.code
    except OSError as error:  # a write that bypassed the guarded streams
        streams.note("stdout", error.strerror or str(error))
        code = int(ExitCode.OUTPUT_ERROR)
    failed = streams.failures()
    if failed and code != INTERRUPTED:
        if "stderr" not in failed:
            causes = "; ".join(f"cannot write to {name}: {why}" for name, why in failed.items())
            sys.stderr.write(f"gradaudit: error: {causes}\n")
        code = int(ExitCode.OUTPUT_ERROR)
    sys.exit(code)
