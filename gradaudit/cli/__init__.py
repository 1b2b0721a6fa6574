"""The ``gradaudit`` command line; each command lives in its own module."""

from __future__ import annotations

import os
import sys

from gradaudit.cli import compare as _compare  # noqa: F401  (registers the command)
from gradaudit.cli import scan as _scan  # noqa: F401  (registers the command)
from gradaudit.cli import trend as _trend  # noqa: F401  (registers the command)
from gradaudit.cli.app import app

__all__ = ["app", "run"]


def run() -> None:
    """Console-script entry point.

    Commands write data through :func:`gradaudit.cli.output.write_stdout`,
    which survives a reader that went away (``gradaudit scan … | head``) and
    keeps the verdict's exit code. This is the net for any other write (help
    text, say()): no traceback, exit 1 like Click.
    """
    try:
        app(prog_name="gradaudit")
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        sys.exit(1)
