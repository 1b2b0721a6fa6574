"""Renderers: a scan :class:`Report`, a :class:`Comparison` or a :class:`TrendReport` in,
text out; one module per format in :mod:`gradaudit.report.formats`."""

from __future__ import annotations

from gradaudit.report.base import Renderers, RenderOptions
from gradaudit.report.formats import OutputFormat, render, render_text, renderers

__all__ = [
    "OutputFormat",
    "RenderOptions",
    "Renderers",
    "render",
    "render_text",
    "renderers",
]
