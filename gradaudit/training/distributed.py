"""Gradients sharded across ranks (DTensor, or plain tensors split over a process group).

:func:`collect_sharded` collects each rank's shards and merges their stats rows
into the rows of the whole parameters with :func:`~gradaudit.engine.collectives.all_reduce_rows`
(the engine's merge rule as two collectives on the device): no ``.item()``, and
:meth:`PendingStats.materialize` still does the one device->host read per rank.
Scanning files across the ranks of a torchrun job is :mod:`gradaudit.scan.distributed`.

Collectives need every rank of a group to make the same calls in the same
order, so every function here is collective: call it on every rank, with the
same parameters in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradaudit.engine.collectives import all_reduce_rows
from gradaudit.engine.dtensor import is_dtensor
from gradaudit.engine.dtypes import dtype_name, hides_values, not_audited_reason
from gradaudit.engine.stats import StatsCollector
from gradaudit.results import Skipped
from gradaudit.scan.pending import PendingEntry, PendingStats

__all__ = ["collect_sharded"]


@dataclass
class _Batch:
    """Rows that are reduced together: same process groups, same device."""

    groups: tuple[dist.ProcessGroup, ...]
    #: Plain tensors sharded over ``group=``: their element count is summed too.
    count_elements: bool
    positions: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)


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
    collector = StatsCollector() if collector is None else collector.fresh()
    pending = PendingStats(collector=collector)
    plan: list[PendingEntry | Skipped] = []
    batches: dict[tuple[object, ...], _Batch] = {}
    for name, grad in gradients:
        local, groups, shape, reason = _local_view(grad, group)
        if reason is not None:
            plan.append(Skipped(name, reason))
            continue
        reason = not_audited_reason(local)
        if reason is not None:
            plan.append(Skipped(name, reason, unaudited=hides_values(local.dtype)))
            continue
        with torch.no_grad():
            row = collector.row(local.detach())
        count_elements = shape is None
        key = (groups, local.device, count_elements)
        batch = batches.setdefault(key, _Batch(groups, count_elements))
        batch.positions.append(len(plan))
        batch.rows.append(row)
        batch.numels.append(local.numel())
        plan.append(PendingEntry(name, shape or (), dtype_name(local.dtype)))

    merged_rows: dict[int, torch.Tensor] = {}
    #: Summed element counts still on the device (an NCCL-only group): read with the rows.
    deferred_counts: dict[int, torch.Tensor] = {}
    for batch in batches.values():  # first-seen order: the same on every rank
        merged = torch.stack(batch.rows)
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
    return pending


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
