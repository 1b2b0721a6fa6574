"""Orchestration: named tensors or files in, a :class:`Report` out.

Never prints, never exits: the CLI decides what a report means for the
terminal and the process. Collection (device work only) and materialisation
(the one host read) are separate steps so a training loop can collect between
``backward()`` and ``optimizer.step()`` and read later.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gradaudit.checks import evaluate_all
from gradaudit.devices import resolve_device
from gradaudit.dtensor import is_dtensor
from gradaudit.errors import InputError
from gradaudit.policy import FindingKind, Thresholds
from gradaudit.results import (
    FileResult,
    Finding,
    InputProblem,
    Report,
    Skipped,
    Summary,
    TensorStats,
)
from gradaudit.stats import (
    DEFAULT_CHUNK_ELEMENTS,
    HostRow,
    StatsCollector,
    dtype_name,
    merge_rows,
    not_audited_reason,
    read_rows,
)

#: What ``audit`` and ``collect_async`` accept: a mapping of names to tensors
#: (a state dict) or an iterable of ``(name, tensor)`` pairs.
TensorInput = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

#: The engine that computed the stats, reported in every output.
ENGINE_NAME = "eager"


def _named(tensors: TensorInput) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        yield from tensors.items()
        return
    for item in tensors:
        name, tensor = item
        yield str(name), tensor


@dataclass(frozen=True)
class PendingEntry:
    """The host-side facts of one collected tensor; its stats row stays on the device.

    Plain data, so it can travel between processes (``torch.distributed`` object
    collectives) while the rows travel as device tensors.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: str | None = None


class PendingStats:
    """Stats collected on the device and not read yet.

    Holds, per tensor, the host-side facts (name, shape, dtype, source) and a
    device stats row. Nothing in :meth:`add` reads a device value;
    :meth:`materialize` does the single read.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        collector: StatsCollector | None = None,
    ) -> None:
        self.device = None if device is None else resolve_device(device)
        self._collector = collector or StatsCollector(chunk_elements)
        self._started = time.perf_counter()
        self._names: list[str] = []
        self._shapes: list[tuple[int, ...]] = []
        self._dtypes: list[str] = []
        self._sources: list[str | None] = []
        self._rows: list[torch.Tensor] = []
        self._skipped: list[Skipped] = []
        self._files: list[str] = []
        self._errors: list[InputProblem] = []
        #: Rows already copied to the host by :meth:`prefetch`, and how many rows they cover.
        self._prefetched: tuple[int, torch.Tensor, torch.cuda.Event] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def entries(self) -> tuple[PendingEntry, ...]:
        """The host-side facts of the collected tensors, in collection order."""
        return tuple(
            PendingEntry(*facts)
            for facts in zip(self._names, self._shapes, self._dtypes, self._sources, strict=True)
        )

    @property
    def rows(self) -> tuple[torch.Tensor, ...]:
        """The device stats rows, one per entry, in the same order (not read back)."""
        return tuple(self._rows)

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        return tuple(self._skipped)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self._files)

    @property
    def errors(self) -> tuple[InputProblem, ...]:
        return tuple(self._errors)

    def add_row(self, entry: PendingEntry, row: torch.Tensor) -> None:
        """Record a stats row computed elsewhere: merged across ranks, or sent by another rank.

        The row keeps its device; like :meth:`add`, nothing is read back.
        """
        self._names.append(entry.name)
        self._shapes.append(tuple(entry.shape))
        self._dtypes.append(entry.dtype)
        self._sources.append(entry.source)
        self._rows.append(row)

    def add(self, name: str, tensor: torch.Tensor, source: str | None = None) -> None:
        """Queue the device work for one tensor; a tensor that cannot be audited is skipped."""
        if is_dtensor(tensor):
            raise TypeError(
                f"{name!r} is a DTensor: its stats need its shards on every rank; use "
                "gradaudit.collect_module (or gradaudit.distributed.collect_sharded)"
            )
        reason = not_audited_reason(tensor)
        if reason is not None:
            self._skipped.append(Skipped(name, reason, source))
            return
        if self.device is not None and tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=True)
        with torch.no_grad():
            row = self._collector.row(tensor.detach())
        self._names.append(name)
        self._shapes.append(tuple(tensor.shape))
        self._dtypes.append(dtype_name(tensor.dtype))
        self._sources.append(source)
        self._rows.append(row)

    def add_all(self, tensors: TensorInput, source: str | None = None) -> None:
        for name, tensor in _named(tensors):
            self.add(name, tensor, source)

    def skip(self, skipped: Skipped) -> None:
        self._skipped.append(skipped)

    def add_file(self, path: str) -> None:
        """Record an input file, so it is reported even when it holds nothing to audit."""
        self._files.append(path)

    def add_error(self, problem: InputProblem) -> None:
        self._errors.append(problem)

    def child(self) -> PendingStats:
        """An empty collection sharing this one's device and scratch buffers.

        A file is collected into a child and absorbed only when it was read to
        the end, so a file that fails half-way contributes nothing.
        """
        child = PendingStats(collector=self._collector)
        child.device = self.device
        return child

    def absorb(self, other: PendingStats) -> None:
        self._names += other._names
        self._shapes += other._shapes
        self._dtypes += other._dtypes
        self._sources += other._sources
        self._rows += other._rows
        self._skipped += other._skipped

    def add_path(self, path: str) -> None:
        """Collect one file; a file that fails is recorded as an error and contributes nothing.

        The file is collected into a :meth:`child` and absorbed only when it was
        read to the end, so a file that fails half-way leaves no partial rows.
        """
        from gradaudit.io import open_source

        self.add_file(path)
        part = self.child()
        target = self.device or torch.device("cpu")
        try:
            for item in open_source(path).items(target):
                if isinstance(item, Skipped):
                    part.skip(item)
                else:
                    part.add(item[0], item[1], source=path)
        except InputError as error:
            self.add_error(InputProblem(path, error.cause))
            return
        self.absorb(part)

    def prefetch(self) -> None:
        """Start copying the rows collected so far to the host, without waiting for it.

        ``materialize`` normally copies the rows when it is called, and a copy
        waits for everything queued on the stream before it: in a training loop
        that materialises step N's stats during step N+1, that would be step
        N+1's backward pass. After ``prefetch`` the copy is queued right behind
        the collection instead, into pinned host memory, and ``materialize``
        only waits for that copy (long finished by then). Rows on the CPU (or
        on ``meta``) need no copy; rows added after the prefetch make
        ``materialize`` read everything the usual way.
        """
        devices = {row.device for row in self._rows}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return
        stacked = torch.stack(self._rows)
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        self._prefetched = (len(self._rows), host, done)

    def _read(self) -> torch.Tensor:
        """The one host read: the prefetched copy when it is still complete."""
        if self._prefetched is not None and self._prefetched[0] == len(self._rows):
            _, host, done = self._prefetched
            done.synchronize()
            return host
        return read_rows(self._rows)

    def materialize(self, thresholds: Thresholds | None = None) -> Report:
        """Read every stats row back in one transfer and judge them by ``thresholds``."""
        thresholds = thresholds or Thresholds()
        host = self._read()
        values = host.tolist()
        tensors = tuple(self._tensor_stats(i, values[i]) for i in range(len(values)))
        findings = evaluate_all(tensors, thresholds)
        global_row = merge_rows(host) if len(values) else None
        files = tuple(self._file_results(host))
        return Report(
            tensors=tensors,
            findings=findings,
            skipped=tuple(self._skipped),
            summary=_summary(tensors, findings, len(self._skipped), global_row),
            device=self._device_label(),
            engine=ENGINE_NAME,
            elapsed_s=time.perf_counter() - self._started,
            files=files,
            errors=tuple(self._errors),
            thresholds=thresholds,
        )

    def _tensor_stats(self, index: int, values: list[float]) -> TensorStats:
        row = HostRow.from_values(values)
        shape = self._shapes[index]
        numel = math.prod(shape)
        finite = numel - row.nan - row.pos_inf - row.neg_inf
        return TensorStats(
            name=self._names[index],
            shape=shape,
            dtype=self._dtypes[index],
            numel=numel,
            nan=row.nan,
            pos_inf=row.pos_inf,
            neg_inf=row.neg_inf,
            zeros=row.zeros,
            max_abs=row.max_abs,
            norm=row.norm,
            rms=row.norm / math.sqrt(finite) if finite else None,
            source=self._sources[index],
        )

    def _file_results(self, host: torch.Tensor) -> Iterator[FileResult]:
        errors = {problem.path: problem.message for problem in self._errors}
        for path in dict.fromkeys(self._files + list(errors)):
            indices = [i for i, source in enumerate(self._sources) if source == path]
            norm = HostRow.from_values(merge_rows(host[indices]).tolist()).norm if indices else None
            yield FileResult(
                path=path,
                tensors=len(indices),
                skipped=sum(1 for s in self._skipped if s.source == path),
                elements=sum(math.prod(self._shapes[i]) for i in indices),
                global_norm=norm,
                error=errors.get(path),
            )

    def _device_label(self) -> str:
        devices = dict.fromkeys(str(row.device) for row in self._rows)
        if self.device is not None:
            devices = dict.fromkeys([str(self.device), *devices])
        return ",".join(devices) or "none"


def _summary(
    tensors: Sequence[TensorStats],
    findings: Sequence[Finding],
    skipped: int,
    global_row: torch.Tensor | None,
) -> Summary:
    def flagged(kind: FindingKind) -> int:
        return len({(f.source, f.tensor) for f in findings if f.kind is kind})

    global_norm = 0.0 if global_row is None else HostRow.from_values(global_row.tolist()).norm
    return Summary(
        tensors=len(tensors),
        skipped=skipped,
        elements=sum(t.numel for t in tensors),
        global_norm=global_norm,
        nan_tensors=flagged(FindingKind.NAN),
        inf_tensors=flagged(FindingKind.INF),
        vanishing_tensors=flagged(FindingKind.VANISHING),
        exploding_tensors=flagged(FindingKind.EXPLODING),
        failing_findings=sum(1 for f in findings if f.failing),
        warnings=sum(1 for f in findings if not f.failing),
    )


def collect_async(
    tensors: TensorInput,
    *,
    device: torch.device | str | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> PendingStats:
    """Queue the stats of ``tensors`` on their device without any device->host sync.

    Call :meth:`PendingStats.materialize` later (e.g. after ``optimizer.step()``)
    for the one read. ``device=None`` reduces each tensor where it lives.
    """
    pending = PendingStats(device=device, chunk_elements=chunk_elements)
    pending.add_all(tensors)
    return pending


def audit(
    tensors: TensorInput,
    *,
    thresholds: Thresholds | None = None,
    device: torch.device | str | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Report:
    """Audit in-memory tensors: ``collect_async(...).materialize(thresholds)``."""
    return collect_async(tensors, device=device, chunk_elements=chunk_elements).materialize(
        thresholds
    )


def scan_paths(
    paths: Sequence[str | Path],
    *,
    thresholds: Thresholds | None = None,
    device: torch.device | str | None = "auto",
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Report:
    """Audit files one tensor at a time; a bad file is recorded and the others still audited."""
    pending = PendingStats(device=device, chunk_elements=chunk_elements)
    for raw in paths:
        pending.add_path(str(raw))
    return pending.materialize(thresholds)
