"""Renderers: a :class:`Report` or a :class:`Comparison` in, text out; one module per format."""

from __future__ import annotations

from gradaudit.report.base import ComparisonFormatter, Formatter, RenderOptions
from gradaudit.report.compare_formats import comparison_formatter
from gradaudit.report.formats import OutputFormat

__all__ = [
    "ComparisonFormatter",
    "Formatter",
    "OutputFormat",
    "RenderOptions",
    "comparison_formatter",
]
