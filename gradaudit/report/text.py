"""Turning untrusted names and raw numbers into safe, compact text."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable

from gradaudit.results import InputProblem

# Categories that can move the cursor, hide text or reorder it on a terminal:
# control characters, format characters (bidi overrides, zero-width), separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def printable(name: str, *, backslash: bool = True) -> str:
    """Escape every character of ``name`` that a terminal would interpret.

    Tensor names come from files written by strangers; an escape sequence or a
    bidi override in a name must show up as text, not restyle the screen. A
    backslash is doubled so that ``\\x1b`` in a name and an escaped ESC differ;
    ``backslash=False`` leaves it single where doubling would show (a Markdown
    code span renders backslashes literally).
    """
    if name.isprintable() and "\\" not in name:
        return name
    out = []
    for char in name:
        if char == "\\" and backslash:
            out.append("\\\\")
        elif unicodedata.category(char) in _UNSAFE_CATEGORIES:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


def number(value: float | None) -> str:
    """A compact, fixed-precision rendering of a statistic (3 significant digits)."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def count(value: int) -> str:
    return f"{value:,}"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def layer_label(name: str) -> str:
    """A layer name that cannot be read as a count: ``'0'`` for ``nn.Sequential``'s layer 0.

    In prose (``spike in 0``, ``nonfinite 2``) a bare number reads like a count;
    names without a letter are quoted. Other names are only made printable.
    """
    shown = printable(name)
    return shown if any(c.isalpha() for c in name) else f"'{shown}'"


def internal_note(errors: Iterable[InputProblem]) -> str:
    """`` (1 by an internal error: a bug in gradaudit)`` when a defect cost an input."""
    internal = sum(1 for problem in errors if problem.internal)
    return f" ({internal} by an internal error: a bug in gradaudit)" if internal else ""
