"""Plain option values without pydantic: Typer's coercion, less its start-up cost.

Typer 0.2x coerces every parameter of a command through a pydantic ``TypeAdapter``,
built on the first value it sees, and even an option left at ``None`` builds one: every
``gradaudit scan`` imported pydantic and built some thirty adapters, about 90 ms of a
``scan small.pt`` that takes 350 ms of CPU in all (docs/performance.md, "Start-up").
Most values need none of it: an option not given is ``None``, a default is already of
its type, a path is ``Path(text)``, a number is digits, a choice is spelled as one.

:func:`install` gives each parameter a :class:`PlainValues` that returns those values
itself (what Typer's adapter returns for them: ``tests/cli/test_coercion.py`` checks
both on every parameter of every command) and hands anything else to Typer's own
coercion, built as Typer builds it. A wrong value therefore still gets Typer's check
and message, word for word. A Typer that coerces with Click's types (older releases)
has nothing to spare: :func:`install` leaves its parameters alone.
"""

from __future__ import annotations

import importlib
import math
import re
from enum import Enum
from pathlib import Path
from typing import Any, get_args, get_origin


def _typer_part(module: str, name: str) -> Any:
    """A part of Typer 0.2x's coercion by pydantic, or ``None`` in a Typer without it (an
    older one coerces with Click's types: nothing to spare)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


#: Typer's coercion of one parameter (``RuntimeParam``), as ``get_runtime_param`` builds it.
build_runtime_param = _typer_part("typer._coercion", "build_runtime_param")
#: Typer's checks of a path value (exists, readable ...) and their messages.
coerce_cli_path = _typer_part("typer._param_types", "coerce_cli_path")

__all__ = ["TESTED_TYPER", "PlainValues", "install", "typer_release"]

#: ``_plain``'s answer when the value is not plain: Typer coerces it.
_TYPER = object()
#: The numbers whose parse pydantic and Python agree on: digits, a point, an exponent.
_INTEGER = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?(?:[0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})(?:[eE][-+]?[0-9]{1,3})?")


class PlainValues:
    """The runtime coercion of one Typer parameter: plain values here, the rest Typer's.

    Stands in for Typer's ``RuntimeParam`` (its ``coerce`` signature); Typer's own is
    built on the first value that is not plain, by Typer's ``build_runtime_param``.
    """

    def __init__(self, descriptor: Any) -> None:
        self._descriptor = descriptor
        self._typer: Any = None

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        """What Typer's ``RuntimeParam.coerce`` returns for ``value``."""
        multiple = bool(param.multiple or param.nargs == -1)
        if value is None:  # Typer's own first step, before its adapter is used
            return () if multiple else None
        if not (multiple and isinstance(value, str)):
            plain = self._plain(value, param, ctx)
            if plain is not _TYPER:
                return plain
        if self._typer is None:
            self._typer = build_runtime_param(self._descriptor)
        return self._typer.coerce(value, param=param, ctx=ctx)

    def _plain(self, value: Any, param: Any, ctx: Any) -> Any:
        info = self._descriptor.parameter_info
        if info.parser is not None or info.clamp or self._descriptor.file_annotation is not None:
            return _TYPER
        annotation = self._descriptor.annotation
        if get_origin(annotation) is list:
            if not isinstance(value, (list, tuple)):
                return _TYPER
            (item,) = get_args(annotation)
            items = [self._leaf(item, one, param, ctx) for one in value]
            return _TYPER if any(one is _TYPER for one in items) else items
        return self._leaf(annotation, value, param, ctx)

    def _leaf(self, annotation: Any, value: Any, param: Any, ctx: Any) -> Any:
        info = self._descriptor.parameter_info
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            return _choice(annotation, value, info.case_sensitive, ctx)
        if annotation is int or annotation is float:
            return _number(annotation, value, info.min, info.max)
        if annotation is str or annotation is bool:
            return value if type(value) is annotation else _TYPER
        if annotation is Path and info.path_type in (None, Path) and type(value) is str:
            # Typer's path checks (exists, readable ...) and their messages, on Path(value):
            # what pydantic makes of a str.
            return coerce_cli_path(Path(value), info, path_type=Path, param=param, ctx=ctx)
        return _TYPER


def _choice(annotation: type[Enum], value: Any, case_sensitive: bool, ctx: Any) -> Any:
    """A member given as itself, or spelled exactly as its value (Typer's match)."""
    if isinstance(value, annotation):
        return value
    if type(value) is not str or not case_sensitive:
        return _TYPER
    if ctx is not None and getattr(ctx, "token_normalize_func", None) is not None:
        return _TYPER
    found = [member for member in annotation if str(member.value) == value]
    return found[0] if len(found) == 1 else _TYPER


def _number(annotation: type, value: Any, low: float | None, high: float | None) -> Any:
    """An int or float already of its type, or written plainly, within its range."""
    number: Any
    if type(value) is annotation:
        number = value
    elif type(value) is not str:
        return _TYPER
    elif annotation is int and _INTEGER.fullmatch(value):
        number = int(value)
    elif annotation is float and _FLOAT.fullmatch(value):
        number = float(value)
    else:
        return _TYPER
    if isinstance(number, float) and not math.isfinite(number):
        return _TYPER
    if (low is not None and number < low) or (high is not None and number > high):
        return _TYPER  # Typer's message says what the range is
    return number


#: The Typer releases (major, minor) whose private coercion parts this module was checked
#: against (``tests/cli/test_coercion.py``). Another release keeps Typer's own coercion,
#: slower to start but never broken by a renamed or re-signatured private function.
TESTED_TYPER = frozenset({(0, 29)})


def typer_release() -> tuple[int, int] | None:
    """The installed Typer's (major, minor), or ``None`` if its version does not parse."""
    match = re.match(
        r"(\d+)\.(\d+)", str(getattr(importlib.import_module("typer"), "__version__", ""))
    )
    return (int(match[1]), int(match[2])) if match else None


def install(params: Any) -> None:
    """Give each Typer parameter of ``params`` its :class:`PlainValues` (see the module),
    on a Typer release in :data:`TESTED_TYPER` that has the parts."""
    if build_runtime_param is None or coerce_cli_path is None:
        return
    if typer_release() not in TESTED_TYPER:
        return
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if descriptor is None or getattr(param, "_runtime_param", False) is not None:
            continue
        param._runtime_param = PlainValues(descriptor)
