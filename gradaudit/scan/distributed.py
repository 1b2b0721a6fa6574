"""A scan split across the ranks of a ``torch.distributed`` job (``torchrun ... gradaudit scan``).

Rank 0 expands the inputs and decides who reads which file; each rank collects its
files; the host facts travel as objects and the stats rows, untouched, with
``all_gather`` on the device; a distributed checkpoint is read by every rank together,
its chunks merged with :func:`~gradaudit.engine.collectives.all_reduce_rows`. Every
rank then reads the collection once and holds the report a single process would make.

Collectives need every rank of a group to make the same calls in the same
order, so every function here is collective unless it says otherwise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradaudit.engine.collectives import all_reduce_rows
from gradaudit.engine.dtypes import dtype_name, dtype_skip_reason, hides_values
from gradaudit.engine.kernels import Engine
from gradaudit.engine.options import FROM_FILES, EngineOptions, choose
from gradaudit.engine.stats import (
    DEFAULT_MEMORY_BUDGET,
    ROW_WIDTH,
    StatsCollector,
    empty_row,
    merge_rows,
)
from gradaudit.errors import InputError, UsageError
from gradaudit.io import dcp, expand_inputs
from gradaudit.io.dcp import DcpSource, is_dcp_directory
from gradaudit.io.discover import FileInput
from gradaudit.policy import Thresholds
from gradaudit.results import InputProblem, Report, Skipped
from gradaudit.results.roles import FileEvidence
from gradaudit.scan.pending import PendingEntry, PendingStats
from gradaudit.scan.torchrun import TorchrunEnv as TorchrunEnv
from gradaudit.scan.torchrun import torchrun_env as torchrun_env
from gradaudit.selection import NameFilter

__all__ = [
    "TorchrunEnv",
    "assign_sources",
    "scan_paths_distributed",
    "scan_under_torchrun",
    "torchrun_env",
    "torchrun_process_group",
]


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
    options: EngineOptions | None = None,
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
    selection = NameFilter(tuple(include), tuple(exclude))
    select = selection if selection.active else None
    keywords = EngineOptions(device, chunk_elements, engine, memory_budget)
    result = PendingStats(options=choose(options, keywords, FROM_FILES))
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
            # dcp.load_chunk looked up on the module: one reader of chunks, counted in tests
            chunk = dcp.load_chunk(path, tensors[t], tensors[t].chunks[c]).to(device)
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
            hint = source.role_hints.get(tensor.name)
            facts = PendingEntry(tensor.name, tensor.shape, dtype_name(tensor.dtype), path, hint)
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
    options: EngineOptions = FROM_FILES,
    **keywords: Any,
) -> Report:
    """What ``torchrun ... -m gradaudit scan`` runs on every rank: join, scan, leave.

    ``keywords`` are :func:`scan_paths_distributed`'s other keyword arguments.
    """
    device = "auto" if options.device is None else str(options.device)
    with torchrun_process_group(env, device):
        return scan_paths_distributed(paths, options=options, **keywords)
