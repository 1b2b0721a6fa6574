"""The fused single-pass kernel for CUDA, written in Triton: one launch per dtype and flush.

On a GPU the eager kernel's dozen ops each read the data again, so its
throughput is a fraction of the memory bandwidth; this kernel reads every
element once and keeps all the statistics in registers: NaN, ±Inf and zero
counts, the finite max|x| and a float64 sum of squares (exact for every
float32/float16/bfloat16 square, so it cannot overflow).

Launching per tensor would cost more on the host than the GPU takes to read
the tensor (a launch and a merge are tens of microseconds; an H100 reads a
4 MiB gradient in about 1.3 µs). So tensors are not launched one by one:
a :class:`TritonBatch` gathers every tensor of one device until the
collector settles, then one :func:`~gradaudit.engine._triton_rows.table_rows`
launch per dtype reduces all of them, reading a table of (first program,
element offset, length, span) rows, and one
:func:`~gradaudit.engine._triton_rows.merge_partials` launch merges every tensor's
partial rows into its stats row (the multi-tensor-apply pattern of
``torch._foreach_*``). The host work per tensor is a few integer
operations and appends; a training loop's list of tensors, the same every
step, is planned once instead (:mod:`gradaudit.engine.triton_plan`: the table
kept, the addresses written); ``benchmarks/bench_gpu.py`` measures both.

It takes float32, float16 and bfloat16. Float64 needs the scaled sum of
squares and fp8 conversions differ between GPU generations: those stay with
the eager kernel, as do tensors on devices Triton does not target.

Triton is imported on first use only (it costs an import of its own).
``TRITON_INTERPRET=1`` runs the kernels through Triton's interpreter on CPU
tensors, which is how the CPU-only test suite checks them against float64;
CUDA tensors are never sent to the interpreter (it would copy them to the
host one by one), they go to the eager kernel instead.
"""

from __future__ import annotations

import array
import functools
import importlib.util
import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from gradaudit.engine import warmup

#: Elements loaded per vector step of a program (a power of two): with 4 warps,
#: 8 per thread, i.e. one or two 128-bit loads.
BLOCK = 1024
#: Vectors of ``BLOCK`` elements one iteration of the inner loop loads (together, before
#: it uses them: the bytes in flight per program); spans are whole multiples of ``STEP``.
VECTORS = 2
STEP = VECTORS * BLOCK
#: Vector steps one program takes at most: each lane counts NaN, +Inf, -Inf and
#: zeros in one byte each, so a lane may see at most 255 elements (these steps
#: plus the two masked edge steps).
MAX_STEPS = 128
#: Vector steps one program takes at least when its tensor has them: a program's fixed
#: work (the row lookup, the edges, seven reductions) is several hundred instructions,
#: tens of steps' worth of the inner loop's issue slots (``tests/gpu_model.py``).
MIN_STEPS = 16
#: Programs per SM a dtype group's span aims at (``span_for``).
PROGRAMS_PER_SM = 4
#: Iterations of the inner loop in flight at once (``tl.range``'s ``num_stages``: with 2 or
#: more, Triton copies the next iterations' vectors into shared memory, ``cp.async``, while
#: one is reduced). 1 loads an iteration's two vectors when it starts. The GPU check's
#: ``launch-shapes`` step measures 2 and 3 beside it: on the H200 (docs/gpu.md, the run of
#: ``6e62740``) 3 stages read one 32-64 MiB tensor 10-18 % faster but the transformer and
#: 7B-like layouts, which carry a training step's bytes, 5-9 % slower; so 1.
STAGES = 1
#: Elements of a tensor reduced by one program: a quarter of the SMs' share of the whole
#: dtype group (``span_for``), within these bounds.
MIN_SPAN = MIN_STEPS * BLOCK
MAX_SPAN = MAX_STEPS * BLOCK
#: SMs assumed where the device cannot tell (the interpreter): an H100's.
DEFAULT_SMS = 132
#: Partial rows merged per vector step of :func:`merge_partials`.
MERGE_PARTS = 64
#: Block dtypes the kernel reads, and the kernel's ``KIND`` for each.
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Bytes one 128-bit load takes: offsets are aligned to this many bytes.
VECTOR_BYTES = 16
#: Columns of a table row (see :mod:`gradaudit.engine._triton_rows`).
TABLE_WIDTH = 4
#: Compile options of every launch, pinned instead of left to Triton's defaults: with
#: fusion on, each float64 square is added by one DFMA; Triton's default has changed
#: between versions (``TRITON_DEFAULT_FP_FUSION=0`` emulates one that turns it off),
#: and without it the loop pays a DMUL and a DADD per element. The budget test compiles
#: the launches themselves, these options included.
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": True}


@functools.cache
def installed() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA builds); looked up once."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` runs kernels on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether the kernel takes tensors on ``device``.

    CUDA when Triton is installed and not interpreting (the interpreter would
    run on host copies of CUDA tensors, which the table's cross-tensor
    addressing cannot use); the CPU under the interpreter.
    """
    if device.type == "cuda":
        return installed() and not interpreting()
    return device.type == "cpu" and interpreting() and installed()


def takes(block: torch.Tensor) -> bool:
    """Whether a tensor can be reduced here (otherwise the eager kernel does it)."""
    return block.dtype in KINDS and runs_on(block.device) and failure() is None


# -- what failed, once per process ------------------------------------------------

_failure: str | None = None


def failure() -> str | None:
    """Why the kernels could not compile or run in this process, or ``None``.

    Module-level on purpose: a failing compile (no C compiler for Triton's
    launcher, an unsupported GPU) takes seconds, and every collector and every
    ``audit()`` would otherwise try again.
    """
    return _failure


def record_failure(error: BaseException) -> str:
    """Remember that the kernels failed; returns the one-line cause."""
    global _failure
    text = str(error).strip()
    cause = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    _failure = cause
    return cause


def reset_failure() -> None:
    """Forget a recorded failure (tests; a process that fixed its compiler)."""
    global _failure
    _failure = None


# -- whether a compile is worth it -------------------------------------------------

#: Under ``auto``, bytes of CUDA float32/16/bf16 data the eager kernel reduces
#: while the kernels are not compiled yet, before they are compiled: a cold compile
#: costs seconds, more than the eager kernel's extra passes over a small scan.
COMPILE_AFTER_BYTES = 1 << 30
_deferred_bytes = 0
#: GPU architectures whose kernels are compiled (or on disk) in this process.
_warm: set[str] = set()


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.cache
def _marker(arch: str) -> str:
    """A file next to Triton's cache saying this package's kernels were compiled for ``arch``.

    Named after the kernels' source and Triton's version, so an edited kernel or
    another Triton is cold again. (Whether Triton's own cache still holds them
    cannot be asked without compiling; a cache cleared since costs one compile.)
    """
    import hashlib

    import triton

    source = os.path.join(os.path.dirname(__file__), "_triton_rows.py")
    with open(source, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:16]
    directory = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".triton", "cache"
    )
    return os.path.join(directory, f"gradaudit-{digest}-{arch}-triton{triton.__version__}")


def compile_worth(device: torch.device) -> bool:
    """Whether ``auto`` should launch (and so maybe compile) the kernels on ``device`` now.

    Yes when they are compiled for its architecture in this process or were in an
    earlier one (its marker), or when the background compile (:mod:`.warmup`, started
    here on the first call) has finished; no while it runs, so the step never waits for a
    compile. Where the background compile failed (or is off), the rule before it: yes
    once ``COMPILE_AFTER_BYTES`` went through the eager kernel instead. Always yes off
    CUDA (the interpreter compiles nothing).
    """
    if device.type != "cuda":
        return True
    arch = _arch(device)
    if arch in _warm:
        return True
    if os.path.exists(_marker(arch)):
        _warm.add(arch)
        return True
    if warmup.ENABLED:
        index = device.index if device.index is not None else torch.cuda.current_device()
        state = warmup.poll(arch, index)
        if state is warmup.State.DONE:
            _warm.add(arch)
            return True
        if state is warmup.State.RUNNING:
            return False
    return _deferred_bytes >= COMPILE_AFTER_BYTES


def defer(nbytes: int) -> bool:
    """Count bytes the eager kernel took because the kernels were not compiled yet;
    returns whether ``COMPILE_AFTER_BYTES`` is reached (the caller's cold route ends)."""
    global _deferred_bytes
    _deferred_bytes += nbytes
    return _deferred_bytes >= COMPILE_AFTER_BYTES


def mark_warm(device: torch.device) -> None:
    """The kernels ran on ``device``: compiled for its architecture, here and on disk."""
    if device.type != "cuda":
        return
    arch = _arch(device)
    if arch in _warm:
        return
    _warm.add(arch)
    try:
        path = _marker(arch)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError:
        pass  # a read-only home: the next process compiles again, nothing worse


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The Triton functions, imported once (after ``TRITON_INTERPRET`` is known)."""
    from gradaudit.engine._triton_rows import merge_partials, table_rows  # needs triton

    return table_rows, merge_partials


#: GPUs whose float64 runs at about 2 operations per clock per SM, by compute capability:
#: T4 (7.5), A10/A40/RTX 30xx (8.6), Orin (8.7), L4/L40S/RTX 40xx (8.9), B300 (10.3),
#: Thor (11.0), RTX 50xx/RTX PRO (12.0), GB10 (12.1). Data-centre parts (7.0, 8.0, 9.0,
#: 10.0) run 32-64 per clock. A later 12.x or 11.x is taken as slow too (``_slow_fp64``).
SLOW_FP64 = frozenset({(7, 5), (8, 6), (8, 7), (8, 9), (10, 3), (11, 0), (12, 0), (12, 1)})
#: Whether squares accumulate in compensated float32 (``None``: by the GPU, as above;
#: the tests set it to run that variant through the interpreter).
FP32_ACCUMULATE: bool | None = None


def fp32_accumulate(device: torch.device) -> bool:
    """Whether squares (of every dtype) add up in compensated float32 on ``device``.

    One float64 FMA per element is free on data-centre GPUs (64 per clock per SM)
    and the bottleneck where float64 runs at 2 per clock per SM: an A10 would
    need 300 G of them per second for bfloat16 at its 600 GB/s and has 244 G, and
    float32's conversion and FMA, both on the float64 unit, cap it near 80 %.
    Not everywhere: the float32 sums are exact to about 3e-10 (float32 tensors) or
    2.4e-10 (bfloat16) of the sum of squares, the float64 sums to about 1e-14
    (docs/gpu.md).
    """
    if FP32_ACCUMULATE is not None:
        return FP32_ACCUMULATE
    return device.type == "cuda" and _slow_fp64(device)


@functools.cache
def _slow_fp64(device: torch.device) -> bool:
    capability = torch.cuda.get_device_capability(device)
    return capability in SLOW_FP64 or capability[0] in (11, 12)


def sms_of(device: torch.device) -> int:
    """SMs of a CUDA device (looked up once per device); ``DEFAULT_SMS`` elsewhere."""
    return _cuda_sms(device) if device.type == "cuda" else DEFAULT_SMS


@functools.cache
def _cuda_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def span_for(numel: int, sms: int = DEFAULT_SMS) -> int:
    """Elements per program for every tensor of a dtype group of ``numel`` elements in all:
    ``PROGRAMS_PER_SM`` programs per SM over the whole group, whole steps, ``MIN_STEPS`` to
    ``MAX_STEPS``.

    Sized from the group, not from each tensor: per tensor, a transformer's 1024×1024
    layers got 2-step programs whose fixed work outweighed their loads (issue 31). A
    tensor shorter than the span is one program of its own length.
    """
    per_program = -(-numel // (PROGRAMS_PER_SM * sms))
    steps = -(-per_program // STEP) * VECTORS
    return min(MAX_STEPS, max(MIN_STEPS, steps)) * BLOCK


def spans(lengths: Sequence[int], sms: int = DEFAULT_SMS) -> list[int]:
    """The span of each tensor of one dtype group, as :class:`TritonBatch` sizes them
    (the bandwidth model in ``tests/gpu_model.py`` plans a flush with it)."""
    return [span_for(sum(lengths), sms)] * len(lengths)


@dataclass
class _Group:
    """The tensors of one dtype in a batch, addressed from the first one's pointer."""

    base: torch.Tensor
    base_pointer: int
    itemsize: int
    #: TABLE_WIDTH int64 per tensor: first program, element offset, length, span (the
    #: first program and the span are filled in at launch, from the group's size).
    table: array.array[int] = field(default_factory=lambda: array.array("q"))
    elements: int = 0
    programs: int = 0
    tensors: list[torch.Tensor] = field(default_factory=list)
    tickets: list[int] = field(default_factory=list)


class TritonBatch:
    """Tensors of one device waiting for one launch per dtype (see the module doc).

    :meth:`add` only takes a reference and appends four integers; :meth:`launch`
    queues the kernels and returns the stats rows. The tensors must not change
    in between (the collector launches at every settle).
    """

    def __init__(self, device: torch.device, *, sms: int | None = None) -> None:
        """``sms``: the SMs spans are sized for (default: the device's own, ``DEFAULT_SMS``
        off CUDA); fewer make longer spans on any device (the tests' longest span)."""
        self.device = device
        self._sms = sms_of(device) if sms is None else sms
        self._fp32_accumulate = fp32_accumulate(device)
        self._groups: dict[torch.dtype, _Group] = {}

    def __len__(self) -> int:
        return sum(len(group.tensors) for group in self._groups.values())

    def add(self, tensor: torch.Tensor, ticket: int) -> bool:
        """Queue a contiguous, non-empty float32/16/bf16 ``tensor``; ``False`` if it cannot join.

        A tensor whose address is not a whole number of elements away from the
        group's base (a view at an odd byte offset) cannot be addressed from it.
        """
        pointer = tensor.data_ptr()
        group = self._groups.get(tensor.dtype)
        if group is None:
            if pointer % VECTOR_BYTES:
                return False  # the base must be 16-byte aligned; a later tensor may be
            group = _Group(tensor, pointer, tensor.element_size())
            self._groups[tensor.dtype] = group
        offset, misaligned = divmod(pointer - group.base_pointer, group.itemsize)
        if misaligned:
            return False
        numel = tensor.numel()
        group.table.extend((0, offset, numel, 0))
        group.elements += numel
        group.tensors.append(tensor)
        group.tickets.append(ticket)
        return True

    def entries(self) -> list[tuple[torch.Tensor, int]]:
        """Every queued tensor with its ticket (for a fallback when the launch failed:
        a failed launch keeps them)."""
        return [
            (tensor, ticket)
            for group in self._groups.values()
            for tensor, ticket in zip(group.tensors, group.tickets, strict=True)
        ]

    def launch(self) -> tuple[torch.Tensor, list[int]]:
        """Queue the kernels: stats rows ``[r, 7]`` and the ticket of each row (-1: unused).

        On CUDA the kernels run on the current stream, and every input tensor
        is recorded on it, so memory freed meanwhile (``zero_grad``) is not
        given to another stream before the kernels read it.
        """
        groups = [group for group in self._groups.values() if group.tensors]
        tables: list[torch.Tensor] = []
        maps: list[torch.Tensor] = []
        tickets: list[int] = []
        launches: list[GroupLaunch] = []
        programs = rows = 0
        for group in groups:
            # One sentinel row per group: its first program ends the last tensor's range.
            group.table.extend((0, 0, 0, 0))
            table = torch.frombuffer(group.table, dtype=torch.int64).view(-1, TABLE_WIDTH)
            group.programs = plan_group(table, group.elements, programs, self._sms, maps)
            tables.append(table)
            tickets += group.tickets
            tickets.append(-1)
            launches.append(GroupLaunch(group.base, group.itemsize, group.programs, programs, rows))
            programs += group.programs
            rows += table.shape[0]
        host = flush_table(tables, maps, programs)
        out = launch_flush(self.device, host, launches, rows, programs, self._fp32_accumulate)
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for group in groups:
                for tensor in group.tensors:
                    tensor.record_stream(stream)
        self._groups = {}
        return out, tickets


@dataclass(frozen=True)
class GroupLaunch:
    """One dtype group of a flush: the tensor its table's offsets count from, and where its
    programs and table rows start in the flush."""

    base: torch.Tensor
    itemsize: int
    programs: int
    first_program: int
    first_row: int


def plan_group(
    table: torch.Tensor, elements: int, first_program: int, sms: int, maps: list[torch.Tensor]
) -> int:
    """Fill a group's first-program and span columns (its lengths, ``elements`` in all, and a
    sentinel row are in ``table``), append its program -> row map to ``maps``; returns its programs.

    One span for the group; each tensor's programs, first programs counted across the
    groups (host arithmetic on the table, a few ops per group). The map: a 1 where each
    later row's programs start, summed up (``repeat_interleave`` would be one op, but it
    wakes the intra-op threads: milliseconds on a busy CPU).
    """
    span = span_for(elements, sms)
    counts = (table[:, 2] + (span - 1)) // span
    ends = torch.cumsum(counts, 0)
    table[:, 0] = ends - counts + first_program
    table[:, 3] = span
    programs = int(ends[-1])
    starts = torch.zeros(programs + 1, dtype=torch.int64)
    firsts = (ends - counts)[1:]
    starts.index_add_(0, firsts, torch.ones_like(firsts))
    maps.append(torch.cumsum(starts, 0)[:programs])
    return programs


def flush_table(
    tables: list[torch.Tensor], maps: list[torch.Tensor], programs: int
) -> torch.Tensor:
    """The host buffer of a flush: every group's table, a last row whose first program ends
    the last sentinel's (empty) range, then the maps: one buffer, one copy."""
    last = torch.tensor([[programs, 0, 0, 0]], dtype=torch.int64)
    return torch.cat([table.flatten() for table in [*tables, last]] + maps)


def launch_flush(
    device: torch.device,
    host: torch.Tensor,
    groups: Sequence[GroupLaunch],
    rows: int,
    programs: int,
    fp32_accumulate: bool,
) -> torch.Tensor:
    """Copy a flush's table to ``device`` and queue one ``table_rows`` launch per group and
    one ``merge_partials`` (none when every tensor is one program, :func:`is_direct`);
    returns the stats rows ``[rows, 7]`` (sentinel rows included, and not written when
    nothing is merged).

    The tensors' lifetimes are the caller's (``record_stream``, or holding them until the
    settle event: :mod:`gradaudit.engine.triton_plan`).
    """
    cuda = device.type == "cuda"
    # Everything on the tensors' device, whichever device is current (no
    # context is made on another GPU).
    context: Any = torch.cuda.device(device) if cuda else nullcontext()
    with context:
        # Pinned, so the copy is queued rather than waited for; the caching host allocator
        # keeps the pinned block until the copy has run (so the host buffer may change).
        flat = host.pin_memory().to(device, non_blocking=True) if cuda else host
        return launch_kernels(device, flat, groups, rows, programs, fp32_accumulate)


def launch_kernels(
    device: torch.device,
    flat: torch.Tensor,
    groups: Sequence[GroupLaunch],
    rows: int,
    programs: int,
    fp32_accumulate: bool,
) -> torch.Tensor:
    """The kernels of :func:`launch_flush`, reading a table already on ``device`` (``flat``):
    what a captured flush (:mod:`~gradaudit.engine.triton_graph`) records and replays. The
    caller has made ``device`` current."""
    table_rows, merge_partials = _kernels()
    width = (rows + 1) * TABLE_WIDTH
    table = flat[:width].view(-1, TABLE_WIDTH)
    program_rows = flat[width:]
    out = torch.empty((rows, 7), dtype=torch.float64, device=device)
    # Partial rows only where a tensor has several programs (see is_direct).
    partial = (
        None
        if is_direct(rows, programs, len(groups))
        else torch.empty((programs, 7), dtype=torch.float64, device=device)
    )
    for group in groups:
        kind = KINDS[group.base.dtype]
        base = group.base.view(torch.int16) if kind == 1 else group.base
        table_rows[(group.programs,)](
            base,
            table[group.first_row :],
            program_rows,
            out[group.first_row :] if partial is None else partial,
            group.first_program,
            BLOCK=BLOCK,
            LANES=BLOCK // 2 if kind == 1 else BLOCK,
            VEC=VECTOR_BYTES // group.itemsize,
            KIND=kind,
            FP32_ACC=fp32_accumulate,
            STAGES=STAGES,
            DIRECT=partial is None,
            # float32 through float32 sums keeps six per element and lane: with
            # 8 warps a thread holds 4 elements of a vector, not 8 (no spills).
            num_warps=8 if kind == 0 and fp32_accumulate else 4,
            **LAUNCH_OPTIONS,
        )
    if partial is None:
        return out
    # One warp per stats row: most rows merge a handful of partial rows.
    merge_partials[(rows,)](
        partial, table, out, rows, PARTS=MERGE_PARTS, num_warps=1, **LAUNCH_OPTIONS
    )
    return out


def is_direct(rows: int, programs: int, groups: int) -> bool:
    """Whether every tensor of a flush (``rows`` stats rows, a sentinel per group among them)
    is one program of ``programs``: each program's row is then its tensor's stats row, and
    nothing is merged (``table_rows``' ``DIRECT``). The sentinel rows are then left unwritten;
    no ticket reads them."""
    return programs == rows - groups


class TritonKernel:
    """Stats rows ``[m, 7]`` of a contiguous float32/float16/bfloat16 block ``[m, L]``.

    The block API of the other row kernels (buckets, chunks of strided
    tensors): each row is one entry of a batch, all in one launch.
    """

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        if block.dtype not in KINDS or not runs_on(block.device):
            raise TypeError(
                f"the Triton kernel takes float32/float16/bfloat16 blocks on CUDA, "
                f"not {block.dtype} on {block.device}"
            )
        block = block.contiguous()
        if block.data_ptr() % VECTOR_BYTES:
            block = block.clone()  # caching allocators align fresh memory
        batch = TritonBatch(block.device)
        for index, row in enumerate(block):
            if row.numel() and not batch.add(row, index):
                raise AssertionError("a contiguous block's rows are whole elements apart")
        if not len(batch):
            return _empty_rows(block.shape[0], block.device)
        out, _ = batch.launch()
        return out[: block.shape[0]]  # one group: the rows in order, then its sentinel


def _empty_rows(count: int, device: torch.device) -> torch.Tensor:
    rows = torch.zeros((count, 7), dtype=torch.float64, device=device)
    rows[:, 5].fill_(1.0)  # a kernel with a scalar argument: no host-to-device copy
    return rows
