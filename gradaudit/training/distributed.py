"""Stats across ranks with ``torch.distributed``: DTensor shards, process groups, torchrun scans.

The engine's merge rule is what makes this possible without anything home-made:
per-parameter stats rows computed on local shards combine into the rows of the
whole parameters exactly as chunk rows combine into a tensor (counts add,
maxima take the max, sums of squares add after rescaling to the largest scale),
so two ``all_reduce`` calls on a small ``[k, 7]`` float64 matrix (MAX, then SUM)
give every rank the stats of every whole parameter. The rows stay on the
device: no ``.item()``, and :meth:`PendingStats.materialize` still does the one
device->host read per rank.

Collectives need every rank of a group to make the same calls in the same
order, so every function here is collective: call it on every rank, with the
same parameters (or paths) in the same order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradaudit.engine.dtensor import is_dtensor
from gradaudit.engine.kernels import Engine
from gradaudit.engine.stats import (
    DEFAULT_MEMORY_BUDGET,
    MAX_ABS,
    NAN,
    NEG_INF,
    POS_INF,
    ROW_WIDTH,
    SCALE,
    SSQ,
    ZEROS,
    StatsCollector,
    dtype_name,
    dtype_skip_reason,
    empty_row,
    hides_values,
    merge_rows,
    not_audited_reason,
)
from gradaudit.errors import InputError, UsageError
from gradaudit.policy import Thresholds
from gradaudit.results import InputProblem, Report, Skipped
from gradaudit.roles import FileEvidence
from gradaudit.scan.pending import PendingEntry, PendingStats
from gradaudit.selection import NameFilter

__all__ = [
    "TorchrunEnv",
    "all_reduce_rows",
    "assign_sources",
    "collect_sharded",
    "scan_paths_distributed",
    "scan_under_torchrun",
    "torchrun_env",
    "torchrun_process_group",
]

_COUNTS = (NAN, POS_INF, NEG_INF, ZEROS)
#: The smallest positive float64: the scale of a row without a finite non-zero
#: element, so that it never wins the MAX of scales (its sum of squares is 0).
_NEUTRAL_SCALE = math.ulp(0.0)


def all_reduce_rows(rows: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Merge stats rows ``[k, 7]`` across the ranks of ``group``: row i is a part of tensor i.

    The engine's merge rule as two collectives on the device: MAX over
    ``[max_abs, scale]``, then each rank rescales its sum of squares to the
    largest scale (``ssq * (scale / scale_max)**2``, multiplied in twice so a
    large ``ssq`` meets the small factor before it can underflow) and a SUM
    adds the counts and the rescaled sums of squares. Every rank gets the same
    merged rows. A row with no finite non-zero element (an empty or all-zero
    shard) has a sum of squares of 0 whatever its scale, so its scale is made
    the smallest positive float64 first: otherwise the scale 1 of an empty
    shard would beat the tiny scale of a float64 shard of 1e-300s and flush
    that shard's squares to zero.
    """
    scale = torch.where(
        rows[:, MAX_ABS] > 0, rows[:, SCALE], torch.full_like(rows[:, SCALE], _NEUTRAL_SCALE)
    )
    peaks = torch.stack([rows[:, MAX_ABS], scale], dim=1)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    ratio = scale / peaks[:, 1]
    sums = torch.stack([*(rows[:, slot] for slot in _COUNTS), rows[:, SSQ] * ratio * ratio], dim=1)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    columns: list[torch.Tensor | None] = [None] * ROW_WIDTH
    for position, slot in enumerate(_COUNTS):
        columns[slot] = sums[:, position]
    columns[MAX_ABS] = peaks[:, 0]
    columns[SCALE] = peaks[:, 1]
    columns[SSQ] = sums[:, len(_COUNTS)]
    missing = [slot for slot, column in enumerate(columns) if column is None]
    if missing:  # a slot added to the engine without a merge rule here
        raise RuntimeError(f"no cross-rank merge rule for stats slots {missing}")
    return torch.stack([c for c in columns if c is not None], dim=1)


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


# --- torchrun scans -------------------------------------------------------------------


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a job started by ``torchrun`` (read from the environment)."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The job this process belongs to, or ``None`` when it runs alone.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and the
    rendezvous address) for every worker. A world of one is a plain run.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank = int(env["RANK"])
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise UsageError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be integers "
            f"(got RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r})"
        ) from None
    if world_size <= 1:
        return None
    if not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    return TorchrunEnv(rank=rank, world_size=world_size, local_rank=local_rank)


@contextmanager
def torchrun_process_group(env: TorchrunEnv, device: str) -> Iterator[None]:
    """Join the torchrun job (``env://``): gloo on the CPU, NCCL on CUDA; leave it afterwards.

    With ``--device auto`` or ``cuda`` each rank takes the GPU of its
    ``LOCAL_RANK``. A process group that is already initialised is used as it is.
    """
    spec = device.strip().lower()
    if spec.startswith("cuda:"):
        raise UsageError(
            f"--device {device} under torchrun: give no index (auto or cuda); "
            "each rank uses the GPU of its LOCAL_RANK"
        )
    if dist.is_initialized():
        yield
        return
    use_cuda = spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available())
    if use_cuda and spec in ("auto", "cuda"):
        if env.local_rank >= torch.cuda.device_count():
            raise UsageError(
                f"LOCAL_RANK {env.local_rank} has no GPU: only "
                f"{torch.cuda.device_count()} CUDA device(s) on this node"
            )
        torch.cuda.set_device(env.local_rank)
    try:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    except (RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise UsageError(f"cannot join the torchrun job: {first_line}") from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def assign_sources(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Which inputs each rank collects: indices into ``sizes``, in input order per rank.

    Largest first to the least-loaded rank (ties to the lower rank), so ranks
    get similar numbers of bytes; an input of 0 bytes (or one that could not be
    measured) still counts as one so they spread over the ranks too.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += max(sizes[index], 1)
    return [sorted(share) for share in shares]


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except (OSError, ValueError):
        return 0  # the rank that gets it records the error


@dataclass(frozen=True)
class _FilePart:
    """What one rank learned from one input, minus the rows (which travel on the device)."""

    index: int
    files: tuple[str, ...]
    entries: tuple[PendingEntry, ...]
    skipped: tuple[Skipped, ...]
    errors: tuple[InputProblem, ...]
    excluded: dict[str | None, int]
    first_row: int
    #: What each file's metadata says it holds (:mod:`gradaudit.roles`).
    file_evidence: dict[str, FileEvidence] = field(default_factory=dict)


def scan_paths_distributed(
    paths: Sequence[str | Path],
    *,
    thresholds: Thresholds | None = None,
    device: torch.device | str | None = "auto",
    chunk_elements: int | None = None,
    engine: Engine | str = Engine.AUTO,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    recursive: bool = False,
    group: dist.ProcessGroup | None = None,
) -> Report:
    """:func:`~gradaudit.scan_paths` with the inputs split across the ranks of ``group``.

    Collective. Rank 0 expands the inputs (directories, ``recursive``) and
    decides who reads what (:func:`assign_sources`, by file size), and
    broadcasts both, so ranks with different views of a file system still
    agree. Each rank collects its inputs; the host facts travel with
    ``all_gather_object`` and the stats rows, untouched, with ``all_gather`` on
    the device. Every rank then rebuilds the collection in the input order and
    reads it once, so every rank returns the report a single process would
    have made (bit for bit, but for ``elapsed_s`` and each rank's device).
    """
    from gradaudit.io import expand_inputs
    from gradaudit.io.dcp import is_dcp_directory
    from gradaudit.io.discover import FileInput

    selection = NameFilter(tuple(include), tuple(exclude))
    select = selection if selection.active else None
    result = PendingStats(
        device=device, chunk_elements=chunk_elements, engine=engine, memory_budget=memory_budget
    )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan: object = None
    if rank == 0:
        inputs = list(expand_inputs(paths, recursive=recursive))
        shared = [
            i for i, e in enumerate(inputs) if isinstance(e, FileInput) and is_dcp_directory(e.path)
        ]
        singles = [i for i in range(len(inputs)) if i not in shared]
        sizes = [_size(inputs[i].path) if isinstance(inputs[i], FileInput) else 0 for i in singles]
        shares = [[singles[j] for j in share] for share in assign_sources(sizes, world)]
        plan = (inputs, shares, shared)
    holder: list[object] = [plan]
    dist.broadcast_object_list(holder, src=_global_rank(group, 0), group=group)
    assert isinstance(holder[0], tuple)
    inputs, shares, shared = holder[0]
    # A DCP directory is read by every rank, its chunks split between them (collective).
    together = {index: _collect_dcp(inputs[index].path, select, result, group) for index in shared}

    parts: list[_FilePart] = []
    rows: list[torch.Tensor] = []
    for index in shares[rank]:
        collected = result.child()
        collected.add_input(inputs[index], select)
        parts.append(
            _FilePart(
                index,
                collected.files,
                collected.entries,
                collected.skipped,
                collected.errors,
                collected.excluded,
                len(rows),
                collected.file_evidence,
            )
        )
        rows.extend(collected.rows)

    everyone: list[list[_FilePart] | None] = [None] * world
    dist.all_gather_object(everyone, parts, group=group)
    counts = [sum(len(p.entries) for p in rank_parts or ()) for rank_parts in everyone]
    gathered = _all_gather_rows(rows, max(counts), result.device or torch.device("cpu"), group)

    owner = {p.index: (r, p) for r, rank_parts in enumerate(everyone) for p in rank_parts or ()}
    for index in range(len(inputs)):
        if index in together:
            result.absorb(together[index])
            for path in together[index].files:
                result.add_file(path)
            for problem in together[index].errors:
                result.add_error(problem)
            continue
        source_rank, part = owner[index]
        for path in part.files:
            result.add_file(path)
        for problem in part.errors:
            result.add_error(problem)
        for skipped in part.skipped:
            result.skip(skipped)
        result.add_excluded(part.excluded)
        result.add_file_evidence(part.file_evidence)
        for offset, entry in enumerate(part.entries):
            result.add_row(entry, gathered[source_rank][part.first_row + offset])
    return result.materialize(thresholds)


def _collect_dcp(
    path: str,
    select: NameFilter | None,
    result: PendingStats,
    group: dist.ProcessGroup | None,
) -> PendingStats:
    """One DCP directory read by every rank of ``group`` together (collective).

    Every rank reads the (small) metadata and splits the chunks the same way
    (:func:`assign_sources`, by bytes); each loads only its chunks and merges their rows
    per tensor, a tensor none of whose chunks it holds getting the empty row; one
    :func:`all_reduce_rows` then gives every rank the rows of the whole tensors. A
    problem on any rank (unreadable metadata, a bad chunk) makes the input an error on
    every rank, so all ranks make the same collective calls.
    """
    from gradaudit.io.dcp import DcpSource, load_chunk

    part = result.child()
    part.add_file(path)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    source: DcpSource | None = None
    problem: str | None = None
    try:
        source = DcpSource(path)
    except InputError as error:
        problem = error.cause
    first = _first_problem(problem, group)
    if first is not None or source is None:
        part.add_error(InputProblem(path, first or "unreadable"))
        return part
    tensors = []
    for entry in source.plan:
        if select is not None and not select(entry.name):
            part.exclude(path)
        elif isinstance(entry, Skipped):
            part.skip(entry)
        else:
            skipped = source.skipped(entry)
            reason = dtype_skip_reason(entry.dtype)
            if skipped is not None:
                part.skip(skipped)
            elif reason is not None:
                part.skip(Skipped(entry.name, reason, path, hides_values(entry.dtype)))
            else:
                tensors.append(entry)
    units = [(t, c) for t, tensor in enumerate(tensors) for c in range(len(tensor.chunks))]
    sizes = [math.prod(tensors[t].chunks[c].sizes) * tensors[t].dtype.itemsize for t, c in units]
    mine = [units[i] for i in assign_sources(sizes, world)[rank]]
    device = result.device or torch.device("cpu")
    collector = StatsCollector()
    rows = [empty_row(device) for _ in tensors]
    try:
        for t, c in mine:
            chunk = load_chunk(path, tensors[t], tensors[t].chunks[c]).to(device)
            rows[t] = merge_rows(torch.stack([rows[t], collector.row(chunk)]))
    except InputError as error:
        problem = error.cause
    first = _first_problem(problem, group)
    if first is not None:
        failed = result.child()
        failed.add_file(path)
        failed.add_error(InputProblem(path, first))
        return failed
    if tensors:
        merged = all_reduce_rows(torch.stack(rows), group)
        for index, tensor in enumerate(tensors):
            facts = PendingEntry(tensor.name, tensor.shape, dtype_name(tensor.dtype), path)
            part.add_row(facts, merged[index])
    return part


def _first_problem(problem: str | None, group: dist.ProcessGroup | None) -> str | None:
    """The first rank's problem, or None when every rank is fine (collective)."""
    everyone: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problem, group=group)
    return next((p for p in everyone if p is not None), None)


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _all_gather_rows(
    rows: list[torch.Tensor], most: int, device: torch.device, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Every rank's rows, padded to the longest list, gathered on the device."""
    world = dist.get_world_size(group)
    padded = torch.zeros((most, ROW_WIDTH), dtype=torch.float64, device=device)
    if most == 0:
        return [padded] * world
    if rows:
        padded[: len(rows)] = torch.stack(rows)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return gathered


def scan_under_torchrun(
    paths: Sequence[str | Path],
    env: TorchrunEnv,
    *,
    device: str = "auto",
    **options: Any,
) -> Report:
    """What ``torchrun ... -m gradaudit scan`` runs on every rank: join, scan, leave.

    ``options`` are :func:`scan_paths_distributed`'s keyword arguments.
    """
    with torchrun_process_group(env, device):
        return scan_paths_distributed(paths, device=device, **options)
