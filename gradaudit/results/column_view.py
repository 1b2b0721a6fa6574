"""A read-only sequence whose items are built from columns when asked for.

A file can hold a million tiny tensors; one frozen object per tensor (header entry,
stats, finding) costs hundreds of bytes and a constructor call each, so the header
(:class:`~gradaudit.io.safetensors_table.TensorTable`), the results
(:class:`~gradaudit.results.stats_table.StatsTable`) and the findings
(:class:`~gradaudit.scan.finding_table.FindingTable`) keep columns and build items on
demand. They share the sequence protocol here: indexing (negative indices, slices to
tuples), iteration, and equality with any sequence of the same items.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

T = TypeVar("T")


class ColumnView(Sequence[T]):
    """Items built from columns; subclasses give ``__len__`` and :meth:`_take`."""

    __slots__ = ()

    #: What one item is called in an ``IndexError`` message.
    item_noun = "item"

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _take(self, indices: range) -> Iterator[T]:
        """The items at ``indices``, in that order (a contiguous run has ``step == 1``)."""

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...

    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        if isinstance(index, slice):
            return tuple(self._take(range(len(self))[index]))
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.item_noun} index out of range")
        position = index % len(self)
        return next(self._take(range(position, position + 1)))

    def __iter__(self) -> Iterator[T]:
        return self._take(range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]
