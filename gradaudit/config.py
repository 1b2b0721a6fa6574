"""Settings from ``pyproject.toml`` (``[tool.gradaudit]``) and the command line.

A team writes its policy once, next to the code, and every ``gradaudit``
command in CI and on laptops applies it. The rules, like ruff's:

* the configuration is the ``[tool.gradaudit]`` table of the nearest
  ``pyproject.toml`` that has one, looking in the current directory and then
  each parent; ``--config FILE`` names the file instead (a ``pyproject.toml``,
  or a TOML file whose top level is the table), ``--no-config`` uses none;
* keys are spelled like the long flags (``fail-on``, ``vanishing-threshold``);
* a flag given on the command line overrides the file (lists are replaced, not
  extended, so what you read on the command line is what applies);
* an unknown key or a bad value is a usage error naming the file and the key:
  a typo in a CI gate must not silently weaken it;
* relative paths in the file (``output``) are relative to the file's directory.

Every value, from the file or from a flag, goes through :func:`parse_setting`,
so both are judged by the same rules.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from gradaudit.errors import UsageError
from gradaudit.kernels import Engine
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
    FindingKind,
    PolicyError,
    Thresholds,
    check_exploding_threshold,
    check_ignore_pattern,
    check_max_global_norm,
    check_max_vanishing_fraction,
    check_vanishing_threshold,
    parse_fail_on,
)
from gradaudit.report.formats import OutputFormat

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

#: The file searched for, and the table read from it.
PYPROJECT = "pyproject.toml"
TABLE = ("tool", "gradaudit")


@dataclass(frozen=True)
class Settings:
    """Every setting a config file or a flag can give; ``None`` means "not given".

    Field names are the long flags with ``_`` for ``-``. Display flags that
    only make sense per invocation (``--all``, ``--top``, ``--debug``) are not
    settings.
    """

    fail_on: frozenset[FindingKind] | None = None
    vanishing_threshold: float | None = None
    exploding_threshold: float | None = None
    max_global_norm: float | None = None
    max_vanishing_fraction: float | None = None
    ignore: tuple[str, ...] | None = None
    format: OutputFormat | None = None
    output: Path | None = None
    quiet: bool | None = None
    device: str | None = None
    engine: Engine | None = None
    #: Where the file settings came from (for messages); not a setting.
    source: Path | None = None

    def overridden_by(self, other: Settings) -> Settings:
        """These settings with every setting ``other`` gives taking precedence."""
        given = {
            f.name: getattr(other, f.name)
            for f in dataclasses.fields(other)
            if f.name != "source" and getattr(other, f.name) is not None
        }
        return dataclasses.replace(self, **given)

    def thresholds(self) -> Thresholds:
        """The policy these settings describe, defaults filling the gaps."""
        try:
            return Thresholds(
                vanishing=_default(self.vanishing_threshold, DEFAULT_VANISHING_THRESHOLD),
                exploding=_default(self.exploding_threshold, DEFAULT_EXPLODING_THRESHOLD),
                fail_on=_default(self.fail_on, DEFAULT_FAIL_ON),
                max_global_norm=self.max_global_norm,
                max_vanishing_fraction=self.max_vanishing_fraction,
                ignore=self.ignore or (),
            )
        except PolicyError as error:
            origin = f" (settings from {self.source} and the command line)" if self.source else ""
            raise UsageError(f"{error}{origin}") from None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


# --- value parsers: raw (TOML or flag) value -> typed value, or ValueError ------------


def _number(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"expected a number, got {_kind(raw)}")
    return float(raw)


def _boolean(raw: object) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"expected true or false, got {_kind(raw)}")
    return raw


def _string(raw: object) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a string, got {_kind(raw)}")
    return raw


def _strings(raw: object) -> list[str]:
    """A string or a list of strings (``fail-on = "nan,inf"`` or ``["nan", "inf"]``)."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return list(raw)
    raise ValueError(f"expected a string or a list of strings, got {_kind(raw)}")


def _kind(raw: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    for kind, name in names.items():
        if type(raw) is kind:
            return f"{name} ({raw!r})"
    if isinstance(raw, list | tuple):
        return "a list"
    if isinstance(raw, dict):
        return "a table"
    return type(raw).__name__


def _choice(enum: type[OutputFormat] | type[Engine]) -> Callable[[object], Any]:
    def parse(raw: object) -> Any:
        text = _string(raw)
        try:
            return enum(text.strip().lower())
        except ValueError:
            allowed = ", ".join(member.value for member in enum)
            raise ValueError(f"unknown value {text!r} (choose from {allowed})") from None

    return parse


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?", re.IGNORECASE)


def _device(raw: object) -> str:
    text = _string(raw).strip()
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"unknown device {text!r} (use auto, cpu, cuda or cuda:N)")
    return text


def _checked(check: Callable[[float], float]) -> Callable[[object], float]:
    def parse(raw: object) -> float:
        try:
            return check(_number(raw))
        except PolicyError as error:
            raise ValueError(error.problem) from None

    return parse


def _fail_on(raw: object) -> frozenset[FindingKind]:
    try:
        return parse_fail_on(_strings(raw))
    except PolicyError as error:
        raise ValueError(error.problem) from None


def _ignore(raw: object) -> tuple[str, ...]:
    try:
        return tuple(check_ignore_pattern(p) for p in _strings(raw))
    except PolicyError as error:
        raise ValueError(error.problem) from None


def _output(raw: object) -> Path:
    text = str(raw) if isinstance(raw, PurePath) else _string(raw)
    if not text.strip():
        raise ValueError("expected a file name, got an empty string")
    return Path(text)


#: Config key (= long flag) -> (Settings field, parser). Add a key here to make a
#: new flag configurable; the README's configuration table lists these keys.
KEYS: Mapping[str, tuple[str, Callable[[object], Any]]] = {
    "fail-on": ("fail_on", _fail_on),
    "vanishing-threshold": ("vanishing_threshold", _checked(check_vanishing_threshold)),
    "exploding-threshold": ("exploding_threshold", _checked(check_exploding_threshold)),
    "max-global-norm": ("max_global_norm", _checked(check_max_global_norm)),
    "max-vanishing-fraction": (
        "max_vanishing_fraction",
        _checked(check_max_vanishing_fraction),
    ),
    "ignore": ("ignore", _ignore),
    "format": ("format", _choice(OutputFormat)),
    "output": ("output", _output),
    "quiet": ("quiet", _boolean),
    "device": ("device", _device),
    "engine": ("engine", _choice(Engine)),
}


class SettingError(ValueError):
    """A setting that cannot be used; ``key`` is its flag spelling."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


def parse_setting(key: str, raw: object) -> tuple[str, Any]:
    """``(field, value)`` for one key and its raw value; :class:`SettingError` if bad."""
    if key not in KEYS:
        close = difflib.get_close_matches(key.replace("_", "-"), list(KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(KEYS)
        raise SettingError(key, f"unknown key{hint}; known keys: {known}")
    name, parse = KEYS[key]
    try:
        return name, parse(raw)
    except ValueError as error:
        raise SettingError(key, str(error)) from None


def settings_from_table(table: Mapping[str, object], base: Path | None = None) -> Settings:
    """Settings from a ``[tool.gradaudit]`` table; ``base`` resolves relative paths."""
    values: dict[str, Any] = {}
    for key, raw in table.items():
        name, value = parse_setting(key, raw)
        if isinstance(value, Path) and base is not None and not value.is_absolute():
            value = base / value
        values[name] = value
    return dataclasses.replace(Settings(), **values)


def find_config(start: Path | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` with a ``[tool.gradaudit]`` table, from ``start`` up.

    A ``pyproject.toml`` without the table is passed over (a sub-package's
    ``pyproject.toml`` should not hide the repository's policy); one that
    cannot be read or parsed is an error, not passed over.
    """
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        candidate = directory / PYPROJECT
        if candidate.is_file() and _table(_read(candidate), candidate, required=False) is not None:
            return candidate
    return None


def load_config(path: Path) -> Settings:
    """The settings in ``path``: its ``[tool.gradaudit]`` table, else its top level.

    A ``pyproject.toml`` (or any file with a ``[tool]`` table) must have
    ``[tool.gradaudit]``; any other TOML file is read as the table itself.
    """
    document = _read(path)
    if path.name == PYPROJECT or "tool" in document:
        table = _table(document, path, required=True) or {}
        where = f"{path}: [tool.gradaudit] "
    else:
        table, where = document, f"{path}: "
    try:
        settings = settings_from_table(table, base=path.parent)
    except SettingError as error:
        raise UsageError(f"{where}{error.key}: {error.problem}") from None
    return dataclasses.replace(settings, source=path)


def _read(path: Path) -> dict[str, Any]:
    try:
        # Only regular files: opening a FIFO named by --config would block forever.
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            raise UsageError(f"{path}: the config file is not a regular file")
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise UsageError(f"{path}: cannot read the config file: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not valid TOML: not UTF-8") from None


def _table(document: Mapping[str, Any], path: Path, *, required: bool) -> dict[str, Any] | None:
    if not required and "tool" not in document:
        return None
    node: Any = document
    for part in TABLE:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            if required:
                raise UsageError(f"{path}: no [tool.gradaudit] table")
            return None
    if not isinstance(node, dict):
        raise UsageError(f"{path}: tool.gradaudit must be a table")
    return node


def resolve(cli: Settings, *, config: Path | None = None, no_config: bool = False) -> Settings:
    """The settings that apply: the config file's, overridden by the command line's."""
    if no_config and config is not None:
        raise UsageError("--config and --no-config cannot be combined")
    if no_config:
        return cli
    path = config if config is not None else find_config()
    if path is None:
        return cli
    return load_config(path).overridden_by(cli)
