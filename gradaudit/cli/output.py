"""Where rendered text goes: stdout (surviving ``| head``) or an ``--output`` file (atomically).

Commands hand a result here; it is rendered in the chosen format and each chunk
the renderer yields is written as it comes (a million-tensor JSON report is
never one string). This is the only code that writes data (stdout or a report
file). Messages for people go to stderr through :func:`~gradaudit.cli.app.say`.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Sequence
from contextlib import suppress
from pathlib import Path

from gradaudit.cli.app import output_width, say, use_color
from gradaudit.cli.config import Settings
from gradaudit.errors import ExitCode, OutputError, UsageError
from gradaudit.report.base import DEFAULT_TOP_ROWS, RenderOptions
from gradaudit.report.output_format import OutputFormat
from gradaudit.report.text import printable
from gradaudit.results import InputProblem, Report
from gradaudit.results.comparison import Comparison
from gradaudit.results.trend import TrendReport
from gradaudit.results.verdict import comparison_exit_code, exit_code, trend_exit_code


def check_output_path(
    output: Path | None,
    inputs: Sequence[str | Path] = (),
    *,
    recursive: bool = False,
    config: Path | None = None,
) -> None:
    """Refuse an ``--output`` that cannot work, before spending time on the audit.

    The directory must exist. The target, if it exists, must be a regular file
    and not a symbolic link: the atomic rename replaces the path itself, so
    ``--output /dev/stdout`` (a link to wherever stdout goes) would replace the
    shell's redirection target behind its back. And it must not be any file the
    run reads (:func:`check_not_read`), which gradaudit never writes to.
    """
    if output is None:
        return
    target = _target(output)
    if not target.parent.is_dir():
        raise UsageError(f"--output {output}: directory {target.parent} does not exist")
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:  # a name too long, a directory we may not search
        raise UsageError(f"--output {output}: {error.strerror or error}") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise UsageError(
            f"--output {output}: is a symbolic link (name the file it points to; the report "
            "replaces the path atomically)"
        )
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(
            f"--output {output}: not a regular file (leave out --output to write to stdout)"
        )
    check_not_read("--output", output, inputs, recursive=recursive, config=config)


def check_not_read(
    option: str,
    target: Path,
    inputs: Sequence[str | Path],
    *,
    recursive: bool = False,
    config: Path | None = None,
) -> None:
    """Refuse to write ``target`` when it is a file this run reads; a usage error (exit 2).

    "Reads" is after expansion (:func:`~gradaudit.io.discover.files_read`: files found
    in directories, the shards of a sharded index) plus the config file. "Is" means the
    same path once links are resolved, or the same file under another name (a hard link:
    same device and inode), since a report written there would destroy the input.
    """
    from gradaudit.io.discover import files_read  # numpy: only once a command runs

    read: list[str | Path] = [*files_read(inputs, recursive=recursive)]
    if config is not None:
        read.append(config)
    if not read:
        return
    where = _target(target)
    try:
        info = os.stat(where)
        identity = (info.st_dev, info.st_ino)
    except (OSError, ValueError):
        identity = None
    for path in read:
        same = os.path.realpath(path) == str(where)
        if not same and identity is not None:
            try:
                other = os.stat(path)
            except (OSError, ValueError):
                continue
            same = (other.st_dev, other.st_ino) == identity
        if same:
            shown = printable(str(target))
            alias = "" if str(path) == str(target) else f" ({printable(str(path))})"
            raise UsageError(
                f"{option} {shown}: is an input{alias}; gradaudit never writes to inputs"
            )


def _target(path: Path) -> Path:
    """``path`` with its directory resolved and its last component kept (links not followed)."""
    return Path(os.path.realpath(path.parent)) / path.name


def write_atomic(path: Path, text: str | Iterable[str]) -> None:
    """Write ``text`` (or its chunks) to ``path``: a temporary file in its directory, renamed.

    A reader (a CI step, a dashboard) sees either the previous file or the
    complete new one, never half a report; an interrupted run leaves no
    partial file. The file gets the mode a plain ``open(path, "w")`` would.
    """
    check_output_path(path)
    replace_atomically(path, text, "--output")


def replace_atomically(path: Path, data: bytes | str | Iterable[str], option: str) -> None:
    """Write ``data`` to ``path`` through a temporary file in its directory and a rename.

    The one way gradaudit writes a file (``--output``, ``--plot``): a full disk or a
    killed run leaves the previous file, never a truncated one. A failure is an
    :class:`OutputError` naming ``option`` (exit 5: the audit itself was done).
    """
    target = _target(path)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    # A write that fails now, after the audit (disk full, permission, I/O error), is an
    # output failure like a full stdout (exit 5); what could be checked before the
    # audit (check_output_path) was a usage error.
    try:
        fd, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        )
    except OSError as error:
        raise OutputError(f"{option} {path}: cannot write: {error.strerror}") from None
    try:
        if isinstance(data, bytes):
            with os.fdopen(fd, "wb") as binary:
                binary.write(data)
                binary.flush()
                os.fsync(binary.fileno())
        else:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
                handle.writelines([data] if isinstance(data, str) else data)
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException as error:
        with suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise OutputError(f"{option} {path}: cannot write: {error.strerror}") from None
        raise


def write_stdout(text: str | Iterable[str]) -> None:
    """Write data (or its chunks, each as it comes) to stdout; a reader that went away
    (``| head``) ends output quietly.

    Whatever the reader did not read, it did not want: the rest is dropped and
    the command still exits with its verdict. stdout is pointed at /dev/null
    so the interpreter's final flush does not complain either.
    """
    try:
        for chunk in [text] if isinstance(text, str) else text:
            sys.stdout.write(chunk)
            if getattr(sys.stdout, "silenced", False):
                break  # the reader left or stdout failed (streams.py noted it): stop rendering
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, AttributeError) as error:
        # Only without the console entry's guarded streams (gradaudit.cli.streams),
        # e.g. from a test runner: stdout closed (None) or failing.
        cause = error.strerror if isinstance(error, OSError) else "it is closed"
        raise OutputError(f"cannot write the report to stdout: {cause}") from None


def announce_errors(errors: Iterable[InputProblem], debug: bool = False) -> None:
    """One stderr line per input that could not be audited (``internal error:`` when a
    defect in gradaudit cost it); with ``debug``, the traceback of an unexpected one."""
    for problem in errors:
        label = "internal error" if problem.internal else "error"
        say(f"{label}: {printable(problem.path)}: {printable(problem.message)}")
        if debug and problem.traceback:
            with suppress(OSError, AttributeError):  # --debug's extra: best effort
                sys.stderr.write(problem.traceback)


def announce_problems(report: Report, debug: bool = False) -> None:
    """One stderr line per input that could not be audited, or for an empty audit."""
    announce_errors(report.errors, debug)
    if not report.errors and report.audited_nothing:
        from gradaudit.report.verdict import nothing_to_audit  # renderers: not at start-up

        say(f"error: {nothing_to_audit(report)}")


def render_options(
    settings: Settings, *, show_all: bool = False, top: int = DEFAULT_TOP_ROWS
) -> RenderOptions:
    """Width and colour for where the text goes: a file gets no colour and no terminal width."""
    to_terminal = settings.output is None
    return RenderOptions(
        width=output_width(terminal=to_terminal),
        color=to_terminal and use_color(),
        show_all=show_all,
        top=top,
        quiet=bool(settings.quiet),
    )


def emit(text: str | Iterable[str], settings: Settings, what: str = "report") -> None:
    """Send rendered text (or its chunks) to ``--output`` (with a note on stderr) or stdout."""
    if settings.output is None:
        write_stdout(text)
        return
    write_atomic(settings.output, text)
    if not settings.quiet:
        say(f"wrote {what} to {printable(str(settings.output))}")


def _emit(
    result: Report | Comparison | TrendReport,
    settings: Settings,
    options: RenderOptions,
    what: str,
) -> None:
    from gradaudit.report.formats import render  # the renderers: not at start-up

    output_format = settings.format or OutputFormat.TABLE
    emit(render(result, output_format, options), settings, f"{output_format.value} {what}")


def emit_report(
    report: Report,
    settings: Settings,
    *,
    show_all: bool = False,
    top: int = DEFAULT_TOP_ROWS,
    debug: bool = False,
) -> ExitCode:
    """Announce problems, render ``report`` in the chosen format, send it; return the verdict."""
    announce_problems(report, debug)
    _emit(report, settings, render_options(settings, show_all=show_all, top=top), "report")
    return exit_code(report)


def emit_comparison(
    comparison: Comparison,
    settings: Settings,
    *,
    show_all: bool = False,
    top: int = DEFAULT_TOP_ROWS,
    debug: bool = False,
) -> ExitCode:
    """:func:`emit_report` for ``compare``: the same stderr lines, formats and destinations."""
    announce_problems(comparison.report, debug)
    options = render_options(settings, show_all=show_all, top=top)
    _emit(comparison, settings, options, "comparison")
    return comparison_exit_code(comparison)


def emit_trend(
    report: TrendReport, settings: Settings, *, show_all: bool = False, debug: bool = False
) -> ExitCode:
    """:func:`emit_report` for ``trend``: one stderr line per dump that could not be audited."""
    announce_errors(report.errors, debug)
    if not report.errors and not any(step.tensors for step in report.steps):
        say("error: nothing to audit: no floating-point tensor in the dumps")
    _emit(report, settings, render_options(settings, show_all=show_all), "trend")
    return trend_exit_code(report)
