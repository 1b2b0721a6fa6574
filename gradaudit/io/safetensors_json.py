"""The JSON of a safetensors header, parsed so that nothing the library would hide stays hidden.

``json.loads`` keeps the last of two equal keys, reads ``NaN`` and ``-0`` and lone
surrogates; the safetensors library refuses some of these and silently resolves others.
Objects are kept here as their raw pairs (:class:`JsonObject`) so each context can name
its own duplicate, and every problem is a :class:`Refused` with a one-line cause, which
:mod:`gradaudit.io.safetensors_header` turns into an :class:`~gradaudit.errors.InputError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NoReturn

from gradaudit.io.files import SHOW_LIMIT, show

METADATA_KEY = "__metadata__"


class Refused(Exception):
    """Inside the io package: the content is not acceptable; carries the one-line cause."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class JsonObject(tuple[tuple[str, Any], ...]):
    """A JSON object as its raw key/value pairs, so duplicate keys stay visible.

    ``json.loads`` would build a dict and keep the last duplicate silently, as the
    safetensors library does; keeping the pairs lets each context (tensor names, metadata
    keys, entry fields) name its own duplicate.

    A tuple subclass with no Python ``__init__``: ``json`` calls the hook once per
    object, and a constructor that runs Python code made parsing a header of
    thousands of tensors several times slower.
    """

    __slots__ = ()

    @property
    def pairs(self) -> tuple[tuple[str, Any], ...]:
        return self


def show_value(value: Any) -> str:
    """Render a JSON value for a message, bounded in length."""
    if isinstance(value, JsonObject):
        return "an object"
    if isinstance(value, str):
        return show(value)
    text = json.dumps(value)
    return text if len(text) <= SHOW_LIMIT else text[:SHOW_LIMIT] + "..."


def json_type(value: Any) -> str:
    """Name a parsed JSON value's type the way the JSON spec does."""
    if isinstance(value, JsonObject):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "null"


def _reject_constant(name: str) -> NoReturn:
    """``json`` hook: refuse ``NaN``/``Infinity``, which are not JSON and the library refuses."""
    raise Refused(f"header is not valid JSON ({name} is not a JSON value)")


def _parse_int(text: str) -> int | float:
    """``json`` hook: keep ``-0`` distinct from ``0``.

    Python reads ``-0`` as the integer 0, the library reads it as the float -0.0 and
    refuses it as an offset or dimension; returning a float makes it fail here as well.
    The hook costs a Python call per number, so :func:`parse_json` only uses it
    when the text contains ``-0`` at all.
    """
    return -0.0 if text == "-0" else int(text)


def parse_json(text: str) -> Any:
    """Parse the header text, keeping objects as :class:`JsonObject` pair lists."""
    try:
        return json.loads(
            text,
            object_pairs_hook=JsonObject,
            parse_constant=_reject_constant,
            parse_int=_parse_int if "-0" in text else None,
        )
    except RecursionError:
        raise Refused("header is not valid JSON (nested too deeply)") from None
    except json.JSONDecodeError as error:
        raise Refused(f"header is not valid JSON ({error.msg} at byte {error.pos})") from None
    except ValueError:
        # int() refuses numbers with thousands of digits; nothing else raises it here.
        raise Refused("header is not valid JSON (a number is far too long)") from None


def check_text(text: str, what: str) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (from a ``\\ud800`` escape).

    Python's ``json`` accepts it, the library's JSON parser does not, so a name like that
    would pass here and then fail in the library.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused(f"{what} holds an invalid \\u escape (a lone surrogate)") from None


def unique_pairs(obj: JsonObject, duplicate: Callable[[str], str]) -> dict[str, Any]:
    """Turn an object's pairs into a dict, refusing a repeated key.

    ``duplicate`` builds the message from the quoted key. A function rather than a
    ``str.format`` template: the message may hold a tensor name from the file, and braces
    in it must not be read as format fields.
    """
    result: dict[str, Any] = {}
    for key, value in obj.pairs:
        if key in result:
            raise Refused(duplicate(show(key)))
        result[key] = value
    return result


def parse_metadata(value: Any) -> dict[str, str]:
    """Validate ``__metadata__``: a string-to-string object (``null`` means absent).

    ``null`` is accepted because the library accepts it (its field is an ``Option``).
    """
    if value is None:
        return {}
    if not isinstance(value, JsonObject):
        raise Refused(f"__metadata__ is not a JSON object (got {json_type(value)})")
    metadata = unique_pairs(
        value,
        lambda key: (
            f"duplicate key {key} in __metadata__"
            " (the safetensors library would keep only the last)"
        ),
    )
    for key, item in metadata.items():
        check_text(key, "a __metadata__ key")
        if not isinstance(item, str):
            raise Refused(
                f"__metadata__ value for {show(key)} is not a string (got {json_type(item)})"
            )
        check_text(item, f"__metadata__ value for {show(key)}")
    return metadata
