"""A Rich progress bar on stderr for scans that take more than a moment."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: Below this many input bytes a scan is over before a bar would be readable.
AUTO_PROGRESS_BYTES = 256 * 1024 * 1024

Advance = Callable[[int], None]


def input_bytes(paths: Sequence[str | Path], *, recursive: bool = False) -> int:
    """Total size of the files a scan will read (directories expanded, index shards counted).

    Only an estimate for the bar: unreadable inputs count as 0.
    """
    from gradaudit.io import expand_inputs  # numpy: only once a command runs
    from gradaudit.io.discover import BadInput, SkippedPath  # numpy: as above

    total = 0
    for entry in expand_inputs(paths, recursive=recursive):
        if isinstance(entry, BadInput | SkippedPath):
            continue
        files = [Path(entry.path)]
        if entry.path.endswith(".index.json"):
            files = list(Path(entry.path).parent.glob("*.safetensors"))
        for file in files:
            try:
                total += os.stat(file).st_size
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
    # Start-up: most runs draw no bar (small inputs, pipes, machine formats).
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

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
