"""Files in, pending device stats out: :func:`scan_paths`, each file read by
:func:`gradaudit.scan.reading.read_file` into one :class:`PendingStats`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from gradaudit.engine.kernels import Engine
from gradaudit.engine.options import FROM_FILES, EngineOptions, choose
from gradaudit.engine.stats import DEFAULT_MEMORY_BUDGET
from gradaudit.io.discover import expand_inputs
from gradaudit.policy import Thresholds
from gradaudit.results import Report
from gradaudit.scan.pending import PendingStats
from gradaudit.selection import NameFilter


def scan_paths(
    paths: Sequence[str | os.PathLike[str]],
    *,
    thresholds: Thresholds | None = None,
    device: torch.device | str | None = "auto",
    chunk_elements: int | None = None,
    engine: Engine | str = Engine.AUTO,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: Callable[[int], None] | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    recursive: bool = False,
    histograms: bool = False,
    options: EngineOptions | None = None,
) -> Report:
    """Audit files and directories one tensor at a time.

    A bad input is recorded and the others are still audited. Directories are searched for
    checkpoint files (``recursive`` descends); ``include``/``exclude`` are glob patterns on
    tensor names (see :class:`gradaudit.selection.NameFilter`). ``progress`` is called with
    the byte size of each tensor once it is queued. ``histograms`` also collects each
    tensor's exponent histogram (:mod:`gradaudit.precision`): in the same read as its row
    for a CPU tensor the native kernel takes, one extra pass per tensor for the others.
    ``options`` may replace the four engine keywords (see :class:`EngineOptions`).
    """
    selection = NameFilter(tuple(include), tuple(exclude))
    keywords = EngineOptions(device, chunk_elements, engine, memory_budget)
    pending = PendingStats(options=choose(options, keywords, FROM_FILES), histograms=histograms)
    for entry in expand_inputs(paths, recursive=recursive):
        pending.add_input(entry, selection if selection.active else None, progress)
    return pending.materialize(thresholds)
