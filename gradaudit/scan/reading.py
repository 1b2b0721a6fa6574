"""One file into a :class:`~gradaudit.scan.pending.PendingStats`: the one routine that
reads a reader's items (a run, a tensor, pieces, a skip) into pending device stats.

A scan labels every tensor with its file's path; ``compare`` labels each with a
side (``host``/``seed``), chosen by name prefix when both sides share one file.
Both go through :func:`read_file`, which differs only in its :class:`Routing`.
Apart from :mod:`gradaudit.scan.paths` (``scan_paths``, which makes a PendingStats):
``PendingStats.read_file`` calls this, so the two import in one direction.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from gradaudit.errors import OutputError, UsageError
from gradaudit.io import Excluded, open_source
from gradaudit.io.base import Pieces, RunItem, RunSource, TensorRun
from gradaudit.results import InputProblem, Skipped
from gradaudit.scan.boundary import guarded, problem_of, reading
from gradaudit.scan.collected import Routing

if TYPE_CHECKING:  # PendingStats calls read_file: its type only, no import cycle
    from gradaudit.scan.pending import PendingStats


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
        with reading(path):  # the reader's calls: see gradaudit.scan.boundary
            source = open_source(path)
            for label in (path,) if routing is None else routing.labels:
                hints = part.read_hints(source, label)
            stream: Iterator[RunItem] = (
                source.runs()
                if select is None and not hints and isinstance(source, RunSource)
                else source.items(select)
            )
        whole = path if routing is None else routing.whole
        for item in guarded(path, stream):
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
                with reading(path):
                    pieces = item.load()
                part.add_pieces(
                    item.name,
                    item.shape,
                    item.dtype,
                    guarded(path, pieces),
                    label,
                    hints.get(item.name),
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
        with reading(path):
            source.check_unchanged()
    except (UsageError, OutputError):
        raise  # the run's, not this input's (an unavailable device, a closed stream)
    except Exception as error:  # noqa: BLE001 - the per-input boundary (scan.boundary)
        return problem_of(path, error)
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
