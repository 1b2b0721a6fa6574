"""Files in, pending device stats out: one routine reads a file into a :class:`PendingStats`.

A scan labels every tensor with its file's path; ``compare`` labels each with a
side (``host``/``seed``), chosen by name prefix when both sides share one file.
Both go through :func:`read_file`, which differs only in its :class:`Routing`,
so a reader's item (a run, a tensor, pieces, a skip) is handled in one place.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from gradaudit.engine.kernels import Engine
from gradaudit.engine.options import FROM_FILES, EngineOptions, choose
from gradaudit.engine.stats import DEFAULT_MEMORY_BUDGET
from gradaudit.errors import InputError
from gradaudit.io import Excluded, open_source
from gradaudit.io.base import Pieces, RunItem, RunSource, TensorRun
from gradaudit.io.discover import expand_inputs
from gradaudit.policy import Thresholds
from gradaudit.results import InputProblem, Report, Skipped
from gradaudit.scan.pending import PendingStats
from gradaudit.selection import NameFilter


class Routing(Protocol):
    """Which source label each tensor of a file is collected under."""

    @property
    def labels(self) -> tuple[str, ...]:
        """The labels the file's metadata evidence is recorded under (every route's)."""
        ...

    def route(self, name: str) -> str | Skipped:
        """The label of the tensor ``name``, or why it is left out."""
        ...

    @property
    def whole(self) -> str | None:
        """The label of every tensor of the file when no name is routed (else ``None``):
        the file is then read as runs of tensors, like a scan's, with no call per name."""
        ...


def read_file(
    pending: PendingStats,
    path: str,
    select: Callable[[str], bool] | None = None,
    progress: Callable[[int], None] | None = None,
    routing: Routing | None = None,
) -> InputProblem | None:
    """Collect one file's tensors under ``routing``'s labels (default: the path); return its
    problem if it fails.

    The file is collected into a :meth:`~PendingStats.child` and absorbed only when
    it was read to the end, so a file that fails half-way leaves no partial rows.
    ``select`` keeps tensors by name; ``progress`` hears each tensor's bytes.
    """
    part = pending.child()
    try:
        source = open_source(path)
        for label in (path,) if routing is None else routing.labels:
            hints = part.read_hints(source, label)
        whole = path if routing is None else routing.whole
        stream: Iterator[RunItem] = (
            source.runs()
            if select is None and not hints and isinstance(source, RunSource)
            else source.items(select)
        )
        for item in stream:
            if isinstance(item, TensorRun):
                if whole is not None:
                    part.queue_run(item, whole)
                else:
                    assert routing is not None
                    _queue_routed(part, item, routing)
                if progress is not None:
                    progress(item.data.numel())
                continue
            if routing is None:
                label = path
            else:
                routed = routing.route(item.name if not isinstance(item, tuple) else item[0])
                if isinstance(routed, Skipped):
                    part.skip(routed)
                    continue
                label = routed
            if isinstance(item, Excluded):
                part.exclude(label)
            elif isinstance(item, Skipped):
                part.skip(dataclasses.replace(item, source=label))
            elif isinstance(item, Pieces):
                part.add_pieces(
                    item.name, item.shape, item.dtype, item.load(), label, hints.get(item.name)
                )
                if progress is not None:
                    progress(math.prod(item.shape) * item.dtype.itemsize)
            else:
                name, tensor = item
                part.queue_with_hint(name, tensor, label, hints.get(name))
                if progress is not None:
                    progress(tensor.numel() * tensor.element_size())
        part.settle()
        # Only now has every byte been read: a file that changed meanwhile is an error.
        source.check_unchanged()
    except InputError as error:
        return InputProblem(path, error.cause)
    pending.absorb(part)
    return None


def _queue_routed(part: PendingStats, run: TensorRun, routing: Routing) -> None:
    """A run whose tensors go to different labels: each stretch of one label queued as a
    run of its own, each name that no label takes skipped, in the file's order."""
    routes = list(map(routing.route, run.names))
    labels = [route if isinstance(route, str) else None for route in routes]
    start = 0
    for label, stretch in itertools.groupby(labels):
        stop = start + sum(1 for _ in stretch)
        if label is not None:
            part.queue_run(run.part(start, stop), label)
        else:
            for skipped in routes[start:stop]:
                assert isinstance(skipped, Skipped)
                part.skip(skipped)
        start = stop


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
    tensor's exponent histogram (:mod:`gradaudit.precision`; one extra pass per tensor).
    ``options`` may replace the four engine keywords (see :class:`EngineOptions`).
    """
    selection = NameFilter(tuple(include), tuple(exclude))
    keywords = EngineOptions(device, chunk_elements, engine, memory_budget)
    pending = PendingStats(options=choose(options, keywords, FROM_FILES), histograms=histograms)
    for entry in expand_inputs(paths, recursive=recursive):
        pending.add_input(entry, selection if selection.active else None, progress)
    return pending.materialize(thresholds)
