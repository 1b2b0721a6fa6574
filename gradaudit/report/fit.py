"""Fitting a table into the width a person has: names win, numbers are never cut.

Rich, left alone, shares a narrow terminal between columns by folding every
cell a little: names break into five-character pieces (or vanish at 80
columns) and numbers lose digits. A reader needs the opposite: the name of the
flagged tensor and its numbers, whole. So every table of a human format is
described as :class:`Column` specs and laid out here, before Rich sees it:

1. every column wants its natural width (its widest cell or header);
2. while the table does not fit and the name column would have to give up
   cells, the droppable column of the lowest priority is left out (its header
   is listed so the renderer can say what is hidden and how to see it);
3. the name column gets what is left and each name too long for it is
   shortened from the left, keeping the distinguishing end
   (``…layer.0.attention.self.key.bias``); other columns are never cut, and
   Rich is told so (``no_wrap``, fixed widths).

Adding a column to a table (a role, a device) is one more :class:`Column` in
the renderer's list, with a priority that says how early it may be dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from rich.table import Table
from rich.text import Text

#: A width below this (or above ``MAX_WIDTH``) is not a real terminal's: use the default.
MIN_WIDTH = 40
MAX_WIDTH = 1000
DEFAULT_WIDTH = 120
#: The name column never gets fewer cells than this while another column could give way.
MIN_NAME_CELLS = 16
#: Droppable columns go before a name is shortened below this share of the width.
NAME_SHARE = 0.6
#: A prose column (messages, findings) wraps at spaces but keeps at least this many cells.
MIN_PROSE_CELLS = 24
#: Columns never dropped.
KEEP = 1_000_000

Cell = Text | str


def sane_width(width: int | None) -> int:
    """``width`` if it is a plausible terminal width, else :data:`DEFAULT_WIDTH`.

    A pseudo-terminal can report 0 columns (``script -qc … /dev/null``), and
    ``COLUMNS`` can hold anything; Rich renders nothing at width 0.
    """
    if width is None or width <= 0 or width > MAX_WIDTH:
        return DEFAULT_WIDTH
    return max(width, MIN_WIDTH)


def shorten_left(text: str, cells: int) -> str:
    """``text`` in at most ``cells`` characters, cut on the left: ``…self.key.bias``.

    The end of a parameter name says what it is (``key.bias``) while its
    beginning is shared by many rows (``encoder.layer.``), so the beginning goes.
    The cut moves to the next ``.`` when that costs at most a third of the room,
    so the shown part starts at a component boundary. The last numeric
    component (the layer index in ``encoder.layer.3.output.dense.weight``) is
    what tells such rows apart, so when the plain cut would lose it, it is kept
    and the middle is elided instead: ``…3.…dense.weight``.
    """
    if len(text) <= cells:
        return text
    if cells <= 1:
        return "…"[:cells]
    tail = _tail(text, cells - 1)
    index = _last_index(text)
    if index is None or len(text) - len(tail) <= index[0]:
        return "…" + tail
    start, stop = index
    head = "…" + text[start:stop] + ".…"
    room = cells - len(head)
    if room < 4:
        return "…" + tail
    return head + _tail(text[stop + 1 :], room)


def shorten_path(path: str, cells: int) -> str:
    """A file path in at most ``cells`` characters, cut on the left at a ``/`` when cheap.

    The file's own name is what tells inputs apart (``step_12.safetensors``);
    the directories above it go first, and a name is cut on characters, not at
    its dots (``hostseed.safetensors`` must not become ``…safetensors``).
    """
    if len(path) <= cells:
        return path
    if cells <= 1:
        return "…"[:cells]
    tail = path[len(path) - (cells - 1) :]
    slash = tail.find("/")
    if 0 <= slash < (cells - 1) // 2 and slash + 1 < len(tail):
        tail = tail[slash + 1 :]
    return "…" + tail


def _tail(text: str, cells: int) -> str:
    """The last ``cells`` characters, moved to a component boundary when that is cheap."""
    if len(text) <= cells:
        return text
    tail = text[len(text) - cells :]
    if text[len(text) - cells - 1] == ".":
        return tail
    dot = tail.find(".")
    if 0 <= dot < cells // 3 and dot + 1 < len(tail):
        return tail[dot + 1 :]
    return tail


def _last_index(text: str) -> tuple[int, int] | None:
    """Start and end of the last all-digit dot-separated component, if any but the last."""
    parts = text.split(".")
    position = len(text)
    for part in reversed(parts):
        position -= len(part)
        if part.isdigit() and position + len(part) < len(text):
            return position, position + len(part)
        position -= 1
    return None


@dataclass(frozen=True)
class Column:
    """One column of a fitted table: its cells and how it may give way.

    ``kind="name"`` marks the one column that is shortened from the left to
    fit; ``kind="prose"`` (messages, lists of findings) wraps at spaces within
    at least :data:`MIN_PROSE_CELLS`; every other column keeps its natural
    width or is dropped whole.
    ``priority``: lower is dropped earlier; :data:`KEEP` is never dropped.
    """

    header: str
    cells: Sequence[Cell]
    justify: Literal["left", "right", "center"] = "left"
    kind: Literal["name", "fixed", "prose"] = "fixed"
    priority: int = KEEP
    style: str = field(default="")
    #: A prose column wraps down to this many cells (or its header's width).
    min_cells: int = MIN_PROSE_CELLS

    @property
    def natural(self) -> int:
        return max([len(self.header), *(_cell_len(c) for c in self.cells)])

    @property
    def least(self) -> int:
        """The fewest cells the column can live with: prose wraps, the rest does not."""
        if self.kind == "prose":
            return min(self.natural, max(self.min_cells, len(self.header)))
        return self.natural


def _cell_len(cell: Cell) -> int:
    """The widest line of a cell (a cell may hold one item per line)."""
    text = cell if isinstance(cell, Text) else Text(cell)
    return max((line.cell_len for line in text.split("\n")), default=0)


@dataclass(frozen=True)
class Layout:
    """What :func:`fit` decided: the columns kept (name cells shortened) and those left out."""

    columns: tuple[Column, ...]
    dropped: tuple[str, ...]
    #: Cells given to each kept column, in order.
    widths: tuple[int, ...]


def _overhead(columns: int) -> int:
    """Border and padding cells of a boxed Rich table with ``columns`` columns."""
    return 3 * columns + 1


def fit(columns: Sequence[Column], width: int) -> Layout:
    """Choose the columns and their widths so that the table fits ``width`` (see the module)."""
    kept = list(columns)
    name = next((c for c in kept if c.kind == "name"), None)
    dropped: list[str] = []

    def room() -> int:
        least = sum(c.least for c in kept if c is not name)
        return width - _overhead(len(kept)) - least

    wanted = 0
    if name is not None:
        wanted = min(name.natural, max(MIN_NAME_CELLS, int(width * NAME_SHARE)))
    while room() < wanted:
        droppable = [c for c in kept if c.priority < KEEP and c is not name]
        if not droppable:
            break
        victim = min(droppable, key=lambda c: c.priority)
        kept.remove(victim)
        dropped.append(victim.header)
    spare = room()
    name_cells = 0
    if name is not None:
        name_cells = min(name.natural, max(MIN_NAME_CELLS, spare))
        spare -= name_cells
    widths = []
    for column in kept:
        if column is name:
            widths.append(name_cells)
        elif column.kind == "prose":
            extra = max(0, min(column.natural - column.least, spare))
            spare -= extra
            widths.append(column.least + extra)
        else:
            widths.append(column.natural)
    kept = [_shortened(c, name_cells) if c is name else c for c in kept]
    return Layout(tuple(kept), tuple(dropped), tuple(widths))


def _shortened(column: Column, cells: int) -> Column:
    out: list[Cell] = []
    for cell in column.cells:
        if isinstance(cell, Text):
            if cell.cell_len > cells:
                short = Text(shorten_left(cell.plain, cells), style=cell.style)
                cell = short
            out.append(cell)
        else:
            out.append(shorten_left(cell, cells))
    return replace(column, cells=tuple(out))


def fitted_table(
    columns: Sequence[Column],
    width: int,
    *,
    title: str | None = None,
    sections: Sequence[int] = (),
) -> tuple[Table, Layout]:
    """A Rich table of ``columns`` laid out by :func:`fit`; ``sections``: rows followed by a rule.

    Every column is ``no_wrap`` at a fixed width, so Rich neither folds nor
    squeezes it: what :func:`fit` decided is what is printed.
    """
    layout = fit(columns, width)
    table = Table(
        title=title, header_style="bold", title_justify="left", expand=False, show_lines=False
    )
    for column, cells in zip(layout.columns, layout.widths, strict=True):
        table.add_column(
            column.header if len(column.header) <= cells else shorten_left(column.header, cells),
            justify=column.justify,
            no_wrap=column.kind != "prose",
            overflow="fold" if column.kind == "prose" else "ellipsis",
            width=cells,
            min_width=cells,
            style=column.style or None,
        )
    rows = max((len(c.cells) for c in layout.columns), default=0)
    for index in range(rows):
        table.add_row(
            *(c.cells[index] if index < len(c.cells) else "" for c in layout.columns),
            end_section=index in sections,
        )
    return table, layout


def dropped_note(layout: Layout, how: str = "--format json shows every value") -> Text | None:
    """``columns left out at this width: rms, zero % (…)``, or ``None`` when none was."""
    if not layout.dropped:
        return None
    return Text(
        f"left out at this width: {', '.join(layout.dropped)} (a wider terminal or {how})",
        style="dim",
    )
