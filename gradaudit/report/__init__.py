"""Renderers: a scan :class:`Report`, a :class:`Comparison` or a :class:`TrendReport` in,
text out; one module per format in :mod:`gradaudit.report.formats`.

The names below resolve on first use (PEP 562): importing a module of this package
(the CLI's start-up imports :mod:`gradaudit.report.output_format`, :mod:`~.base`,
:mod:`~.text`) must not import every renderer, and with them numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradaudit.report.base import Renderers, RenderOptions
    from gradaudit.report.formats import render, render_text, renderers
    from gradaudit.report.output_format import OutputFormat

__all__ = [
    "OutputFormat",
    "RenderOptions",
    "Renderers",
    "render",
    "render_text",
    "renderers",
]

_HOMES = {
    "OutputFormat": "gradaudit.report.output_format",
    "RenderOptions": "gradaudit.report.base",
    "Renderers": "gradaudit.report.base",
    "render": "gradaudit.report.formats",
    "render_text": "gradaudit.report.formats",
    "renderers": "gradaudit.report.formats",
}

if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        if name not in _HOMES:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
