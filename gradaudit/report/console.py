"""The one way a text renderer gets a Rich console: into a string, never the terminal."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import TextIO

from rich.console import Console, RenderableType

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


def printed(renderables: Iterable[RenderableType], options: RenderOptions) -> Iterator[str]:
    """Each renderable's text as soon as it is printed, for a renderer that yields chunks.

    One console prints them all into one buffer, emptied after each: the text is
    what printing them one after the other into a single string would give.
    """
    buffer = io.StringIO()
    console = string_console(buffer, options)
    for renderable in renderables:
        console.print(renderable)
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
