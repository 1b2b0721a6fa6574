"""Renderers: a :class:`Report` in, text out; one module per output format."""

from __future__ import annotations

from gradaudit.report.base import Formatter, RenderOptions
from gradaudit.report.formats import OutputFormat

__all__ = ["Formatter", "OutputFormat", "RenderOptions"]
