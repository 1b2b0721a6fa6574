"""A Rich progress bar on stderr for scans that take more than a moment."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

#: Below this many input bytes a scan is over before a bar would be readable.
AUTO_PROGRESS_BYTES = 256 * 1024 * 1024

Advance = Callable[[int], None]


def input_bytes(paths: Sequence[str | Path]) -> int:
    """Total size of the regular files among ``paths`` (others count as 0)."""
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_size
        except OSError:
            continue
    return total


def wants_progress(requested: bool | None, machine_output: bool, total: int) -> bool:
    """``--progress``/``--no-progress`` win; by default only on a terminal, never for JSON."""
    if requested is not None:
        return requested
    return not machine_output and sys.stderr.isatty() and total >= AUTO_PROGRESS_BYTES


@contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Advance | None]:
    """Yield a callback advancing the bar by bytes audited, or ``None`` when disabled."""
    if not enabled:
        yield None
        return
    console = Console(stderr=True, highlight=False, markup=False)
    columns = (
        TextColumn("auditing"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("scan", total=max(total, 1))
        yield lambda nbytes: bar.advance(task, nbytes)
