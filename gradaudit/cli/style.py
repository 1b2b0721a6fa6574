"""One voice for the command line: usage errors and help in gradaudit's words, not Typer's.

Typer validates options with pydantic and says so (``Value error, 'jsn' is not
one of …``, ``Input should be a valid number, unable to parse string as a
number``), writes usage lines as ``{PATH}...`` and shows Python types in help
(``PATH <list[Path]>``). gradaudit's own errors read ``gradaudit: error: …`` on
one line. :class:`GradauditGroup` makes the two the same: a usage error becomes
that one line (exit 2, as before), usage lines name what to type, and help
shows each argument's metavar, never a Python type.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from gradaudit.cli import coercion
from gradaudit.errors import ExitCode


def _usage_error_class() -> type[Exception]:
    """Click's ``UsageError``, the base of every command-line mistake: Typer vendors Click
    from 0.2x on (``typer._click``), older releases depend on Click itself."""
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found: type[Exception] = importlib.import_module(module).UsageError
        except (ImportError, AttributeError):
            continue
        return found
    raise ImportError("neither typer._click nor click provides UsageError")


ClickUsageError = _usage_error_class()

#: pydantic's phrases and what gradaudit says instead (the option and the value are added).
_PHRASES = (
    (re.compile(r"^Value error, "), ""),
    (re.compile(r"Input should be a valid number.*$"), "not a number"),
    (re.compile(r"Input should be a valid integer.*$"), "not a whole number"),
    (re.compile(r"Input should be a valid boolean.*$"), "not true or false"),
    (re.compile(r"Input should be greater than or equal to "), "must be at least "),
    (re.compile(r"Input should be less than or equal to "), "must be at most "),
    (re.compile(r"Input should be greater than "), "must be above "),
    (re.compile(r"Input should be less than "), "must be below "),
    (re.compile(r"Input should be "), "must be "),
)


def usage_error_line(error: Exception, prog: str = "gradaudit") -> str:
    """``gradaudit: error: --format: 'jsn' is not one of … (gradaudit scan --help)``."""
    message = str(getattr(error, "message", "") or error)
    for pattern, said in _PHRASES:
        message = pattern.sub(said, message)
    message = message.rstrip(".")
    param = getattr(error, "param", None)
    if param is not None:
        opts = [o for o in getattr(param, "opts", []) if o.startswith("--")]
        if isinstance(param, TyperArgument):
            opts = [param.metavar or (param.name or "").upper()]
        name = opts[0] if opts else param.name
        if type(error).__name__ == "MissingParameter":
            ctx = getattr(error, "ctx", None)
            where = ctx.command_path if ctx is not None else prog
            return f"{prog}: error: missing {name} (see '{where} --help')\n"
        given = _given_value(error)
        if given is not None and repr(given) not in message:
            message = (
                f"{given!r} is {message}"
                if message.startswith("not ")
                else (f"{message} (got {given!r})")
            )
        message = f"{name}: {message}"
    elif message[:1].isupper() and not message[1:2].isupper():
        message = message[0].lower() + message[1:]
    ctx = getattr(error, "ctx", None)
    where = ctx.command_path if ctx is not None else prog
    return f"{prog}: error: {message} (see '{where} --help')\n"


def _given_value(error: BaseException) -> Any:
    """The value the user typed, when pydantic's error carries it."""
    cause = error.__cause__
    errors = getattr(cause, "errors", None)
    if not callable(errors):
        return None
    try:
        details = errors()
    except Exception:  # noqa: BLE001 - a best-effort detail for the message
        return None
    return details[0].get("input") if details else None


class GradauditCommand(TyperCommand):
    """A command whose usage line names what to type: ``PATH...``, not ``{PATH}...``."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = []
        for piece in super().collect_usage_pieces(ctx):
            bare = piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
            if bare.startswith("{") and bare.endswith("}..."):
                bare = bare[1:-4] + ("" if " " in bare else "...")
            pieces.append(bare)
        return pieces

    def get_help_option(self, ctx: Any) -> Any:
        """Click's ``--help``, made on first use, with plain values (:mod:`.coercion`)."""
        return _plain_help(super().get_help_option(ctx))


def _plain_help(option: Any) -> Any:
    if option is not None:
        coercion.install([option])
    return option


def _no_python_type(argument: TyperArgument) -> None:
    """Help shows an argument's metavar and help text, not ``<list[Path]>``."""
    setattr(argument, "display_type_rich", lambda ctx: None)  # noqa: B010 - one instance


#: What an option's value is, in words, where the option did not name it itself.
_OPTION_METAVARS = {
    "--device": "DEVICE",
    "--fail-on": "KINDS",
    "--host-prefix": "PREFIX",
    "--seed-prefix": "PREFIX",
    "--output": "FILE",
    "--max-memory": "MIB",
    "--top": "N",
}
#: Otherwise by Python type: help never shows ``<float>`` or ``<int range>``.
_TYPE_METAVARS = {"<float>": "NUMBER", "<int>": "N", "<int range>": "N", "<str>": "TEXT"}
_TYPE_METAVARS |= {"<path>": "FILE", "<float range>": "NUMBER"}


def _name_the_value(option: TyperOption, ctx: Any) -> None:
    if option.metavar is not None or option.is_flag:
        return
    named = next((_OPTION_METAVARS[o] for o in option.opts if o in _OPTION_METAVARS), None)
    if named is None:
        try:
            named = _TYPE_METAVARS.get(option.display_type(ctx))
        except Exception:  # noqa: BLE001 - a type Typer cannot describe keeps its own text
            named = None
    if named is not None:
        option.metavar = named


class GradauditGroup(TyperGroup):
    """The ``gradaudit`` group: its commands speak gradaudit's style (see the module)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        coercion.install(self.params)
        for command in self.commands.values():
            if type(command) is TyperCommand:
                command.__class__ = GradauditCommand
            coercion.install(command.params)
            for param in command.params:
                if isinstance(param, TyperArgument):
                    _no_python_type(param)
                elif isinstance(param, TyperOption):
                    _name_the_value(param, None)

    def get_help_option(self, ctx: Any) -> Any:
        """Click's ``--help``, made on first use, with plain values (:mod:`.coercion`)."""
        return _plain_help(super().get_help_option(ctx))

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(
                args, prog_name, complete_var, standalone_mode, windows_expand_args, **extra
            )
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except ClickUsageError as error:
            sys.stderr.write(usage_error_line(error, prog_name or "gradaudit"))
            sys.exit(int(ExitCode.USAGE_ERROR))
        except typer.Abort:
            sys.stderr.write("gradaudit: aborted\n")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
