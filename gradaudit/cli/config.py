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
  a typo in a CI gate must not silently weaken it. That includes values out of
  bounds: a number that is not a finite float64
  (:func:`~gradaudit.cli.setting_values.number`, for flags too) and what the
  TOML reader cannot take (integers over Python's 4,300 digits, nesting past
  its recursion limit: named by line, :func:`_read`);
* relative paths in the file (``output``) are relative to the file's directory;
* one file serves every command. Keys that several commands read sit in the
  table itself; a ``[tool.gradaudit.<command>]`` sub-table (``compare``,
  ``scan``, ``trend``) holds the keys only that command reads (``min-ratio``,
  ``max-ratio``, ``max-change``, ``fail-on-change`` for ``compare``;
  ``spike-factor`` for ``trend``, and ``fail-on`` in trend's own words) and may
  override shared keys for that command alone (its own ``output`` or
  ``format``). A command ignores the shared keys it has no flag for (``trend``
  and ``exploding-threshold``), but naming one in its sub-table is an error.
  Precedence: flags, then the command's sub-table, then the table. Every
  sub-table is validated on every run, so a typo in the ``compare`` gate
  fails the quick ``scan`` in pre-commit too, not only the nightly job; a
  command-only key in the shared table is a usage error that says where it
  belongs.

Every value, from the file or from a flag, goes through :func:`parse_setting`,
so both are judged by the same rules.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradaudit._compat import tomllib
from gradaudit.cli.setting_values import (
    MAX_NUMBER,
    boolean,
    cast_target,
    checked,
    choice,
    device_name,
    fail_on_kinds,
    ignore_patterns,
    input_kind,
    output_path,
    spike_factor,
    trend_fail_on,
)
from gradaudit.engine.options import Engine
from gradaudit.errors import UsageError
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
    FindingKind,
    InputKind,
    PolicyError,
    Thresholds,
    check_exploding_threshold,
    check_max_global_norm,
    check_max_vanishing_fraction,
    check_vanishing_threshold,
)
from gradaudit.report.output_format import OutputFormat
from gradaudit.results.comparison import (
    DEFAULT_MAX_CHANGE,
    ComparePolicy,
    check_max_change,
    check_max_ratio,
    check_min_ratio,
)
from gradaudit.results.trend import (
    DEFAULT_SPIKE_FACTOR,
    DEFAULT_TREND_FAIL_ON,
    TrendKind,
    TrendPolicy,
)

#: The file searched for, and the table read from it.
PYPROJECT = "pyproject.toml"
TABLE = ("tool", "gradaudit")
#: The commands that read settings; each may have its own sub-table.
COMMANDS = ("scan", "compare", "trend")


@dataclass(frozen=True)
class Settings:
    """Every setting a config file or a flag can give; ``None`` means "not given".

    Field names are the long flags with ``_`` for ``-``. Display flags that
    only make sense per invocation (``--all``, ``--top``, ``--debug``) and
    flags that describe the inputs (``--include``, ``--host-prefix`` …) are
    not settings. The ``compare`` gate (``min_ratio`` … ``fail_on_change``)
    is only ever filled for ``compare``, ``spike_factor`` and ``trend_fail_on``
    (``fail-on`` in ``[tool.gradaudit.trend]``: trend's kinds) only for ``trend``.
    """

    fail_on: frozenset[FindingKind] | None = None
    vanishing_threshold: float | None = None
    exploding_threshold: float | None = None
    max_global_norm: float | None = None
    max_vanishing_fraction: float | None = None
    ignore: tuple[str, ...] | None = None
    kind: InputKind | None = None
    cast_check: str | None = None
    format: OutputFormat | None = None
    output: Path | None = None
    quiet: bool | None = None
    device: str | None = None
    engine: Engine | None = None
    min_ratio: float | None = None
    max_ratio: float | None = None
    max_change: float | None = None
    fail_on_change: bool | None = None
    spike_factor: float | None = None
    trend_fail_on: frozenset[TrendKind] | None = None
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
                kind=_default(self.kind, InputKind.AUTO),
                cast_check=self.cast_check,
            )
        except PolicyError as error:
            raise self._usage_error(error) from None

    def compare_policy(self) -> ComparePolicy:
        """The ``compare`` gate these settings describe, defaults filling the gaps."""
        try:
            return ComparePolicy(
                min_ratio=self.min_ratio,
                max_ratio=self.max_ratio,
                max_change=_default(self.max_change, DEFAULT_MAX_CHANGE),
                fail_on_change=bool(self.fail_on_change),
            )
        except PolicyError as error:
            raise self._usage_error(error) from None

    def trend_policy(self) -> TrendPolicy:
        """The ``trend`` policy these settings describe, defaults filling the gaps."""
        try:
            return TrendPolicy(
                spike_factor=_default(self.spike_factor, DEFAULT_SPIKE_FACTOR),
                vanishing=_default(self.vanishing_threshold, DEFAULT_VANISHING_THRESHOLD),
                fail_on=_default(self.trend_fail_on, DEFAULT_TREND_FAIL_ON),
            )
        except ValueError as error:
            origin = f" (settings from {self.source} and the command line)" if self.source else ""
            raise UsageError(f"{error}{origin}") from None

    def _usage_error(self, error: PolicyError) -> UsageError:
        # Each value was checked alone when parsed; this is a conflict between
        # two of them, which may come from different places.
        origin = f" (settings from {self.source} and the command line)" if self.source else ""
        return UsageError(f"{error}{origin}")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass(frozen=True)
class Key:
    """One config key: the :class:`Settings` field it fills, its parser, who reads it."""

    field: str
    parse: Callable[[object], Any]
    commands: frozenset[str] = frozenset(COMMANDS)

    @property
    def shared(self) -> bool:
        """Read by more than one command, so it may sit in the shared table."""
        return len(self.commands) > 1


_COMPARE = frozenset({"compare"})
_TREND = frozenset({"trend"})
#: Keys ``trend`` has no flag for: they judge single tensors, which trend does not report.
_SCAN_AND_COMPARE = frozenset({"scan", "compare"})

#: Config key (= long flag) -> :class:`Key`. Add a key here to make a new flag
#: configurable; the README's configuration table lists these keys.
KEYS: Mapping[str, Key] = {
    "fail-on": Key("fail_on", fail_on_kinds, _SCAN_AND_COMPARE),
    "vanishing-threshold": Key("vanishing_threshold", checked(check_vanishing_threshold)),
    "exploding-threshold": Key(
        "exploding_threshold", checked(check_exploding_threshold), _SCAN_AND_COMPARE
    ),
    "max-global-norm": Key("max_global_norm", checked(check_max_global_norm), _SCAN_AND_COMPARE),
    "max-vanishing-fraction": Key(
        "max_vanishing_fraction", checked(check_max_vanishing_fraction), _SCAN_AND_COMPARE
    ),
    "ignore": Key("ignore", ignore_patterns, _SCAN_AND_COMPARE),
    "kind": Key("kind", input_kind),
    "cast-check": Key("cast_check", cast_target, _SCAN_AND_COMPARE),
    "format": Key("format", choice(OutputFormat)),
    "output": Key("output", output_path),
    "quiet": Key("quiet", boolean),
    "device": Key("device", device_name),
    "engine": Key("engine", choice(Engine)),
    "min-ratio": Key("min_ratio", checked(check_min_ratio), _COMPARE),
    "max-ratio": Key("max_ratio", checked(check_max_ratio), _COMPARE),
    "max-change": Key("max_change", checked(check_max_change), _COMPARE),
    "fail-on-change": Key("fail_on_change", boolean, _COMPARE),
    "spike-factor": Key("spike_factor", spike_factor, _TREND),
}
#: Keys a command spells like a shared key but reads in its own words: in its sub-table
#: (and from its flags) these replace the shared key's meaning.
COMMAND_KEYS: Mapping[str, Mapping[str, Key]] = {
    "trend": {"fail-on": Key("trend_fail_on", trend_fail_on, _TREND)},
}


def key_for(key: str, command: str | None) -> Key | None:
    """What ``key`` means for ``command`` (its own spelling first), or ``None`` if unknown."""
    own = COMMAND_KEYS.get(command or "", {})
    return own.get(key) or KEYS.get(key)


class SettingError(ValueError):
    """A setting that cannot be used; ``key`` is its flag spelling."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


def parse_setting(key: str, raw: object, command: str | None = None) -> tuple[str, Any]:
    """``(field, value)`` for one key and its raw value; :class:`SettingError` if bad.

    ``command`` picks its own meaning of a key (:data:`COMMAND_KEYS`).
    """
    spec = key_for(key, command)
    if spec is None:
        close = difflib.get_close_matches(key.replace("_", "-"), list(KEYS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(KEYS)
        raise SettingError(key, f"unknown key{hint}; known keys: {known}")
    try:
        return spec.field, spec.parse(raw)
    except ValueError as error:
        raise SettingError(key, str(error)) from None


class TableError(ValueError):
    """A bad key or value in a (sub-)table; ``table`` names it, e.g. ``[tool.gradaudit.compare]``.

    ``table`` is empty for the top level of a plain TOML file given by ``--config``.
    """

    def __init__(self, table: str, error: SettingError) -> None:
        self.table = table
        self.key = error.key
        self.problem = error.problem
        super().__init__(f"{table} {error.key}: {error.problem}".lstrip())


def _table_name(prefix: str, *parts: str) -> str:
    dotted = ".".join(part for part in (prefix, *parts) if part)
    return f"[{dotted}]" if dotted else ""


def settings_from_table(
    table: Mapping[str, object],
    base: Path | None = None,
    *,
    command: str | None = None,
    prefix: str = "tool.gradaudit",
) -> Settings:
    """Settings from a ``[tool.gradaudit]`` table for ``command``; ``base`` resolves paths.

    Every command sub-table is checked whatever ``command`` is; only
    ``command``'s own is applied, over the shared keys (``command=None``
    applies none). ``prefix`` is the table's dotted name, for messages.
    Raises :class:`TableError` naming the (sub-)table and the key.
    """
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for key, raw in table.items():
        if key in COMMANDS:
            values = _sub_table(key, raw, base, prefix)
            if key == command:
                own = values
            continue
        spec = KEYS.get(key)
        try:
            if spec is not None and not spec.shared:
                home = _table_name(prefix, min(spec.commands))
                raise SettingError(key, f"only {_readers(spec)} reads it: put it in {home}")
            field, value = _parsed(key, raw, base)
        except SettingError as error:
            raise TableError(_table_name(prefix), _with_sub_tables(error)) from None
        shared[field] = value
    return dataclasses.replace(Settings(), **{**shared, **own})


def _readers(spec: Key) -> str:
    return " and ".join(command for command in COMMANDS if command in spec.commands)


def _sub_table(command: str, raw: object, base: Path | None, prefix: str) -> dict[str, Any]:
    """The settings of one command's sub-table, each key checked against that command."""
    if not isinstance(raw, dict):
        raise TableError(_table_name(prefix), SettingError(command, "must be a table"))
    values: dict[str, Any] = {}
    for key, raw_value in raw.items():
        spec = key_for(key, command)
        try:
            if spec is not None and command not in spec.commands:
                raise SettingError(key, f"{command} does not read it (only {_readers(spec)})")
            field, value = _parsed(key, raw_value, base, command)
        except SettingError as error:
            raise TableError(_table_name(prefix, command), error) from None
        values[field] = value
    return values


def _with_sub_tables(error: SettingError) -> SettingError:
    """An unknown key's message, also naming the command sub-tables a table may hold."""
    if error.key in KEYS or not error.problem.startswith("unknown key"):
        return error
    tables = ", ".join(f"[{command}]" for command in COMMANDS)
    return SettingError(error.key, f"{error.problem}; sub-tables: {tables}")


def _parsed(
    key: str, raw: object, base: Path | None, command: str | None = None
) -> tuple[str, Any]:
    field, value = parse_setting(key, raw, command)
    if isinstance(value, Path) and base is not None and not value.is_absolute():
        value = base / value
    return field, value


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


def load_config(path: Path, command: str | None = None) -> Settings:
    """The settings in ``path`` for ``command``: its ``[tool.gradaudit]`` table, else its top level.

    A ``pyproject.toml`` (or any file with a ``[tool]`` table) must have
    ``[tool.gradaudit]``; any other TOML file is read as the table itself (and
    its command sub-tables are ``[compare]``, ``[scan]``).
    """
    document = _read(path)
    if path.name == PYPROJECT or "tool" in document:
        table = _table(document, path, required=True) or {}
        prefix = ".".join(TABLE)
    else:
        table, prefix = document, ""
    try:
        settings = settings_from_table(table, base=path.parent, command=command, prefix=prefix)
    except TableError as error:
        raise UsageError(f"{path}: {error}") from None
    return dataclasses.replace(settings, source=path)


def _read(path: Path) -> dict[str, Any]:
    try:
        # Only regular files: opening a FIFO named by --config would block forever.
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            raise UsageError(f"{path}: the config file is not a regular file")
        with path.open("rb") as handle:
            text = handle.read().decode("utf-8")
    except OSError as error:
        raise UsageError(f"{path}: cannot read the config file: {error.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not valid TOML: not UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:
        where = _culprit(text, _DEEP)
        raise UsageError(f"{path}: {where}arrays or tables nested too deeply to read") from None
    except ValueError:
        # tomllib's int() of a literal over sys.get_int_max_str_digits() (4,300) digits.
        where = _culprit(text, _LONG_INTEGER)
        raise UsageError(
            f"{path}: {where}an integer too long to read (numbers must be within ±{MAX_NUMBER:.4g})"
        ) from None


#: What makes tomllib raise something other than TOMLDecodeError, per line: a run of
#: digits too long for int(), and the opening of a deep nest of arrays or inline tables.
_LONG_INTEGER = re.compile(r"[0-9_]{310,}")
_DEEP = re.compile(r"(?:[\[{]\s*(?:[^\s\[{=,\]}]+\s*=\s*)?){50,}")
_KEY_LINE = re.compile(r"\s*([^=#\[]+?)\s*=")


def _culprit(text: str, pattern: re.Pattern[str]) -> str:
    """``"line N: KEY: "`` for the first line ``pattern`` matches, else ``""``.

    tomllib gives no position for these two failures; the key they sit under
    is what the user needs to find and fix, so it is looked for by line.
    """
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.search(line):
            key = _KEY_LINE.match(line)
            return f"line {number}: {key.group(1).strip()}: " if key else f"line {number}: "
    return ""


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


def resolve(
    cli: Settings,
    *,
    config: Path | None = None,
    no_config: bool = False,
    command: str | None = None,
) -> Settings:
    """The settings that apply to ``command``: the config file's, overridden by the flags."""
    if no_config and config is not None:
        raise UsageError("--config and --no-config cannot be combined")
    if no_config:
        return cli
    path = config if config is not None else find_config()
    if path is None:
        return cli
    return load_config(path, command).overridden_by(cli)
