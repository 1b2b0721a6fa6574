"""Gradients sharded across ranks (DTensor, or plain tensors split over a process group).

:func:`collect_sharded` collects each rank's shards and merges their stats rows
into the rows of the whole parameters with :func:`~gradaudit.engine.collectives.all_reduce_rows`
(the engine's merge rule as two collectives on the device): no ``.item()``, and
:meth:`PendingStats.materialize` still does the one device->host read per rank.
:func:`collect_sharded_with_histograms` also sums each shard's exponent histogram (a
monitor's ``precision=``) over the same ranks, in the rows' SUM collective
(:func:`~gradaudit.engine.collectives.all_reduce_rows_and_counts`), so every rank judges the
headroom of the whole parameters.
Scanning files across the ranks of a torchrun job is :mod:`gradaudit.scan.distributed`.

Collectives need every rank of a group to make the same calls in the same
order, so every function here is collective: call it on every rank, with the
same parameters in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from gradaudit.engine.bulk import native_segments
from gradaudit.engine.collectives import all_reduce_rows, all_reduce_rows_and_counts
from gradaudit.engine.dtensor import is_dtensor
from gradaudit.engine.dtypes import dtype_name, hides_values, not_audited_reason
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.engine.native_rows import native_threads, rows_and_histograms
from gradaudit.engine.stats import StatsCollector
from gradaudit.precision import layout
from gradaudit.results import Skipped
from gradaudit.scan.pending import PendingEntry, PendingStats
from gradaudit.scan.readback import Prefetch, copy_ahead

__all__ = ["ShardHistograms", "collect_sharded", "collect_sharded_with_histograms"]


@dataclass
class _Batch:
    """Rows that are reduced together: same process groups, same device."""

    groups: tuple[dist.ProcessGroup, ...]
    #: Plain tensors sharded over ``group=``: their element count is summed too.
    count_elements: bool
    positions: list[int] = field(default_factory=list)
    #: Each row's index among the collection's entries (the skipped tensors have none).
    entries: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    #: Each shard's exponent histogram, when they are collected.
    histograms: list[torch.Tensor] = field(default_factory=list)


class ShardHistograms:
    """The exponent histograms of whole parameters, summed across ranks with their rows.

    What :meth:`PendingStats.histogram_counts` is for the tensors of one process, for the
    entries of :func:`collect_sharded_with_histograms`' ``PendingStats``, in its order: the
    same ``[entries, bins]`` int64 matrix on every rank. The counts summed on a CUDA device
    start their copy to pinned host memory as soon as they are summed: a blocking copy at
    the read, a step later in a monitor's default mode, would wait for that step's backward.
    """

    def __init__(self, entries: int) -> None:
        self._entries = entries
        #: Entry indices and their summed counts, still on their (non-CUDA) device.
        self._parts: list[tuple[list[int], torch.Tensor]] = []
        #: The CUDA ones, on their way to the host.
        self._copies: list[Prefetch] = []

    def add(self, entries: list[int], counts: torch.Tensor) -> None:
        """Take the summed ``counts`` ``[len(entries), bins]`` of these entries."""
        if counts.is_cuda:
            self._copies.append(copy_ahead(counts.device, {}, entries, torch.cat, [counts]))
        else:
            self._parts.append((entries, counts))

    def histogram_counts(self) -> np.ndarray:
        """Every entry's summed exponent histogram, ``[entries, bins]`` int64 (read now)."""
        out = np.zeros((self._entries, layout().bins), dtype=np.int64)
        for entries, counts in self._parts:
            out[entries] = counts.to("cpu").numpy()
        for copy in self._copies:
            copy.done.synchronize()
            out[copy.indices] = copy.pinned.numpy()
        return out


def collect_sharded(
    gradients: Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    collector: StatsCollector | None = None,
) -> PendingStats:
    """Stats of whole parameters from the local shards of their gradients (collective).

    * ``DTensor``: the local shard is reduced and the row combined over every
      mesh dimension the tensor is sharded on. Mesh dimensions with a
      ``Replicate`` placement are not reduced over, since every rank there holds
      the same values: nothing is counted twice. The shape reported is the
      global one. A ``Partial`` placement holds unreduced partial sums rather
      than the gradient; such a tensor is skipped, with that reason.
    * a plain tensor with ``group``: a disjoint shard of the same-named tensor
      on every rank of ``group`` (FSDP1 flat shards, Megatron-style tensor
      parallel shards). The layout of the whole tensor is unknown, so it is
      reported 1-D with the summed element count.
    * a plain tensor without ``group``: local to this rank, not combined.

    The element counts of ``group`` shards are summed on the CPU when the group
    can reduce CPU tensors (gloo, or ``init_process_group()``'s default
    ``cpu:gloo,cuda:nccl``); with an NCCL-only group they are summed on the
    device and read with the stats rows (the entries' shapes are ``()`` until
    ``materialize``). DTensors need no count.
    """
    pending, _ = _collect(gradients, group, collector, histograms=False)
    return pending


def collect_sharded_with_histograms(
    gradients: Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    collector: StatsCollector | None = None,
) -> tuple[PendingStats, ShardHistograms]:
    """:func:`collect_sharded`, and each whole parameter's exponent histogram (collective).

    Each shard's histogram is counted where the shard is (on the CPU by the native kernel,
    in the read that makes its row) and summed over the same ranks as its row, in the
    rows' SUM collective: ``Replicate`` mesh dimensions are not summed over, so replicated
    values count once, as in the rows. The histograms stay on the device until
    :meth:`ShardHistograms.histogram_counts`.
    """
    pending, histograms = _collect(gradients, group, collector, histograms=True)
    assert histograms is not None
    return pending, histograms


def _collect(
    gradients: Iterable[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup | None,
    collector: StatsCollector | None,
    *,
    histograms: bool,
) -> tuple[PendingStats, ShardHistograms | None]:
    """:func:`collect_sharded`, with the histograms when asked."""
    collector = StatsCollector() if collector is None else collector.fresh()
    pending = PendingStats(collector=collector)
    plan: list[PendingEntry | Skipped] = []
    entries = 0
    batches: dict[tuple[object, ...], _Batch] = {}
    shards: list[torch.Tensor] = []  # the audited local tensors, in order
    owners: list[_Batch] = []  # the batch of each
    for name, grad in gradients:
        local, groups, shape, reason = _local_view(grad, group)
        if reason is not None:
            plan.append(Skipped(name, reason))
            continue
        reason = not_audited_reason(local)
        if reason is not None:
            plan.append(Skipped(name, reason, unaudited=hides_values(local.dtype)))
            continue
        count_elements = shape is None
        key = (groups, local.device, count_elements)
        batch = batches.setdefault(key, _Batch(groups, count_elements))
        batch.positions.append(len(plan))
        batch.entries.append(entries)
        batch.numels.append(local.numel())
        shards.append(local.detach())
        owners.append(batch)
        plan.append(PendingEntry(name, shape or (), dtype_name(local.dtype)))
        entries += 1
    with torch.no_grad():
        if histograms:
            rows, shard_counts = _rows_and_histograms(collector, shards)
            for batch, histogram in zip(owners, shard_counts, strict=True):
                batch.histograms.append(histogram)
        else:
            rows = [collector.row(shard) for shard in shards]
    for batch, row in zip(owners, rows, strict=True):
        batch.rows.append(row)

    merged_rows: dict[int, torch.Tensor] = {}
    #: Summed element counts still on the device (an NCCL-only group): read with the rows.
    deferred_counts: dict[int, torch.Tensor] = {}
    summed = ShardHistograms(entries) if histograms else None
    for batch in batches.values():  # first-seen order: the same on every rank
        merged = torch.stack(batch.rows)
        if summed is not None:
            counts = torch.stack(batch.histograms)
            for reduce_group in batch.groups:
                merged, counts = all_reduce_rows_and_counts(merged, counts, reduce_group)
            summed.add(batch.entries, counts)
        else:
            for reduce_group in batch.groups:
                merged = all_reduce_rows(merged, reduce_group)
        totals = (
            _sum_counts(batch.numels, batch.groups[0], merged.device)
            if batch.count_elements
            else None
        )
        for index, position in enumerate(batch.positions):
            merged_rows[position] = merged[index]
            if isinstance(totals, list):
                entry = plan[position]
                assert isinstance(entry, PendingEntry)
                plan[position] = PendingEntry(entry.name, (totals[index],), entry.dtype)
            elif totals is not None:
                deferred_counts[position] = totals[index]

    for position, item in enumerate(plan):
        if isinstance(item, Skipped):
            pending.skip(item)
        else:
            pending.add_row(item, merged_rows[position], deferred_counts.get(position))
    return pending, summed


def _rows_and_histograms(
    collector: StatsCollector, shards: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The stats row and the exponent histogram of every local shard, each on its device.

    The shards the native kernel reads as they are (:func:`~gradaudit.engine.bulk.native_segments`:
    plain contiguous CPU tensors of its dtypes) get both from one read, in one call per
    segment, as the tensors of one process do (a call per shard cost ~10 us each, most of a
    small shard's time); any other shard gets its row from the collector and its histogram
    from one more pass (:func:`~gradaudit.engine.histogram.exponent_histogram`).
    """
    segments, others = native_segments(shards, collector.cpu_native_codes)
    rows: list[torch.Tensor] = [torch.empty(0)] * len(shards)
    counts: list[torch.Tensor] = [torch.empty(0)] * len(shards)
    for segment in segments:
        host_rows, host_counts = rows_and_histograms(
            segment.pointers, segment.counts, segment.codes, native_threads()
        )
        rows[segment.start : segment.stop] = torch.from_numpy(host_rows).unbind()
        counts[segment.start : segment.stop] = torch.from_numpy(host_counts).unbind()
    for index in others:
        rows[index] = collector.row(shards[index])
        counts[index] = exponent_histogram(shards[index])
    return rows, counts


def _local_view(
    grad: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, tuple[dist.ProcessGroup, ...], tuple[int, ...] | None, str | None]:
    """The local tensor, the groups to combine it over, its global shape, a skip reason.

    The shape is ``None`` when only the summed element count can tell it.
    """
    if is_dtensor(grad):
        placements = grad.placements  # type: ignore[attr-defined]
        mesh = grad.device_mesh  # type: ignore[attr-defined]
        local: torch.Tensor = grad.to_local()  # type: ignore[attr-defined]
        if any(p.is_partial() for p in placements):
            reason = (
                "DTensor with a Partial placement holds unreduced partial sums, not the "
                "gradient; not audited (redistribute it to Shard or Replicate first)"
            )
            return local, (), tuple(grad.shape), reason
        groups = tuple(mesh.get_group(dim) for dim, p in enumerate(placements) if p.is_shard())
        return local, groups, tuple(grad.shape), None
    if group is not None:
        return grad, (group,), None, None
    return grad, (), tuple(grad.shape), None


def _sum_counts(
    counts: list[int], group: dist.ProcessGroup, device: torch.device
) -> list[int] | torch.Tensor:
    """Element counts summed over ``group``: on the CPU when the group can, else on ``device``.

    Summed on the device they stay there (float64, exact below 2**53): reading
    them now would be a host read in the middle of collection; they travel
    with the stats rows to the one read instead.
    """
    cpu = torch.device("cpu")
    on = cpu if cpu in getattr(group, "_device_types", ()) else device
    totals = torch.tensor(counts, dtype=torch.int64, device=on)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    if on.type == "cpu":
        return [int(n) for n in totals.tolist()]
    return totals.to(torch.float64)
