"""Each setting's parser: a raw value (from a TOML file or a flag) to a typed, checked one,
or a ``ValueError`` whose message says what was expected.

Apart from :mod:`gradaudit.cli.config`, which says which key a parser serves, where the
file is and how its tables combine: what one value may be is this module's job, the same
for the file and the flags. The bounds of every number live here, once
(:func:`number`), so no key can forget them.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path, PurePath
from typing import Any

from gradaudit.engine.options import Engine
from gradaudit.policy import (
    FindingKind,
    InputKind,
    PolicyError,
    check_cast_target,
    check_ignore_pattern,
    check_kind,
    parse_fail_on,
    parse_kinds,
)
from gradaudit.report.output_format import OutputFormat
from gradaudit.results.trend import TrendKind


def number(raw: object) -> float:
    """Every number a setting holds, from a file or a flag: a float64, and finite.

    The bound lives here, once, so no key can forget it: an integer beyond
    float64's range (over 309 digits) would otherwise crash ``float()``, and
    an infinity (TOML's ``inf``, or a flag like ``1e999`` that float parsing
    rounds up) turns a gate into one that never or always fires. NaN is left
    to each key's own range check, which names the range it needs.
    """
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"expected a number, got {described(raw)}")
    try:
        value = float(raw)
    except OverflowError:
        raise ValueError(
            f"out of range: {described(raw)} (numbers must be within ±{MAX_NUMBER:.4g})"
        ) from None
    if math.isinf(value):
        raise ValueError(f"must be a finite number (got {value!r})")
    return value


#: The largest magnitude a number setting may have (float64's).
MAX_NUMBER = sys.float_info.max
#: Integers shown whole in messages; longer ones are described by their length.
_SHOWN_DIGITS = 20


def boolean(raw: object) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"expected true or false, got {described(raw)}")
    return raw


def string(raw: object) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a string, got {described(raw)}")
    return raw


def strings(raw: object) -> list[str]:
    """A string or a list of strings (``fail-on = "nan,inf"`` or ``["nan", "inf"]``)."""
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return list(raw)
    raise ValueError(f"expected a string or a list of strings, got {described(raw)}")


def described(raw: object) -> str:
    if type(raw) is int and abs(raw) >= 10**_SHOWN_DIGITS:
        # repr() of a 5,000-digit integer raises; a 300-digit one helps no reader.
        return f"an integer of {_digits(raw)} digits"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    for kind, name in names.items():
        if type(raw) is kind:
            return f"{name} ({raw!r})"
    if isinstance(raw, list | tuple):
        return "a list"
    if isinstance(raw, dict):
        return "a table"
    return type(raw).__name__


def _digits(value: int) -> int:
    """The decimal digits of ``value``, without ``str()`` (which refuses over 4,300)."""
    digits = max(1, math.floor(abs(value).bit_length() * math.log10(2)) + 1)
    return digits - 1 if abs(value) < 10 ** (digits - 1) else digits


def choice(enum: type[OutputFormat] | type[Engine]) -> Callable[[object], Any]:
    def parse(raw: object) -> Any:
        text = string(raw)
        try:
            return enum(text.strip().lower())
        except ValueError:
            allowed = ", ".join(member.value for member in enum)
            raise ValueError(f"unknown value {text!r} (choose from {allowed})") from None

    return parse


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?", re.IGNORECASE)


def device_name(raw: object) -> str:
    text = string(raw).strip()
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"unknown device {text!r} (use auto, cpu, cuda or cuda:N)")
    return text


def checked(check: Callable[[float], float]) -> Callable[[object], float]:
    def parse(raw: object) -> float:
        try:
            return check(number(raw))
        except PolicyError as error:
            raise ValueError(error.problem) from None

    return parse


def fail_on_kinds(raw: object) -> frozenset[FindingKind]:
    try:
        return parse_fail_on(strings(raw))
    except PolicyError as error:
        raise ValueError(error.problem) from None


def ignore_patterns(raw: object) -> tuple[str, ...]:
    try:
        return tuple(check_ignore_pattern(p) for p in strings(raw))
    except PolicyError as error:
        raise ValueError(error.problem) from None


def input_kind(raw: object) -> InputKind:
    try:
        return check_kind(string(raw))
    except PolicyError as error:
        raise ValueError(error.problem) from None


def cast_target(raw: object) -> str:
    try:
        return check_cast_target(string(raw))
    except PolicyError as error:
        raise ValueError(error.problem) from None


def spike_factor(raw: object) -> float:
    value = number(raw)
    if not 1.0 < value < math.inf:
        raise ValueError(f"must be a finite number above 1 (got {value:g})")
    return value


def trend_fail_on(raw: object) -> frozenset[TrendKind]:
    """trend's ``fail-on``: ``nonfinite``, ``spike``, ``collapse``, ``all`` or ``none``."""
    return parse_kinds(",".join(strings(raw)), TrendKind)


def output_path(raw: object) -> Path:
    text = str(raw) if isinstance(raw, PurePath) else string(raw)
    if not text.strip():
        raise ValueError("expected a file name, got an empty string")
    if "\0" in text:
        # No file name can hold one: every os call on it would raise ValueError.
        raise ValueError("a file name cannot hold a NUL byte")
    return Path(text)
