"""Many tensors queued on the collector in one call, their facts as columns.

The bulk paths of a :class:`~gradaudit.scan.pending.PendingStats`: a reader's run of
tensors in one native call, a training loop's gradients in one Triton flush planned once
per list, a list of plain CPU tensors cut into native segments. Each gives a
:class:`QueuedBatch` (tickets, names, shapes, dtypes as columns, no object per tensor),
which ``PendingStats`` appends in one place; a tensor no bulk path takes goes through
``PendingStats.queue`` one at a time. Apart from ``PendingStats`` so that it stays the
facade over collection: what is queued in bulk, and how, is this module's one job.
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gradaudit.engine.bulk import native_segments
from gradaudit.engine.dtypes import dtype_name
from gradaudit.engine.stats import StatsCollector
from gradaudit.io.base import TensorRun

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class QueuedBatch:
    """Tensors queued in one call: the collector's tickets for their rows (in order) and
    their facts as columns (shapes as ranks and dimensions back to back)."""

    tickets: range
    names: list[str]
    ranks: array.array[int]
    dims: array.array[int]
    dtypes: list[str]
    device: torch.device


def run_batch(collector: StatsCollector, run: TensorRun) -> QueuedBatch | None:
    """A reader's run of tensors in one native call, or ``None`` when the collector does not
    take it as a run (then each tensor goes through ``queue``)."""
    tickets = collector.submit_run(run.pointers, run.counts, run.dtype, run.data)
    if tickets is None:
        return None
    dtypes = [dtype_name(run.dtype)] * len(tickets)
    return QueuedBatch(tickets, run.names, run.ranks, run.dims, dtypes, run.data.device)


def planned_batch(
    collector: StatsCollector, names: list[str], tensors: list[torch.Tensor]
) -> QueuedBatch | None:
    """The tensors as one Triton flush planned once per list
    (:meth:`StatsCollector.submit_planned`: a training loop's gradients on a GPU), the
    facts taken from the plan; ``None`` when the list is not for it (nothing was queued)."""
    taken = collector.submit_planned(tensors if type(tensors) is list else list(tensors))
    if taken is None:
        return None
    tickets, plan = taken
    return QueuedBatch(tickets, names, plan.ranks, plan.dims, plan.dtype_names, plan.device)


def native_batches(
    collector: StatsCollector, names: list[str], values: list[torch.Tensor]
) -> Iterator[QueuedBatch | int]:
    """The tensors without a Python call per tensor where it can: plain contiguous CPU
    tensors the native kernel takes as they are go to it as columns
    (:func:`~gradaudit.engine.bulk.native_segments`), one batch per segment; the index of
    every other tensor is yielded in its place in the order, for the caller to queue
    before the next batch is submitted."""
    codes = collector.cpu_native_codes
    segments, others = native_segments(values, codes)
    spelled = {code: dtype_name(dtype) for dtype, code in codes.items()}
    done = 0
    for segment in segments:
        while done < len(others) and others[done] < segment.start:
            yield others[done]
            done += 1
        part = values[segment.start : segment.stop]
        tickets = collector.submit_native(
            segment.pointers, segment.counts, segment.codes, segment.nbytes, part
        )
        kinds = segment.codes
        if kinds.count(kinds[0]) == len(tickets):  # C speed: one dtype, no lookup per tensor
            dtypes = [spelled[kinds[0]]] * len(tickets)
        else:
            dtypes = list(map(spelled.__getitem__, kinds))
        yield QueuedBatch(
            tickets,
            names[segment.start : segment.stop],
            segment.ranks,
            segment.dims,
            dtypes,
            _CPU,
        )
    yield from others[done:]
