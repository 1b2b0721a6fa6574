"""One way to build the Rich console every text renderer prints into.

Renderers return strings: they print into a buffer at the width and colour the
CLI chose, with markup, highlighting and emoji off so that names from files are
shown literally.
"""

from __future__ import annotations

from typing import TextIO

from rich.console import Console

from gradaudit.report.base import RenderOptions


def buffer_console(buffer: TextIO, options: RenderOptions) -> Console:
    """A console writing to ``buffer`` at ``options.width``, coloured only if asked."""
    return Console(
        file=buffer,
        width=options.width,
        force_terminal=options.color,
        no_color=not options.color,
        color_system="standard" if options.color else None,
        highlight=False,
        markup=False,
        emoji=False,
        legacy_windows=False,
    )
