"""A training loop's Triton flush, planned once per list of tensors and refilled every step.

:class:`~gradaudit.engine.triton_kernel.TritonBatch` builds a flush's table from each
tensor as it comes: a Python call, a dozen attribute reads and four appends per tensor,
about 2 µs each, then a table, a program -> row map and a placement per flush. A
training loop hands the same list every step: the same gradients of the same
parameters, of the same dtypes and sizes, on the same device. Only where each gradient
lives may change (``zero_grad(set_to_none=True)`` frees them, the next backward pass
allocates new ones).

So a :class:`TritonPlan` keeps everything of a flush that follows from the list's
dtypes and element counts: the dtype groups, every table column but the offsets (first
program, length, span), the program -> row map, each tensor's row, and the shapes for the
results. Each step reads four facts of every tensor (dtype, shape, device, contiguity),
compares them with the plan's and gathers the addresses, in one C loop: through torch's C
shim where it is bound (:mod:`~gradaudit.engine.torch_shim`, a few nanoseconds a
tensor), else through torch's own accessors (:func:`~gradaudit.engine.native.
planned_pointers`; without the native build, one ``map`` per fact), writes the offsets
into a copy of the cached table (numpy, a few operations per dtype group) and launches.
A list that differs in any fact makes a new plan; one whose addresses cannot be
addressed from its group's first tensor (a view at an odd byte offset, a first tensor off
a 16-byte boundary) goes the per-tensor way for that step.

Lifetimes. The per-tensor path ``record_stream``-s every tensor on the kernels' stream
(~1-2 µs each on a GPU's host). Here nothing per tensor: on a device's default stream
the memory of a gradient freed meanwhile goes back to that stream's pool and is only
handed to work queued after the kernels, which is what ``record_stream`` would ensure;
on any other stream the step's list is held (:func:`hold`) until an event after the
kernels has completed, and let go by a later flush or read (:func:`release_finished`).
"""

from __future__ import annotations

import array
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradaudit.engine import native, torch_shim, triton_graph, triton_kernel
from gradaudit.engine.dtypes import dtype_name
from gradaudit.engine.triton_kernel import (
    KINDS,
    TABLE_WIDTH,
    VECTOR_BYTES,
    GroupLaunch,
    flush_table,
    launch_flush,
    launch_kernels,
    plan_group,
)

#: Exact types whose instances are plain tensors (:data:`~gradaudit.engine.torch_shim.PLAIN`).
PLAIN = frozenset(torch_shim.PLAIN)
_PLAIN = torch_shim.PLAIN
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_NUMEL = torch.Tensor.numel
_CONTIGUOUS = torch.Tensor.is_contiguous
_DEVICE_INDEX = torch.Tensor.get_device
_DATA_PTR = torch.Tensor.data_ptr


@dataclass(frozen=True)
class _PlanGroup:
    """One dtype group of a plan: its tensors' indices in the list, in order."""

    dtype: torch.dtype
    indices: np.ndarray
    itemsize: int
    programs: int
    first_program: int
    first_row: int


@dataclass(frozen=True)
class ListFacts:
    """What a plan is made from, as columns: the list's dtypes (each once, in the order
    they first come), each tensor's (an index into them), element count and shape (each
    rank, then every dimension)."""

    dtypes: list[torch.dtype]
    codes: np.ndarray
    numels: np.ndarray
    ranks: array.array[int]
    dims: array.array[int]

    @classmethod
    def asked(cls, tensors: Sequence[torch.Tensor], shapes: list[torch.Size]) -> ListFacts:
        """The facts through torch's binding: a pass per fact."""
        dtypes = list(map(_DTYPE, tensors))
        order = list(dict.fromkeys(dtypes))
        return cls(
            order,
            np.array([order.index(dtype) for dtype in dtypes], dtype=np.int64),
            np.array(list(map(_NUMEL, tensors)), dtype=np.int64),
            array.array("q", map(len, shapes)),
            array.array("q", [size for shape in shapes for size in shape]),
        )

    @classmethod
    def read(cls, tensors: list[torch.Tensor]) -> ListFacts | None:
        """The facts in one C pass through torch's C shim, when every tensor is plain,
        contiguous, on the first one's device and of a dtype the extension has a code for;
        ``None`` when one is not, or the shim is not bound."""
        columns = native.device_columns(tensors, _PLAIN)
        if columns is None:
            return None
        ok, _, counts, kinds, ranks, dims, _ = columns
        if ok.count(1) != len(tensors):
            return None
        kernel_codes = np.frombuffer(kinds, dtype=np.int32)
        distinct, firsts, inverse = np.unique(kernel_codes, return_index=True, return_inverse=True)
        by_first = np.argsort(firsts)  # the dtypes in the order they first come
        rank_of = np.empty(len(distinct), dtype=np.int64)
        rank_of[by_first] = np.arange(len(distinct))
        return cls(
            [native.dtype_of(int(code)) for code in distinct[by_first]],
            rank_of[inverse.reshape(-1)],
            np.frombuffer(counts, dtype=np.uint64).astype(np.int64),
            _int64_column(ranks),
            _int64_column(dims),
        )


def _int64_column(data: bytes) -> array.array[int]:
    column = array.array("q")
    column.frombytes(data)
    return column


class TritonPlan:
    """The flush of one list of tensors, all but their addresses (see the module doc).

    Built from a list's facts; :meth:`matches` tells whether another list has the same
    facts, :meth:`launch` queues the flush of a matching list.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], sms: int, facts: ListFacts | None = None
    ) -> None:
        first = tensors[0]
        self.device = first.device
        #: Each tensor's shape and device index from torch's binding, for the binding's
        #: checks of later lists (a plan made from the C shim's facts is checked by the
        #: shim, against its signature).
        self._asked: tuple[list[torch.Size], list[int]] | None = None
        if facts is None:
            shapes = list(map(_SHAPE, tensors))
            self._asked = (shapes, list(map(_DEVICE_INDEX, tensors)))
            facts = ListFacts.asked(tensors, shapes)
        order = facts.dtypes
        codes = facts.codes
        numels = facts.numels
        #: The shapes as a collection keeps them: each rank, then every dimension.
        self.ranks = facts.ranks
        self.dims = facts.dims
        self.dtypes: list[torch.dtype] = np.array(order, dtype=object)[codes].tolist()
        self.dtype_names: list[str] = np.array(
            [dtype_name(dtype) for dtype in order], dtype=object
        )[codes].tolist()
        self._fp32_accumulate = triton_kernel.fp32_accumulate(self.device)
        tables: list[torch.Tensor] = []
        maps: list[torch.Tensor] = []
        self._groups: list[_PlanGroup] = []
        #: The row of each tensor in the flush's stats rows (its group's rows, then a sentinel).
        self.rows_of = np.empty(len(codes), dtype=np.int64)
        programs = rows = 0
        for code, dtype in enumerate(order):
            indices = np.flatnonzero(codes == code)
            table = torch.zeros((len(indices) + 1, TABLE_WIDTH), dtype=torch.int64)
            table[:-1, 2] = torch.from_numpy(numels[indices])
            elements = int(numels[indices].sum())
            count = plan_group(table, elements, programs, sms, maps)
            tables.append(table)
            self.rows_of[indices] = rows + np.arange(len(indices))
            itemsize = dtype.itemsize
            self._groups.append(_PlanGroup(dtype, indices, itemsize, count, programs, rows))
            programs += count
            rows += len(indices) + 1
        self.rows = rows
        self.programs = programs
        #: The list's facts as torch's C shim reads them (:mod:`~gradaudit.engine.torch_shim`),
        #: or ``None`` where it is not bound: then each step asks torch's binding.
        self._signature = torch_shim.signature(tensors)
        #: The flush's host buffer with every offset 0; each launch fills a copy.
        self._template = flush_table(tables, maps, programs).numpy()
        # Where each group's offsets go in that buffer (column 1 of its rows), in the order
        # of its indices, and the itemsize each offset is counted in.
        self._order = np.concatenate([group.indices for group in self._groups])
        self._slots = self.rows_of[self._order] * TABLE_WIDTH + 1
        self._itemsizes = np.concatenate(
            [np.full(len(group.indices), group.itemsize, dtype=np.int64) for group in self._groups]
        )
        self._firsts = np.cumsum([0] + [len(group.indices) for group in self._groups])[:-1]
        self._counts = [len(group.indices) for group in self._groups]
        self._in_order = bool((self._order == np.arange(len(self._order))).all())
        #: The index of each group's first tensor in the list (its base).
        self.firsts = [int(group.indices[0]) for group in self._groups]
        #: The groups' base addresses of the last :meth:`table`.
        self._bases: tuple[int, ...] = ()
        #: The flush captured as a CUDA graph once its bases hold (:mod:`~gradaudit.engine.
        #: triton_graph`), replayed while they do.
        self.replays = triton_graph.Replays(self.device)

    def __len__(self) -> int:
        return len(self.rows_of)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` have this plan's facts: dtypes, shapes and device, and are
        contiguous (each fact read in one C loop over the list)."""
        if self._asked is None:
            return (
                self._signature is not None
                and torch_shim.pointers(list(tensors), self._signature) is not None
            )
        shapes, device_indices = self._asked
        return (
            len(tensors) == len(self.dtypes)
            and list(map(_DTYPE, tensors)) == self.dtypes
            and list(map(_SHAPE, tensors)) == shapes
            and list(map(_DEVICE_INDEX, tensors)) == device_indices
            and all(map(_CONTIGUOUS, tensors))
        )

    def pointers(self, tensors: list[torch.Tensor]) -> np.ndarray | None:
        """The addresses of ``tensors`` (int64, in list order) when they have this plan's
        facts (:meth:`matches`), else ``None``: in one C loop through torch's C shim where
        it is bound (no Python per tensor: 0.03 against 0.3-0.7 µs a tensor), else in one
        pass through torch's binding where the native extension is built (each tensor's
        objects are fetched from memory once, not once per fact), else a pass per fact."""
        if self._signature is not None:
            return torch_shim.pointers(tensors, self._signature)
        if self._asked is None:
            return None
        if native.available():
            shapes, device_indices = self._asked
            found = native.planned_pointers(tensors, _PLAIN, self.dtypes, shapes, device_indices)
            return None if found is None else np.frombuffer(found, dtype=np.int64)
        return pointers(tensors) if plain(tensors) and self.matches(tensors) else None

    def first_pointers(self, tensors: list[torch.Tensor]) -> np.ndarray:
        """The addresses of the list this plan was just made from: through the C shim where
        the plan has its signature (a C loop over objects still in cache), else one
        ``data_ptr`` call per tensor (the plan's checks were just made)."""
        found = None if self._signature is None else torch_shim.pointers(tensors, self._signature)
        return pointers(tensors) if found is None else found

    def table(self, pointers: np.ndarray) -> torch.Tensor | None:
        """The flush's host buffer for tensors at ``pointers`` (int64, in list order), or
        ``None`` when one cannot be addressed from its group's first tensor: that first
        tensor off a 16-byte boundary, or another at an odd byte offset from it."""
        ordered = pointers if self._in_order else pointers[self._order]
        bases = ordered[self._firsts]
        if (bases % VECTOR_BYTES).any():
            return None
        deltas = ordered - (bases[0] if len(bases) == 1 else np.repeat(bases, self._counts))
        offsets, odd = np.divmod(deltas, self._itemsizes)
        if odd.any():
            return None
        # In place: the launch copies it (into pinned memory) before the next step can change
        # it, and the interpreter reads it during the launch.
        self._template[self._slots] = offsets
        self._bases = tuple(bases.tolist())
        return torch.from_numpy(self._template)

    def launch(self, tensors: Sequence[torch.Tensor], host: torch.Tensor) -> torch.Tensor:
        """Queue the flush of ``tensors`` (matching, with :meth:`table`'s buffer): the stats
        rows ``[rows, 7]``, tensor ``i``'s at :attr:`rows_of` ``[i]``. Replayed from the
        captured graph where its bases hold, else launched (and captured once they have
        held for a few launches)."""
        replayed = self.replays.replay(self._bases, host)
        if replayed is not None:
            return replayed
        groups = [
            GroupLaunch(
                tensors[first],
                group.itemsize,
                group.programs,
                group.first_program,
                group.first_row,
            )
            for first, group in zip(self.firsts, self._groups, strict=True)
        ]
        out = launch_flush(
            self.device, host, groups, self.rows, self.programs, self._fp32_accumulate
        )
        # The kernels on a table already on the device, for a capture; bound to values, not
        # to the plan (a capture is dropped with its plan, never keeps it).
        device, rows, programs, fp32 = self.device, self.rows, self.programs, self._fp32_accumulate
        self.replays.launched(
            self._bases,
            host,
            lambda flat: launch_kernels(device, flat, groups, rows, programs, fp32),
        )
        return out


def plain(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is of an exact plain type (one C loop)."""
    return set(map(type, tensors)) <= PLAIN


def takes_dtypes(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel takes every tensor's dtype."""
    return set(map(_DTYPE, tensors)) <= KINDS.keys()


def plan_for(tensors: list[torch.Tensor], sms: int) -> TritonPlan | None:
    """A plan for ``tensors``, or ``None`` when the Triton kernel would not take each of
    them as it is (plain, contiguous, on one device, of its dtypes, not empty): their facts
    read in one C pass where torch's C shim is bound (:class:`ListFacts`), else a pass per
    fact through torch's binding."""
    if torch_shim.bound():
        facts = ListFacts.read(tensors)
        if facts is None or not set(facts.dtypes) <= KINDS.keys() or not facts.numels.all():
            return None
        return TritonPlan(tensors, sms, facts)
    if not plain(tensors) or not takes_dtypes(tensors):
        return None
    if not all(map(torch.Tensor.is_contiguous, tensors)):
        return None
    if 0 in map(torch.Tensor.numel, tensors):
        return None
    if len(set(map(torch.Tensor.get_device, tensors))) != 1:
        return None
    return TritonPlan(tensors, sms)


def pointers(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The address of every tensor, in one C loop, as int64."""
    return np.fromiter(map(_DATA_PTR, tensors), dtype=np.int64, count=len(tensors))


# -- lifetimes off the default stream ---------------------------------------------------

_held: list[tuple[torch.cuda.Event, object]] = []


def hold(device: torch.device, tensors: Sequence[torch.Tensor]) -> None:
    """Keep (a copy of the list of) ``tensors`` until the kernels just queued on ``device``'s
    current stream have run, when that is not the device's default stream (see the module
    doc)."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    if stream == torch.cuda.default_stream(device):
        return
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    _held.append((event, list(tensors)))


def release_finished() -> None:
    """Let go of the held lists whose kernels have run (a query per list, no wait), and of
    the retired graph captures whose last replay has (:mod:`~gradaudit.engine.triton_graph`)."""
    if _held:
        _held[:] = [(event, tensors) for event, tensors in _held if not event.query()]  # type: ignore[no-untyped-call]
    triton_graph.release_finished()


def held() -> int:
    """Lists held now (tests)."""
    return len(_held)
