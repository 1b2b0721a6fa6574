"""The ``gradaudit`` command: the only module that touches argv, consoles and exit codes.

It wires readers, engine, checks and renderers together and maps a report to
an :class:`~gradaudit.errors.ExitCode`. Data goes to stdout, messages for
people to stderr.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from gradaudit import __version__
from gradaudit.audit import scan_paths
from gradaudit.checks import exit_code
from gradaudit.errors import ExitCode, GradauditError, UsageError
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
    Thresholds,
    parse_fail_on,
)
from gradaudit.report import OutputFormat, RenderOptions
from gradaudit.report.base import DEFAULT_TOP_ROWS
from gradaudit.report.text import printable
from gradaudit.stats import DEFAULT_CHUNK_ELEMENTS

EXIT_CODES_HELP = (
    "Exit codes: 0 audited, no failing finding; 1 failing findings (NaN, Inf, exploding by "
    "default); 2 usage error; 3 an input could not be audited (missing, unreadable, corrupt, "
    "unsupported, or nothing to audit) - beats 1; 4 internal error (rerun with --debug)."
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
)


def _say(message: str) -> None:
    sys.stderr.write(f"gradaudit: {message}\n")


@contextmanager
def _exit_codes(debug: bool) -> Iterator[None]:
    """Translate errors into one line on stderr and an exit code; the one place that does."""
    try:
        yield
    except typer.Exit:
        raise
    except GradauditError as error:
        if debug:
            traceback.print_exc()
        _say(f"error: {printable(str(error))}")
        raise typer.Exit(int(error.exit_code)) from None
    except Exception as error:  # noqa: BLE001 - anything else is a bug, reported as such
        if debug:
            traceback.print_exc()
        _say(
            f"internal error: {type(error).__name__}: {printable(str(error))} "
            "(this is a bug; rerun with --debug for the traceback)"
        )
        raise typer.Exit(int(ExitCode.INTERNAL_ERROR)) from None


def _output_width() -> int:
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return os.get_terminal_size(sys.stdout.fileno()).columns
    return 120


def _use_color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


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


@app.command(epilog=EXIT_CODES_HELP)
def scan(
    paths: Annotated[
        list[Path],
        typer.Argument(help="Gradient dumps (.safetensors).", metavar="PATH"),
    ],
    output_format: Annotated[
        OutputFormat, typer.Option("--format", "-f", help="Output format.")
    ] = OutputFormat.TABLE,
    device: Annotated[
        str, typer.Option(help="Where to reduce: auto (CUDA when available), cpu, cuda, cuda:N.")
    ] = "auto",
    vanishing_threshold: Annotated[
        float, typer.Option(help="Norm below which a tensor is vanishing.")
    ] = DEFAULT_VANISHING_THRESHOLD,
    exploding_threshold: Annotated[
        float, typer.Option(help="Norm above which a tensor is exploding.")
    ] = DEFAULT_EXPLODING_THRESHOLD,
    fail_on: Annotated[
        str,
        typer.Option(help="Findings that fail the run: nan,inf,exploding,vanishing, all or none."),
    ] = ",".join(sorted(kind.value for kind in DEFAULT_FAIL_ON)),
    show_all: Annotated[
        bool, typer.Option("--all", help="Show every tensor, not only flagged and top rows.")
    ] = False,
    top: Annotated[
        int, typer.Option(min=0, help="Unflagged rows shown, largest norms first.")
    ] = DEFAULT_TOP_ROWS,
    chunk_elements: Annotated[
        int, typer.Option(min=1, hidden=True, help="Elements reduced at once.")
    ] = DEFAULT_CHUNK_ELEMENTS,
    debug: Annotated[bool, typer.Option(help="Show tracebacks of errors.")] = False,
) -> None:
    """Audit gradient dumps: per-tensor NaN/Inf counts, norms, and a global norm."""
    with _exit_codes(debug):
        try:
            thresholds = Thresholds(
                vanishing=vanishing_threshold,
                exploding=exploding_threshold,
                fail_on=parse_fail_on(fail_on),
            )
        except ValueError as error:
            raise UsageError(str(error)) from None
        if device.strip().lower() == "meta":
            raise UsageError("unsupported device 'meta': use auto, cpu, cuda or cuda:N")
        report = scan_paths(
            paths, thresholds=thresholds, device=device, chunk_elements=chunk_elements
        )
        for problem in report.errors:
            _say(f"error: {printable(problem.path)}: {printable(problem.message)}")
        if not report.errors and report.summary.tensors == 0:
            _say("error: nothing to audit: no floating-point tensor in the inputs")
        options = RenderOptions(
            width=_output_width(), color=_use_color(), show_all=show_all, top=top
        )
        sys.stdout.write(output_format.formatter()(report, options))
        raise typer.Exit(int(exit_code(report)))


def run() -> None:
    """Console-script entry point."""
    app(prog_name="gradaudit")
