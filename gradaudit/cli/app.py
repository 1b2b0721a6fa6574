"""The Typer application and what every command shares: exit-code translation, output.

The CLI package is the only code that touches argv, consoles and exit codes.
One module per command registers itself on :data:`app`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from typer._completion_classes import completion_init  # what add_completion=True runs

from gradaudit import __version__
from gradaudit.cli import streams
from gradaudit.cli.style import GradauditGroup
from gradaudit.errors import ExitCode, GradauditError, UsageError
from gradaudit.report.fit import DEFAULT_WIDTH, sane_width
from gradaudit.report.text import printable

EXIT_CODES_HELP = (
    "Exit codes: 0 audited, no failing finding; 1 failing findings (NaN, Inf, exploding by "
    "default); 2 usage error; 3 an input could not be audited (missing, unreadable, corrupt, "
    "refused as unsafe, unsupported, or nothing to audit) - beats 1; 4 internal error (rerun "
    "with --debug); 5 the report or a message could not be written (stdout/stderr closed or "
    "full) - beats all."
)

app = typer.Typer(
    name="gradaudit",
    help="Audit PyTorch gradients: NaN/Inf by name, vanishing and exploding layers, "
    "overflow-safe norms.",
    epilog=EXIT_CODES_HELP,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    cls=GradauditGroup,
)
# Shell completion without the --install-completion/--show-completion options in
# every help text: ``eval "$(_GRADAUDIT_COMPLETE=source_bash gradaudit)"`` (zsh,
# fish: source_zsh, source_fish). Each Tab runs the CLI, which imports no torch.
completion_init()


def say(message: str) -> None:
    """One line for people, on stderr.

    A stderr that cannot take it (closed, full) does not stop the run: the
    failure is noted and the run ends with ExitCode.OUTPUT_ERROR (see
    :mod:`gradaudit.cli.streams`, which normally catches it first).
    """
    try:
        sys.stderr.write(f"gradaudit: {message}\n")
    except (OSError, AttributeError) as error:
        cause = str(error.strerror or error) if isinstance(error, OSError) else "it is closed"
        streams.note("stderr", cause)


@contextmanager
def exit_codes(debug: bool) -> Iterator[None]:
    """Translate errors into one line on stderr and an exit code; the one place that does."""
    try:
        yield
    except (typer.Exit, BrokenPipeError):
        raise  # a closed stdout is not a bug: the entry point ends quietly
    except GradauditError as error:
        if debug:
            traceback.print_exc()
        say(f"error: {printable(str(error))}")
        raise typer.Exit(int(error.exit_code)) from None
    except Exception as error:  # noqa: BLE001 - anything else is a bug, reported as such
        if debug:
            traceback.print_exc()
        say(
            f"internal error: {type(error).__name__}: {printable(str(error))} "
            "(this is a bug; rerun with --debug for the traceback)"
        )
        raise typer.Exit(int(ExitCode.INTERNAL_ERROR)) from None


def output_width(terminal: bool = True) -> int:
    """``COLUMNS`` if set, else the terminal's width, else 120 (pipes, CI logs, files).

    ``terminal=False`` (output going to a file) skips the terminal's width. A
    width of 0 (a pseudo-terminal that reports none, ``script -qc … /dev/null``)
    or an absurd one falls back to the default: Rich prints nothing at width 0.
    """
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return sane_width(int(columns))
    if terminal and sys.stdout.isatty():
        try:
            return sane_width(os.get_terminal_size(sys.stdout.fileno()).columns)
        except OSError:
            return DEFAULT_WIDTH
    return DEFAULT_WIDTH


def use_color() -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set (https://no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def check_device_option(device: str) -> None:
    """``meta`` is for the library's tests, not for scanning files."""
    if device.strip().lower() == "meta":
        raise UsageError("unsupported device 'meta': use auto, cpu, cuda or cuda:N")


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"gradaudit {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Audit PyTorch gradients for NaN/Inf, vanishing and exploding layers."""
