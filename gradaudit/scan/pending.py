"""Collection on the device: named tensors in, pending stats rows out, one host read.

Reading files into a :class:`PendingStats` is :mod:`gradaudit.scan.paths`; what
happens after the host read (roles, findings, summary) is :mod:`gradaudit.scan.judge`.
Never prints, never exits: the CLI decides what a report means for the
terminal and the process. Collection (device work only) and materialisation
(the one host read) are separate steps so a training loop can collect between
``backward()`` and ``optimizer.step()`` and read later.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from gradaudit.engine.devices import resolve_device
from gradaudit.engine.dtensor import is_dtensor
from gradaudit.engine.dtypes import (
    AUDITED_DTYPES,
    dtype_name,
    dtype_skip_reason,
    hides_values,
    not_audited_reason,
)
from gradaudit.engine.fpmode import ieee_mode
from gradaudit.engine.kernels import Engine
from gradaudit.engine.options import IN_MEMORY, EngineOptions, choose
from gradaudit.engine.staging import CudaChannel, HostToDevice
from gradaudit.engine.stats import (
    DEFAULT_MEMORY_BUDGET,
    ROW_WIDTH,
    StatsCollector,
    empty_row,
    merge_rows,
)
from gradaudit.engine.triton_plan import release_finished
from gradaudit.io.base import TensorRun
from gradaudit.no_gc import paused_gc
from gradaudit.policy import Role, Thresholds
from gradaudit.precision.formats import ExponentHistogram
from gradaudit.results import InputProblem, Report, Skipped
from gradaudit.results.roles import TensorHint
from gradaudit.scan.batches import QueuedBatch, native_batches, planned_batch, run_batch
from gradaudit.scan.collected import Collected, Routing
from gradaudit.scan.derived import derived_rows
from gradaudit.scan.layout import LayoutCache
from gradaudit.scan.readback import Readback
from gradaudit.scan.reading import read_file
from gradaudit.scan.tensor_input import TensorInput, names_and_tensors

_CPU = torch.device("cpu")
#: dtype -> its name in results; a dict lookup is cheaper than dtype_name's cache per tensor.
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or _DTYPE_NAMES.setdefault(dtype, dtype_name(dtype))


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
    #: What the file's structure says about the tensor (:mod:`gradaudit.roles`).
    hint: TensorHint | None = None


class PendingStats(Collected):
    """Stats collected on the device and not read yet.

    Holds, per tensor, the host-side facts (name, shape, dtype, source) and a
    ticket for its device stats row. Nothing in :meth:`add` reads a device
    value; :meth:`materialize` does the single read.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        chunk_elements: int | None = None,
        engine: Engine | str = Engine.AUTO,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        collector: StatsCollector | None = None,
        histograms: bool = False,
        options: EngineOptions | None = None,
    ) -> None:
        options = choose(
            options, EngineOptions(device, chunk_elements, engine, memory_budget), IN_MEMORY
        )
        self.device = None if options.device is None else resolve_device(options.device)
        #: Also collect each tensor's exponent histogram (``--precision``); the native
        #: kernel counts it in the same read as the stats row.
        self.histograms = histograms
        #: Per entry, 1 when it has a histogram (a tensor of the input), 0 when not (a
        #: derived row, a row from elsewhere); its ticket finds it in the collector.
        self._histograms: array.array[int] = array.array("b")
        self._collector = collector or StatsCollector(
            options.chunk_elements, engine=options.engine, memory_budget=options.memory_budget
        )
        if histograms:
            self._collector.histograms = True
        super().__init__()
        #: Per entry, the collector's ticket for its row.
        #: int64, not a list: a list holds an int object (~36 bytes) per tensor.
        self._tickets: array.array[int] = array.array("q")
        self._devices: dict[torch.device, None] = {}
        #: Entry index -> ticket of a row whose first slot is the entry's element count.
        self._deferred_numel: dict[int, int] = {}
        #: The staging ring for CPU -> CUDA copies (pinned buffers made on first use).
        self._uploads = (
            HostToDevice(CudaChannel(self.device))
            if self.device is not None and self.device.type == "cuda"
            else None
        )
        #: How the rows (and histograms) come back to the host, prefetched or not.
        self._readback = Readback(self._collector)

    def __len__(self) -> int:
        return len(self._tickets)

    @property
    def entries(self) -> tuple[PendingEntry, ...]:
        """The host-side facts of the collected tensors, in collection order."""
        return tuple(
            PendingEntry(*facts)
            for facts in zip(
                self._names, self._shapes(), self._dtypes, self._sources, self._hints, strict=True
            )
        )

    @property
    def rows(self) -> tuple[torch.Tensor, ...]:
        """The device stats rows, one per entry, in the same order (not read back).

        Bucketed rows come with the zeros of their padding already taken out
        (a scalar subtraction on the device; nothing is read).
        """
        blocks = self._collector.flush()
        return tuple(self._collector.gather(self._tickets, blocks).unbind(0))

    def add_row(
        self, entry: PendingEntry, row: torch.Tensor, numel: torch.Tensor | None = None
    ) -> None:
        """Record a stats row computed elsewhere: merged across ranks, or sent by another rank.

        The row keeps its device; like :meth:`add`, nothing is read back.
        ``numel`` (a 0-d device tensor) is an element count not known on the
        host yet: it is read with the rows, and the entry is then 1-D of that
        length.
        """
        shape = tuple(entry.shape)
        if numel is not None:
            carrier = torch.zeros(ROW_WIDTH, dtype=torch.float64, device=numel.device)
            carrier[0] = numel
            self._deferred_numel[len(self._names)] = self._collector.adopt(carrier)
        self._names.append(entry.name)
        self._ranks.append(len(shape))
        self._dims.extend(shape)
        self._dtypes.append(entry.dtype)
        self._sources.append(entry.source)
        self._hints.append(entry.hint)
        self._tickets.append(self._collector.adopt(row))
        self._devices[row.device] = None
        if self.histograms:
            self._histograms.append(0)  # rows from elsewhere come without one

    def add(self, name: str, tensor: torch.Tensor, source: str | None = None) -> None:
        """Queue the device work for one tensor; a tensor that cannot be audited is skipped.

        The tensor's values are taken before this returns, so a training loop may
        step or zero its gradients right after (the device work is queued in
        stream order; CPU tensors are reduced at once). To add many tensors,
        :meth:`add_all` is cheaper: it lets small CPU tensors share one native call.
        """
        self.queue(name, tensor, source)
        self.settle()

    def settle(self) -> None:
        """Take the values of every tensor queued so far (see :meth:`queue`)."""
        self._collector.settle()

    def queue(
        self,
        name: str,
        tensor: torch.Tensor,
        source: str | None = None,
        hint: TensorHint | None = None,
    ) -> None:
        """Like :meth:`add`, but a CPU tensor may be read as late as :meth:`settle`.

        For tensors nobody modifies meanwhile (a file's data, or a batch that
        :meth:`add_all` settles before returning): the native kernel then
        reduces many of them in one call.
        """
        if is_dtensor(tensor):
            raise TypeError(
                f"{name!r} is a DTensor: its stats need its shards on every rank; use "
                "gradaudit.collect_module (or gradaudit.training.distributed.collect_sharded)"
            )
        # Per-tensor costs add up with 100,000 tiny tensors (each line here was
        # measured): the skip reason is only worked out for a tensor that has one,
        # and a CPU tensor reduced where it is needs no device object of its own.
        dtype = tensor.dtype
        if dtype not in AUDITED_DTYPES or tensor.layout is not torch.strided:
            reason = not_audited_reason(tensor)
            if reason is not None:
                self._skipped.append(Skipped(name, reason, source, hides_values(dtype)))
                return
        if self.device is None and tensor.is_cpu:
            device = _CPU
        else:
            device = tensor.device
            if self.device is not None and device != self.device:
                tensor = self._to_device(tensor)
                device = self.device
        # detach() is enough to keep autograd out: nothing downstream records a graph.
        ticket = self._collector.submit(tensor.detach() if tensor.requires_grad else tensor)
        if self.histograms:
            # A derived row (a second moment's sum, a step) is not a tensor of the file.
            derived = hint is not None and hint.aux is not None
            self._histograms.append(0 if derived else 1)
        shape = tensor.shape
        self._names.append(name)
        self._ranks.append(len(shape))
        self._dims.extend(shape)
        self._dtypes.append(_dtype_name(dtype))
        self._sources.append(source)
        self._tickets.append(ticket)
        self._hints.append(hint)
        self._devices[device] = None

    def queue_run(self, run: TensorRun, source: str | None = None) -> None:
        """:meth:`queue` for every tensor of a reader's run, in one native call when it can
        (:func:`~gradaudit.scan.batches.run_batch`: no tensor object is made). Runs bound
        for another device, a dtype the native kernel does not take go through
        :meth:`queue` one tensor at a time.
        """
        on_cpu = self.device is None or self.device.type == "cpu"
        batch = run_batch(self._collector, run) if on_cpu else None
        if batch is None:
            for name, tensor in run.tensors():
                self.queue(name, tensor, source)
            return
        self._append(batch, source)

    def _append(self, batch: QueuedBatch, source: str | None) -> None:
        """Record the tensors of one bulk call, a column at a time."""
        count = len(batch.tickets)
        self._names += batch.names
        self._ranks += batch.ranks
        self._dims += batch.dims
        self._dtypes += batch.dtypes
        self._sources += [source] * count
        tickets = batch.tickets
        self._tickets.frombytes(np.arange(tickets.start, tickets.stop, dtype=np.int64).tobytes())
        self._hints += [None] * count
        if self.histograms:  # never for a planned batch: the collector plans none then
            self._histograms += array.array("b", [1]) * count
        self._devices[batch.device] = None

    def queue_derived(
        self, name: str, tensor: torch.Tensor, hint: TensorHint, source: str | None = None
    ) -> None:
        """Queue the one-element rows an optimizer state tensor's checks and estimate need
        (:func:`~gradaudit.scan.derived.derived_rows`: a second moment's sum and sign, the
        state's step), to ride along with the one host read."""
        for row_name, value, aux in derived_rows(name, tensor, hint):
            self.queue(row_name, value, source, aux)

    def queue_with_hint(
        self, name: str, tensor: torch.Tensor, source: str | None, hint: TensorHint | None
    ) -> None:
        """:meth:`queue` a file's tensor with its hint, and the rows its checks need."""
        derived = hint is not None and (
            hint.basis is not None or hint.role is Role.OPTIMIZER_SECOND_MOMENT
        )
        if hint is not None and hint.basis is not None and hint.basis.step_tensor is not None:
            # Entries stay plain data: the step travels as its own row.
            plain = dataclasses.replace(hint.basis, step_tensor=None)
            self.queue(name, tensor, source=source, hint=dataclasses.replace(hint, basis=plain))
        else:
            self.queue(name, tensor, source=source, hint=hint)
        if derived:
            assert hint is not None
            # The kernel reads a memory-mapped tensor first, on one thread; torch's reductions
            # then find its pages resident (faulting them in from two threads took 10x longer).
            self.settle()
            self.queue_derived(name, tensor, hint, source)

    def add_pieces(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        pieces: Iterable[torch.Tensor],
        source: str | None = None,
        hint: TensorHint | None = None,
    ) -> None:
        """Queue one tensor given as disjoint pieces that tile it (a distributed checkpoint's
        chunks): one stats row per piece, merged by the engine's rule, never a whole copy.

        Each piece is reduced before the next is taken, so only one is held at a time.
        """
        reason = dtype_skip_reason(dtype)
        if reason is not None:
            self._skipped.append(Skipped(name, reason, source, hides_values(dtype)))
            return
        rows = []
        device = self.device
        for piece in pieces:
            if device is not None and piece.device != device:
                piece = self._to_device(piece)
            rows.append(self._collector.row(piece))
        if not rows:
            row = empty_row(device or "cpu")
        else:
            row = rows[0] if len(rows) == 1 else merge_rows(torch.stack(rows))
        self.add_row(PendingEntry(name, shape, dtype_name(dtype), source, hint), row)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move a tensor to :attr:`device`; CPU -> CUDA goes through the pinned staging ring."""
        assert self.device is not None
        if self._uploads is None or tensor.device.type != "cpu":
            return tensor.to(self.device, non_blocking=True)
        return self._uploads.copy(tensor)

    def add_all(self, tensors: TensorInput, source: str | None = None) -> None:
        """:meth:`add` for each tensor; every value is taken before this returns."""
        names, values = names_and_tensors(tensors)
        self.add_tensors(names, values, source)

    def add_tensors(
        self, names: list[str], tensors: list[torch.Tensor], source: str | None = None
    ) -> None:
        """:meth:`add_all` of ``names[i]: tensors[i]``, for a caller that holds its tensors as
        columns already (a monitor's gradients, every step: no pairs to build and split)."""
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        try:
            # Nothing built here forms a cycle, and a collection set off meanwhile
            # would walk every tensor of the caller's model (gradaudit.no_gc).
            with paused_gc():
                batch = (
                    planned_batch(self._collector, names, tensors) if self.device is None else None
                )
                if batch is not None:
                    self._append(batch, source)
                elif self.device is None or self.device.type == "cpu":
                    for item in native_batches(self._collector, names, tensors):
                        if isinstance(item, int):
                            self.queue(names[item], tensors[item], source)
                        else:
                            self._append(item, source)
                else:
                    for name, tensor in zip(names, tensors, strict=True):
                        self.queue(name, tensor, source)
        finally:
            self.settle()

    def child(self) -> PendingStats:
        """An empty collection sharing this one's device and scratch buffers.

        A file is collected into a child and absorbed only when it was read to
        the end, so a file that fails half-way contributes nothing.
        """
        child = PendingStats(collector=self._collector)
        child.device = self.device
        child._uploads = self._uploads
        child.histograms = self.histograms
        return child

    def absorb(self, other: PendingStats) -> None:
        """Take ``other``'s collected tensors, after this one's; ``other`` is left without them.

        Moved, not copied: a file's child is absorbed once, and a file of a million tiny
        tensors would otherwise hold its facts twice at that moment (the peak of the scan).
        """
        shift = len(self._names)
        for index, ticket in other._deferred_numel.items():
            self._deferred_numel[index + shift] = ticket
        other._deferred_numel = {}
        self.absorb_facts(other, ("_tickets", "_histograms"))
        self._devices.update(other._devices)

    def read_file(
        self,
        path: str,
        select: Callable[[str], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        routing: Routing | None = None,
    ) -> InputProblem | None:
        """Collect one file's tensors (see :func:`gradaudit.scan.reading.read_file`)."""
        return read_file(self, path, select, progress, routing)

    def prefetch(self) -> None:
        """Start copying the rows collected so far to the host, without waiting for it.

        ``materialize`` normally copies the rows when it is called, and a copy
        waits for everything queued on the stream before it: in a training loop
        that materialises step N's stats during step N+1, that would be step
        N+1's backward pass. After ``prefetch`` the copy is queued right behind
        the collection instead, into pinned host memory, and ``materialize``
        only waits for that copy (long finished by then). The exponent histograms
        (``histograms``) are copied the same way, for :meth:`histogram_counts`.

        One copy per CUDA device, queued on that device (not the current one)
        after the collector's settle events, so rows collected on a side stream
        are copied after the kernels that wrote them. Rows on the CPU (or on
        ``meta``) need no copy; rows added after the prefetch make
        ``materialize`` read everything the usual way.
        """
        wanted = self._histograms if self.histograms else None
        self._readback.prefetch(self._devices, wanted, self._tickets)

    def materialize(
        self,
        thresholds: Thresholds | None = None,
        *,
        layouts: LayoutCache | None = None,
        histograms: bool = True,
    ) -> Report:
        """Read every stats row back in one transfer and judge them by ``thresholds``.

        After the read, the rows are host data: :meth:`Collected.report` judges them
        (the same code judges the rows of the torch-free scan). ``layouts``: what the
        last report of the same tensors worked out from their facts alone, to take again
        (:mod:`gradaudit.scan.layout`; a training loop's monitor). ``histograms=False``
        leaves the exponent histograms out of the report, for a caller that reads them as
        one matrix (:meth:`histogram_counts`).
        """
        with ieee_mode():  # a host thread in flush-to-zero mode would read subnormals as 0
            host_blocks = self._readback.read()
            release_finished()  # lists held off the default stream whose kernels have run
            # Rows in submission order, with the zeros that bucket padding added taken
            # out; the merges (per file, global) then run on this host copy.
            host = self._collector.gather(self._tickets, host_blocks, fresh=False)
            self._resolve_counts(host_blocks)
            read = self._read_histograms() if histograms else ()
            return self.report(
                host.numpy(),
                thresholds,
                device=self._device_label(),
                engine=self._collector.engine_used,
                histograms=read,
                layouts=layouts,
            )

    def _resolve_counts(self, host_blocks: list[torch.Tensor]) -> None:
        """Shapes of the entries whose element count came with the rows (see :meth:`add_row`)."""
        if not self._deferred_numel:
            return
        carriers = self._collector.gather(list(self._deferred_numel.values()), host_blocks)
        shapes = self._shapes()
        for index, count in zip(self._deferred_numel, carriers[:, 0].tolist(), strict=True):
            shapes[index] = (int(count),)
        self._ranks = array.array("q", map(len, shapes))
        self._dims = array.array("q", [size for shape in shapes for size in shape])

    def _read_histograms(self) -> tuple[ExponentHistogram | None, ...]:
        """The exponent histograms, read right after the stats rows (one copy per device)."""
        if not self.histograms:
            return ()
        counts = self.histogram_counts().tolist()  # one conversion, not one per tensor
        return tuple(
            ExponentHistogram(tuple(row)) if wanted else None
            for row, wanted in zip(counts, self._histograms, strict=True)
        )

    def histogram_counts(self) -> np.ndarray:
        """Every entry's exponent histogram as one int64 matrix ``[entries, bins]`` (a row
        of zeros for an entry without one: a row from elsewhere), read from the devices
        (one copy per device) after the rows' kernels.

        For a caller that judges the counts as columns
        (:func:`gradaudit.precision.headroom_columns`: a monitor's every collected step)
        rather than as one :class:`~gradaudit.precision.ExponentHistogram` per tensor.
        """
        if not self.histograms:
            raise ValueError("collected without exponent histograms (histograms=True)")
        return self._readback.histogram_counts(self._histograms, self._tickets)

    def _device_label(self) -> str:
        devices = dict.fromkeys(str(device) for device in self._devices)
        if self.device is not None:
            devices = dict.fromkeys([str(self.device), *devices])
        return ",".join(devices) or "none"


def collect_async(
    tensors: TensorInput,
    *,
    device: torch.device | str | None = None,
    chunk_elements: int | None = None,
    engine: Engine | str = Engine.AUTO,
    options: EngineOptions | None = None,
) -> PendingStats:
    """Queue the stats of ``tensors`` on their device without any device->host sync.

    Call :meth:`PendingStats.materialize` later (e.g. after ``optimizer.step()``)
    for the one read. ``device=None`` reduces each tensor where it lives.
    """
    options = choose(options, EngineOptions(device, chunk_elements, engine), IN_MEMORY)
    pending = PendingStats(options=options)
    pending.add_all(tensors)
    return pending


def audit(
    tensors: TensorInput,
    *,
    thresholds: Thresholds | None = None,
    device: torch.device | str | None = None,
    chunk_elements: int | None = None,
    engine: Engine | str = Engine.AUTO,
    options: EngineOptions | None = None,
) -> Report:
    """Audit in-memory tensors: ``collect_async(...).materialize(thresholds)``."""
    options = choose(options, EngineOptions(device, chunk_elements, engine), IN_MEMORY)
    pending = collect_async(tensors, options=options)
    return pending.materialize(thresholds)
