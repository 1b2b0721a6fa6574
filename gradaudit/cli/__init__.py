"""The ``gradaudit`` command line; each command lives in its own module."""

from __future__ import annotations

from gradaudit.cli import scan as _scan  # noqa: F401  (registers the command)
from gradaudit.cli import trend as _trend  # noqa: F401  (registers the command)
from gradaudit.cli.app import app

__all__ = ["app", "run"]


def run() -> None:
    """Console-script entry point."""
    app(prog_name="gradaudit")
