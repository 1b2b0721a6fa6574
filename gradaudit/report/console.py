"""The one way a text renderer gets a Rich console: into a string, never the terminal."""

from __future__ import annotations

from typing import TextIO

from rich.console import Console

from gradaudit.report.base import RenderOptions
from gradaudit.report.fit import sane_width


def string_console(buffer: TextIO, options: RenderOptions) -> Console:
    """A console writing into ``buffer`` at the options' width and colour.

    Markup, highlighting and emoji are off: every cell is a ``Text`` or a plain
    string, and names from files must never be interpreted.
    """
    return Console(
        file=buffer,
        width=sane_width(options.width),
        force_terminal=options.color,
        no_color=not options.color,
        color_system="standard" if options.color else None,
        highlight=False,
        markup=False,
        emoji=False,
        legacy_windows=False,
    )
