"""Renderers: the table at a fixed width against a golden file, JSON strictness, the format map."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.formats.json import encode_float
from gradaudit.report.text import number, printable
from tests.samples import sample_report


def test_table_golden(golden: Callable[[str, str], None]) -> None:
    text = render_text(sample_report(), OutputFormat.TABLE, RenderOptions(width=120, color=False))
    golden("table_120.txt", text)


def test_table_without_color_has_no_escape_codes() -> None:
    text = render_text(sample_report(), OutputFormat.TABLE, RenderOptions(width=100, color=False))
    assert "\x1b" not in text
    colored = render_text(sample_report(), OutputFormat.TABLE, RenderOptions(width=100, color=True))
    assert "\x1b[" in colored


def test_every_output_format_has_a_formatter() -> None:
    report = sample_report()
    for fmt in OutputFormat:
        text = render_text(report, fmt, RenderOptions())
        assert text.endswith("\n")
        assert len(text) > 100


def test_json_is_strict_for_every_value() -> None:
    doc = json.loads(
        render_text(sample_report(), OutputFormat.JSON, RenderOptions()),
        parse_constant=lambda token: pytest.fail(f"non-standard token {token}"),
    )
    assert doc["summary"]["tensors"] == 6
    assert doc["summary"]["skipped"] == 1


@pytest.mark.parametrize(
    ("value", "encoded"),
    [(1.5, 1.5), (None, None), (math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")],
)
def test_encode_float(value: float | None, encoded: object) -> None:
    assert encode_float(value) == encoded


def test_printable_escapes_terminal_controls_only() -> None:
    assert printable("layer.0.weight") == "layer.0.weight"
    assert printable("naïve.权重") == "naïve.权重"
    assert printable("a\nb\x1b\x7f") == "a\\x0ab\\x1b\\x7f"
    assert printable("x\u202ey\u200b") == "x\\u202ey\\u200b"
    assert printable("back\\slash") == "back\\\\slash"


def test_number_formatting() -> None:
    assert [number(v) for v in (None, 0.0, 1234.5, 1e-9, math.inf, math.nan)] == [
        "-",
        "0",
        "1.23e+03",
        "1e-09",
        "inf",
        "nan",
    ]
