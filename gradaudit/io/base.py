"""The one interface every reader implements."""

from __future__ import annotations

import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from gradaudit.results import Skipped

if TYPE_CHECKING:  # the torch-free scan imports Excluded: no torch at start-up
    import torch


@dataclass(frozen=True)
class Excluded:
    """A named value left out by ``--include``/``--exclude``: counted, not listed.

    Not a :class:`Skipped`: the user asked for it to be left out, so it is not a
    problem to report tensor by tensor, only a number to show.
    """

    name: str


@dataclass(frozen=True)
class TensorRun:
    """Many small tensors of one dtype lying back to back in a file, as columns.

    A file of a million tiny tensors (LoRA adapters, MoE experts) spent its time
    on per-tensor Python: a view, then a collector call, for each. A run hands
    over names, shapes and addresses at once, for the native kernel to reduce
    in one call; readers only yield runs when asked (:meth:`RunSource.runs`).
    """

    names: list[str]
    dtype: torch.dtype
    #: Each tensor's rank (int64), and every tensor's dimensions back to back (int64).
    ranks: array.array[int]
    dims: array.array[int]
    #: Address of each tensor's first byte (uint64), every one aligned to its element size.
    pointers: array.array[int]
    #: Elements of each tensor (uint64).
    counts: array.array[int]
    #: A view of the bytes the run lies in: keeps the file's map alive while the
    #: addresses are in use.
    data: torch.Tensor

    def part(self, start: int, stop: int) -> TensorRun:
        """Tensors ``start`` to ``stop`` of the run, as a run over the same bytes."""
        first = sum(self.ranks[:start])
        last = first + sum(self.ranks[start:stop])
        return TensorRun(
            names=self.names[start:stop],
            dtype=self.dtype,
            ranks=self.ranks[start:stop],
            dims=self.dims[first:last],
            pointers=self.pointers[start:stop],
            counts=self.counts[start:stop],
            data=self.data,
        )

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The run as ordinary named tensors (views of :attr:`data`), for other consumers."""
        base = self.data.data_ptr()
        import torch  # start-up: see the import at the top

        flat = self.data.view(torch.uint8)
        size = self.dtype.itemsize
        dims = iter(self.dims)
        shapes = (tuple(islice(dims, rank)) for rank in self.ranks)
        for name, shape, pointer, count in zip(
            self.names, shapes, self.pointers, self.counts, strict=True
        ):
            start = pointer - base
            yield name, flat[start : start + count * size].view(self.dtype).view(shape)


@dataclass(frozen=True)
class Pieces:
    """One tensor stored as several disjoint pieces (a distributed checkpoint's chunks).

    The pieces are loaded one at a time by ``load`` and each is reduced to a stats row;
    the rows are combined with the engine's merge rule, so the whole tensor is never put
    together in memory and its stats are those of the whole (the pieces tile it exactly).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: Yields the pieces as CPU tensors, in any order; called once.
    load: Callable[[], Iterator[torch.Tensor]]


#: What a reader yields: a named tensor to audit, a tensor in pieces, a value it could not
#: audit, or a name the selection left out.
SourceItem: TypeAlias = "tuple[str, torch.Tensor] | Pieces | Skipped | Excluded"

#: What :meth:`RunSource.runs` yields: the same, or a run of small tensors.
RunItem: TypeAlias = "SourceItem | TensorRun"

#: Decides from a tensor's name whether it is audited (see :class:`gradaudit.selection.NameFilter`).
Select = Callable[[str], bool]


class TensorSource(Protocol):
    """A file (or set of files) that yields named tensors one at a time.

    Readers validate their input before yielding anything and raise
    :class:`gradaudit.errors.InputError` for anything they cannot read, so the
    orchestrator can record the problem and carry on with the next input.

    Two optional attributes tell the audit what the tensors are (:mod:`gradaudit.roles`):
    ``metadata`` (``dict[str, str]``, the file's own metadata, e.g. safetensors'
    ``__metadata__``) and ``role_hints`` (``dict[str, TensorHint]``, tensor name -> what
    the structure around it says, filled by :meth:`items` before it yields the tensor;
    :func:`gradaudit.io.nested.walk_checkpoint` fills one for any nested checkpoint).
    A reader without them is judged by names and values alone.
    """

    path: str

    def items(self, select: Select | None = None) -> Iterator[SourceItem]:
        """Yield CPU tensors, one at a time, never all at once.

        The collector moves each to the audit device (:mod:`gradaudit.engine.staging`
        overlaps that copy with reading the next tensor).

        A name that ``select`` rejects is yielded as :class:`Excluded` before its data
        is read, so leaving tensors out also saves the work of loading them.
        """
        ...

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if the file changed while it was read.

        Called once every tensor from :meth:`items` has been reduced (the native
        kernel reads CPU tensors as late as ``settle``), before anything from the
        file is kept: values read from a file that was truncated, rewritten or
        replaced meanwhile describe no file at all. See docs/inputs.md.
        """
        ...


@runtime_checkable
class RunSource(TensorSource, Protocol):
    """A reader that can also hand over small tensors as :class:`TensorRun` columns."""

    def runs(self) -> Iterator[RunItem]:
        """:meth:`items` without a selection, with runs of small tensors as :class:`TensorRun`."""
        ...
