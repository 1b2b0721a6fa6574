"""Device side of the engine: tensors in, one small stats row per tensor out.

Nothing here reads a device value back to the host. Every statistic of a
tensor is a slot of a float64 *stats row* that stays on the tensor's device;
rows are read back once by :func:`~gradaudit.engine.host_read.read_blocks` (the
only host read of a whole scan). That is what lets a training loop collect
between ``backward()`` and ``optimizer.step()`` without stalling the stream, and
it is proved by a test that collects on ``device="meta"``, where every host read raises.

The stats row
-------------
``[nan, pos_inf, neg_inf, zeros, max_abs, scale, ssq]``

* counts are exact in float64 up to 2**53 elements;
* ``max_abs`` is the largest |x| over finite elements (0 when there are none);
* the sum of squares of the finite elements is ``scale**2 * ssq``. ``ssq`` is
  accumulated in float64, which cannot overflow for any float32/16/bf16/fp8
  input (3.4e38**2 = 1.2e77). Only float64 input can overflow float64 squares,
  so float64 blocks are divided by a power of two just above their ``max_abs``
  (exact, no rounding) and record that ``scale``; other blocks use ``scale=1``.

The merge rule (:func:`~gradaudit.results.row.merge_rows`, one code for device
tensors and host arrays) combines rows of chunks into a tensor, tensors into a
file or a whole scan, and shards and ranks: counts add, maxima take the max,
and sums of squares add after rescaling to the largest scale.

How the work is cut (the kernels live in :mod:`gradaudit.engine.kernels`)
------------------------------------------------------------------
* With the native engine (:mod:`gradaudit.engine.native`, what ``auto`` picks on the
  CPU), contiguous CPU tensors are not cut at all: they are referenced in a
  batch and reduced in place by one call that splits the batch's bytes
  between threads.
* With the Triton kernel (:mod:`gradaudit.engine.triton_kernel`, what ``auto``
  picks for CUDA tensors), contiguous float32/16/bf16 tensors of any size
  are not cut or copied either: they wait, referenced, until the collector
  settles, and then every tensor of one dtype on one device is reduced by
  one launch (one more merges their partial rows). Strided tensors go
  through chunks and buckets (below), also reduced by Triton. The rest of
  this list is the eager kernel's (float64 and fp8 on CUDA, other devices,
  or ``--engine eager``).
* A large tensor is reduced in chunks of ``chunk_elements``
  (:mod:`gradaudit.engine.chunks`); on the CPU a
  chunk small enough to stay in cache lets the several passes of the eager
  kernel hit the cache instead of memory. On other devices chunks are as
  large as the memory budget allows (``device_chunk_elements``), since each
  costs a dozen kernel launches.
* Small tensors would pay a dozen op dispatches each, which dominates when a
  model has thousands of them. They are copied into zero-padded 2-D *buckets*
  (one row per tensor, rows of similar length share a bucket) that are reduced
  with one set of row-wise ops; the padding zeros are subtracted on the host.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence

import torch

from gradaudit.engine import native, triton_histogram, triton_kernel, triton_plan
from gradaudit.engine.buckets import Bucket, RowLayout, bucket_length
from gradaudit.engine.chunks import ChunkedKernel
from gradaudit.engine.devices import stream_key
from gradaudit.engine.dtypes import AUDITED_DTYPES, dtype_name, work_dtype
from gradaudit.engine.histogram import exponent_histogram
from gradaudit.engine.kernels import Engine, complex_magnitudes
from gradaudit.engine.native_rows import BUCKET_MAX_ELEMENTS as BUCKET_MAX_ELEMENTS
from gradaudit.engine.native_rows import NATIVE_BATCH_BYTES as NATIVE_BATCH_BYTES
from gradaudit.engine.native_rows import NATIVE_BATCH_TENSORS as NATIVE_BATCH_TENSORS
from gradaudit.engine.native_rows import NativeBatch, native_threads
from gradaudit.engine.options import DEFAULT_MEMORY_BUDGET as DEFAULT_MEMORY_BUDGET
from gradaudit.engine.routes import TritonRoutes, resolve_engine
from gradaudit.results.row import MAX_ABS as MAX_ABS
from gradaudit.results.row import NAN as NAN
from gradaudit.results.row import NEG_INF as NEG_INF
from gradaudit.results.row import POS_INF as POS_INF
from gradaudit.results.row import ROW_WIDTH as ROW_WIDTH
from gradaudit.results.row import SCALE as SCALE
from gradaudit.results.row import SSQ as SSQ
from gradaudit.results.row import ZEROS as ZEROS
from gradaudit.results.row import merge_rows as merge_rows

#: Elements in one bucket (all its rows, padding included).
BUCKET_ELEMENTS = 1 << 18


def empty_row(device: torch.device | str = "cpu") -> torch.Tensor:
    """The stats row of a tensor with no elements (also the identity of the merge)."""
    row = torch.zeros(ROW_WIDTH, dtype=torch.float64, device=device)
    # fill_ launches a kernel with the scalar as its argument; ``row[SCALE] = 1.0`` copies a
    # CPU scalar into device memory, which CUDA's sync debug mode reports as synchronizing
    # (seen on an H200, docs/gpu.md): the collector must never sync a training step.
    row.narrow(0, SCALE, 1).fill_(1.0)
    return row


class StatsCollector:
    """Turns tensors into stats rows on their device; never reads a value back.

    Use :meth:`submit` for many tensors (small ones are bucketed, or batched
    for the native kernel) and :meth:`flush` to get every row, or :meth:`row`
    for one tensor right away.

    With the native engine, CPU tensors it takes are reduced in place in one
    pass; the rest (other devices) go to the eager kernel. Which kernels
    actually ran is :attr:`engine_used`.
    """

    def __init__(
        self,
        chunk_elements: int | None = None,
        *,
        engine: Engine | str = Engine.AUTO,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        histograms: bool = False,
    ) -> None:
        self.engine = resolve_engine(engine)
        #: Also each submitted tensor's exponent histogram (``--precision``): the native
        #: kernel counts it in the same read as the row; other tensors get
        #: :func:`~gradaudit.engine.histogram.exponent_histogram`, queued on their device.
        self.histograms = histograms
        #: Ticket -> its histogram (on the tensor's device), once computed.
        self._histogram_of: dict[int, torch.Tensor] = {}
        #: What the Triton kernel takes, its waiting batches and plans.
        self._routes = TritonRoutes(engine)
        #: The engine's own kernel, a chunk at a time (half the memory budget)...
        self._eager = ChunkedKernel(self.engine, chunk_elements, memory_budget)
        self.bucket_elements = min(BUCKET_ELEMENTS, self._eager.chunk_elements)
        # ...and the other half for buckets waiting to be filled.
        self.bucket_budget = max(memory_budget // 2, 8 * self.bucket_elements)
        self._bucket_bytes = 0
        self.peak_bucket_bytes = 0
        self._native = self.engine is Engine.NATIVE
        self._native_codes = native.codes() if self._native else {}
        self._threads = native_threads()
        #: Names of the kernels that produced rows, in order of first use.
        self._ran: dict[str, None] = {}
        self._new_batch()
        self._buckets: dict[tuple[torch.device, torch.dtype, int, int], Bucket] = {}
        self._blocks: list[torch.Tensor] = []
        self._layout = RowLayout()
        self._new_streams()

    def _new_streams(self) -> None:
        """No CUDA device touched, no settle event yet."""
        #: CUDA devices with work queued since the last settle.
        self._touched: dict[torch.device, None] = {}
        #: One event per (device, stream) the kernels ran on, recorded at each settle.
        self._settled: dict[tuple[torch.device, int], torch.cuda.Event] = {}

    # -- one tensor, right away -------------------------------------------------

    def row(self, tensor: torch.Tensor) -> torch.Tensor:
        """The stats row ``[7]`` of ``tensor`` on its own device, without any host read."""
        if tensor.dtype not in AUDITED_DTYPES:
            raise TypeError(f"cannot audit dtype {dtype_name(tensor.dtype)}")
        if tensor.numel() == 0:
            return empty_row(tensor.device)
        if tensor.is_cuda:
            self._queued_on_cuda(tensor)
        if (self._native and native.handles(tensor)) or (
            tensor.is_contiguous() and self._routes.takes(tensor)
        ):
            return self._chunk_row(tensor)[0]  # whole: single-pass kernels need no chunks
        if tensor.is_complex():  # a chunk at a time: the moduli are a float64 copy
            rows = [self._chunk_row(complex_magnitudes(c)) for c in self._eager.chunks(tensor)]
        else:
            rows = [self._chunk_row(chunk) for chunk in self._eager.chunks(tensor)]
        if len(rows) == 1:
            return rows[0][0]
        return merge_rows(torch.cat(rows))

    def _chunk_row(self, chunk: torch.Tensor) -> torch.Tensor:
        """The row ``[1, 7]`` of one chunk (or a whole tensor a single-pass kernel takes as it is).

        Native copies a strided piece to make it contiguous (at most a chunk).
        """
        if self._native and native.supports(chunk):
            chunk = chunk.contiguous()
            out = torch.empty((1, ROW_WIDTH), dtype=torch.float64)
            native.tensor_row(chunk, out[0], self._threads)
            self._ran["native"] = None
            return out
        return self._block_rows(chunk.reshape(1, -1))

    def _queued_on_cuda(self, tensor: torch.Tensor) -> None:
        """Note work on a CUDA tensor read right away by kernels on the current stream.

        ``record_stream`` keeps its memory from going to another stream (a
        gradient freed by ``zero_grad(set_to_none=True)``, say) before those
        kernels have read it; the device gets a settle event.
        """
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
        self._touched[tensor.device] = None

    def _block_rows(self, block: torch.Tensor) -> torch.Tensor:
        """Rows of a block by the kernel that takes it: Triton's, else the engine's own."""
        rows = self._routes.rows(block)
        if rows is None:
            return self._fallback_rows(block)
        self._ran["triton"] = None
        return rows

    def _fallback_rows(self, block: torch.Tensor) -> torch.Tensor:
        """Rows by the engine's own kernel, a chunk at a time (:class:`ChunkedKernel`)."""
        rows = self._eager.rows(block)
        self._ran[self._eager.engine.value] = None
        return rows

    @property
    def chunk_elements(self) -> int:
        """Elements per chunk of a CPU tensor the engine's own kernel reduces."""
        return self._eager.chunk_elements

    @property
    def device_chunk_elements(self) -> int:
        """Elements per chunk of a tensor on another device (as large as the budget allows)."""
        return self._eager.device_chunk_elements

    @property
    def cpu_native_codes(self) -> Mapping[torch.dtype, int]:
        """dtype -> native code, for the CPU tensors this collector hands to the native
        kernel as they are (:meth:`submit_native`); empty when it hands it none (another
        engine, or Triton asked for by name, which takes CPU tensors too)."""
        return {} if self._routes.off_cuda else self._native_codes

    @property
    def engine_used(self) -> str:
        """The kernels that ran, joined by ``+`` (``native+eager``); the chosen one if none ran."""
        return "+".join(self._ran) or self.engine.value

    # -- many tensors -----------------------------------------------------------

    def submit(self, tensor: torch.Tensor) -> int:
        """Queue ``tensor``; returns a ticket to find its row after :meth:`flush`.

        A CPU tensor for the native kernel joins a batch and is read at the next
        :meth:`settle` or :meth:`flush` (or when the batch is full): it must not
        change before then. Everything else is read (or queued on its stream) now.
        With :attr:`histograms`, its exponent histogram too (:meth:`histogram`).
        """
        ticket = self._submit(tensor)
        if self.histograms and ticket not in self._histogram_of:
            batch = self._batch.tickets
            if not (batch and batch[-1] == ticket):  # not the native kernel's: a pass of its own
                self._histogram_of[ticket] = self._histogram(tensor)
        return ticket

    def _histogram(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor's exponent histogram in a pass of its own: one Triton launch where the
        Triton route takes the tensor now (:mod:`~gradaudit.engine.triton_histogram`), else
        torch's ops (:func:`~gradaudit.engine.histogram.exponent_histogram`). The launch
        failing is a usage error where Triton was asked for; under ``auto`` every later
        histogram takes torch's ops, and the stats kernels go on."""
        if triton_histogram.takes(tensor) and self._routes.takes(tensor):
            try:
                return triton_histogram.counts(tensor)
            except Exception as error:  # noqa: BLE001 (a compile or launch failure, as in settle)
                if self._routes.asked:
                    self._routes.failed(error)
                triton_histogram.record_failure(error)
        return exponent_histogram(tensor)

    def histogram(self, ticket: int) -> torch.Tensor:
        """The exponent histogram of a submitted tensor (after :meth:`flush`), on its device."""
        return self._histogram_of[ticket]

    def _submit(self, tensor: torch.Tensor) -> int:
        ticket = self._layout.new_ticket()
        numel = tensor.numel()
        if tensor.is_complex() and numel <= BUCKET_MAX_ELEMENTS:
            tensor = complex_magnitudes(tensor)  # small: its float64 moduli, reduced as such
        # Under auto only CUDA tensors can be Triton's: CPU tensors skip the lookup.
        if (
            self._routes.enabled
            and (tensor.is_cuda or self._routes.off_cuda)
            and numel
            and tensor.is_contiguous()
        ):
            batch = self._routes.batch_for(tensor)
            if batch is not None and batch.add(tensor, ticket):
                return ticket
        if tensor.is_cuda:
            self._queued_on_cuda(tensor)
        # The native path runs once per tensor, and with 100,000 tiny tensors its
        # Python is most of the audit: one dict lookup (empty unless native runs)
        # stands for native.supports(), and the checks are ordered cheapest first.
        code = self._native_codes.get(tensor.dtype)
        if code is not None and tensor.is_cpu:
            contiguous = tensor.is_contiguous()
            if not contiguous and numel <= BUCKET_MAX_ELEMENTS:
                tensor = tensor.contiguous()  # a small strided tensor: copied, as a bucket would
                contiguous = True
            if contiguous:
                nbytes = numel * tensor.dtype.itemsize
                if self._batch.add_one(ticket, tensor.data_ptr(), numel, code, nbytes, tensor):
                    self._reduce_batch()
                return ticket
        if numel == 0 or numel > BUCKET_MAX_ELEMENTS:
            self._add_block(self.row(tensor).unsqueeze(0), [ticket])
            return ticket
        length = bucket_length(numel)
        # Per stream: a bucket's buffer is reused, and a copy queued on another
        # stream could overwrite rows a reduction has not read yet.
        key = (tensor.device, work_dtype(tensor.dtype), length, stream_key(tensor.device))
        bucket = self._buckets.get(key)
        if bucket is None:
            rows = max(1, self.bucket_elements // length)
            nbytes = rows * length * key[1].itemsize
            while self._buckets and self._bucket_bytes + nbytes > self.bucket_budget:
                self._evict_oldest_bucket()
            buffer = torch.zeros((rows, length), dtype=key[1], device=tensor.device)
            stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
            bucket = self._buckets[key] = Bucket(buffer, stream)
            self._bucket_bytes += nbytes
            self.peak_bucket_bytes = max(self.peak_bucket_bytes, self._bucket_bytes)
        target = bucket.buffer[len(bucket.tickets), :numel]
        target.view(tensor.shape).copy_(tensor)
        bucket.tickets.append((ticket, numel))
        if len(bucket.tickets) == bucket.buffer.shape[0]:
            self._reduce_bucket(bucket)
        return ticket

    def submit_run(
        self,
        pointers: array.array[int],
        counts: array.array[int],
        dtype: torch.dtype,
        keep_alive: torch.Tensor,
    ) -> range | None:
        """Queue many contiguous CPU tensors given by address and element count.

        For a reader's :class:`~gradaudit.io.base.TensorRun`: they join the native
        batch (one call for thousands of tiny tensors), with no tensor object made
        for any of them; ``keep_alive`` (the run's view of its bytes) is held until
        the batch is reduced, and the bytes must not change before then, as for
        :meth:`submit`. Returns the tickets, or ``None`` when the native kernel does
        not take ``dtype`` (the caller then submits the tensors one by one).
        """
        code = self._native_codes.get(dtype)
        if code is None:
            return None
        count = len(pointers)
        return self.submit_native(
            pointers,
            counts,
            array.array("i", [code]) * count,
            sum(counts) * dtype.itemsize,
            keep_alive,
        )

    def submit_native(
        self,
        pointers: array.array[int],
        counts: array.array[int],
        codes: array.array[int],
        nbytes: int,
        keep_alive: object,
    ) -> range:
        """Queue contiguous CPU tensors for the native batch, as columns: address, element
        count and :func:`~gradaudit.engine.native.code` of each (``nbytes`` in all).

        :meth:`submit` of each, without a Python call per tensor: the run of a file
        (:meth:`submit_run`) and the plain CPU tensors of an in-memory audit
        (:mod:`gradaudit.engine.bulk`) come this way. ``keep_alive`` (whatever owns the
        bytes) is held until the batch is reduced; the bytes must not change before
        then. Returns the tickets, in order.
        """
        # Joining the waiting batch keeps the blocks in ticket order (materialising
        # needs no gather); reducing that batch first instead cost a native call, and a
        # thread start, for each large tensor of a file whose small tensors come
        # between its large ones (81 calls for a 210-tensor dump instead of 4).
        count = len(pointers)
        first = len(self._layout.rows)
        self._layout.rows.extend(array.array("q", [-1]) * count)
        tickets = range(first, first + count)
        if self._batch.add(tickets, pointers, counts, codes, nbytes, keep_alive):
            self._reduce_batch()
        return tickets

    def submit_planned(
        self, tensors: list[torch.Tensor]
    ) -> tuple[range, triton_plan.TritonPlan] | None:
        """Queue a list of tensors in one Triton flush planned once per list of facts
        (:mod:`~gradaudit.engine.triton_plan`: a training loop's gradients, every step).

        Launched now: the values are read in stream order, as :meth:`settle` would. Returns
        the tickets (in list order) and the plan (its shape columns are the caller's), or
        ``None`` when the list is not for this path: the first list of this collector and
        its fresh ones on that device where torch's C shim is not bound (a one-off audit
        then plans nothing: planning through torch's binding costs more than the
        per-tensor flush), an empty list, a
        tensor the Triton kernel would not take as it is (another device or dtype,
        strided, empty, a subclass), a route the collector would not send to Triton now
        (``auto`` waiting to compile), histograms asked for, or addresses the plan cannot
        use this step. The caller then submits the tensors one by one.
        """
        if self.histograms:
            return None
        launched = self._routes.launch_planned(tensors)
        if launched is None:
            return None
        out, plan = launched
        self._blocks.append(out)
        tickets = self._layout.new_placed(plan.rows_of, plan.rows)
        if tensors[0].is_cuda:
            self._touched[tensors[0].device] = None
        self._ran["triton"] = None
        return tickets, plan

    def settle(self) -> None:
        """Reduce the native batch and launch the Triton batches now: until then their
        tensors are only referenced; then record each CUDA device's settle event.

        Callers whose tensors may change (gradients about to be zeroed or
        stepped) settle before handing control back; a file's data need not.
        Readers of the rows (:func:`~gradaudit.engine.host_read.read_blocks`,
        ``PendingStats.prefetch``) make their stream wait for the events, so rows
        collected on a side stream are read after the kernels that wrote them,
        whatever stream is current when they are read.
        """
        if self._batch:
            self._reduce_batch()
        if self._routes.batches:
            self._launch_triton()
        self._routes.forget_routes()
        if self._touched:
            for device in self._touched:
                self._record_settled(torch.cuda.current_stream(device))
            self._touched = {}

    def _record_settled(self, stream: torch.cuda.Stream) -> None:
        """Record the settle event of ``stream``: readers wait for what is queued on it."""
        key = (stream.device, stream.stream_id)
        event = self._settled.get(key)
        if event is None:
            event = self._settled[key] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)

    def settled(self) -> dict[torch.device, list[torch.cuda.Event]]:
        """The settle events of each CUDA device, for readers to wait on (on the device)."""
        events: dict[torch.device, list[torch.cuda.Event]] = {}
        for (device, _), event in self._settled.items():
            events.setdefault(device, []).append(event)
        return events

    def _launch_triton(self) -> None:
        """One launch per dtype and device for every tensor in the Triton batches."""
        for device, batch in self._routes.take_batches().items():
            if not len(batch):
                continue
            launched = self._routes.launch(batch)
            if launched is None:
                for tensor, ticket in batch.entries():  # auto: the eager kernel takes them
                    self._add_block(self._fallback_whole(tensor), [ticket])
                continue
            out, tickets = launched
            if device.type == "cuda":
                self._touched[device] = None
                triton_kernel.mark_warm(device)
            self._add_block(out, tickets, unused_rows=True)
            self._ran["triton"] = None

    def _fallback_whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """The row ``[1, 7]`` of a whole tensor by the engine's own kernel, in chunks."""
        if tensor.is_cuda:
            self._queued_on_cuda(tensor)
        rows = [self._fallback_rows(chunk.reshape(1, -1)) for chunk in self._eager.chunks(tensor)]
        return rows[0] if len(rows) == 1 else merge_rows(torch.cat(rows)).unsqueeze(0)

    def adopt(self, row: torch.Tensor) -> int:
        """Take a row computed elsewhere (merged across ranks, sent by another rank)."""
        ticket = self._layout.new_ticket()
        self._add_block(row.reshape(1, ROW_WIDTH), [ticket])
        if row.is_cuda:
            self._touched[row.device] = None
        return ticket

    def fresh(self) -> StatsCollector:
        """An empty collector sharing this one's kernel and scratch buffers.

        A training loop collects every few steps; a fresh collector per
        collection keeps rows from piling up while the buffers are reused.
        """
        other = StatsCollector.__new__(StatsCollector)
        other.__dict__.update(self.__dict__)
        other._buckets = {}
        other._bucket_bytes = 0
        other._blocks = []
        other._layout = RowLayout()
        other._histogram_of = {}
        other._new_batch()
        other._new_streams()
        other._routes = self._routes.fresh()
        other._ran = {}
        return other

    def flush(self) -> list[torch.Tensor]:
        """Reduce what is still bucketed; every block of rows, in order (see :meth:`gather`)."""
        for bucket in self._buckets.values():
            if bucket.tickets:
                self._reduce_bucket(bucket)
        self.settle()
        self._layout.check_placed()
        return list(self._blocks)

    def gather(
        self, tickets: Sequence[int], blocks: list[torch.Tensor], *, fresh: bool = True
    ) -> torch.Tensor:
        """The rows ``[len(tickets), 7]`` of ``tickets``, in that order, bucket padding taken out.

        ``blocks`` are :meth:`flush`'s blocks, or their host copy (one read).
        A new tensor, unless ``fresh=False`` lets a single block come back as it
        is (for a caller that only reads it: a fresh copy of a large block costs
        its page faults); nothing is read back (it runs on ``meta`` too).
        """
        single = len(blocks) == 1
        if single:
            stacked = blocks[0]
        else:
            empty = torch.empty((0, ROW_WIDTH), dtype=torch.float64)
            stacked = torch.cat(blocks) if blocks else empty
        index, padding = self._layout.index(tickets)
        if index is None:  # tickets are the blocks' rows in order: no gather
            rows = stacked.clone() if single and (fresh or padding is not None) else stacked
        else:
            rows = stacked.index_select(
                0, torch.tensor(index, dtype=torch.long, device=stacked.device)
            )
        if padding is not None:
            rows[:, ZEROS] -= torch.tensor(padding, dtype=rows.dtype, device=rows.device)
        return rows

    def _evict_oldest_bucket(self) -> None:
        """Reduce and free the oldest bucket, to stay within the memory budget."""
        key = next(iter(self._buckets))
        bucket = self._buckets.pop(key)
        if bucket.tickets:
            self._reduce_bucket(bucket)
        self._bucket_bytes -= bucket.buffer.numel() * bucket.buffer.element_size()

    def _reduce_batch(self) -> None:
        """Rows of the batched CPU tensors, in one native call; then let them go."""
        if self.histograms:
            host_rows, counts = self._batch.reduce_with_histograms(self._threads)
            rows = torch.from_numpy(host_rows)
            self._histogram_of.update(
                zip(self._batch.tickets, torch.from_numpy(counts), strict=True)
            )
        else:
            rows = torch.from_numpy(self._batch.reduce(self._threads))
        self._add_block(rows, self._batch.tickets)
        self._ran["native"] = None
        self._new_batch()

    def _add_block(
        self,
        rows: torch.Tensor,
        tickets: list[int],
        padding: list[int] | None = None,
        *,
        unused_rows: bool = False,
    ) -> None:
        """Keep a block of rows: row ``i`` belongs to ``tickets[i]`` (-1: to none, when
        ``unused_rows``, as the Triton batch's per-group sentinel rows)."""
        self._blocks.append(rows)
        self._layout.place(tickets, padding, unused_rows=unused_rows)

    def _new_batch(self) -> None:
        """An empty native batch: the tensors (kept alive) and their addresses, sizes, dtypes."""
        self._batch = NativeBatch()

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """Reduce a bucket's filled rows on the stream they were copied in on.

        A flush or an eviction may come while another stream is current (a monitor
        that collects on a side stream and reads on the default one): there the
        reduction would not wait for the copies, and that stream gets a settle event.
        """
        stream = bucket.stream
        if stream is None or stream == torch.cuda.current_stream(stream.device):
            self._reduce_bucket_here(bucket)
            return
        with torch.cuda.stream(stream):
            self._reduce_bucket_here(bucket)
            self._record_settled(stream)

    def _reduce_bucket_here(self, bucket: Bucket) -> None:
        used = bucket.buffer[: len(bucket.tickets)]
        length = used.shape[1]
        self._add_block(
            self._block_rows(used),
            [ticket for ticket, _ in bucket.tickets],
            [length - numel for _, numel in bucket.tickets],
        )
        used.zero_()  # padding must read as zero next time; stream-ordered on CUDA
        bucket.tickets.clear()
