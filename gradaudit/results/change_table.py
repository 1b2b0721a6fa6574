"""The per-parameter comparison as columns: a :class:`ParameterChange` is made only when asked.

Two dumps of a million tiny tensors share a million names; one frozen
:class:`ParameterChange` per name (and a dict of every :class:`TensorStats` per
side to match them) cost seconds and hundreds of megabytes for a table that shows
a few dozen rows. A :class:`ChangeTable` holds the same facts as numpy columns
and is a ``Sequence[ParameterChange]`` (:class:`~gradaudit.results.column_view.ColumnView`),
so library users and renderers see the same values; the renderers pick the rows
they show (:meth:`ChangeTable.order`, :meth:`ChangeTable.flagged_view`) on the columns.

The ratio rule is written once, vectorised, in :meth:`ChangeTable.between`; the
same IEEE operations as :func:`~gradaudit.results.comparison.scaled_ratio` (``frexp``,
one division, ``ldexp``), so a column value equals the scalar one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from gradaudit.results.column_view import ColumnView
from gradaudit.results.comparison import ParameterChange
from gradaudit.results.stats_table import StatsTable, coded, gathered, shape_columns, shapes_of

__all__ = ["NOTES", "ChangeTable"]

#: Why a ratio is not computed, by code (0: it is).
NOTES: tuple[str | None, ...] = (
    None,
    "NaN/Inf in A",
    "NaN/Inf in B",
    "NaN/Inf in A and B",
    "no elements",
    "both norms are 0",
)
_NOTE_CODES = {note: code for code, note in enumerate(NOTES)}
#: Changes built at once when iterating: memory stays bounded whatever the count.
_STEP = 1 << 14


class ChangeTable(ColumnView[ParameterChange]):
    """Shared tensors with equal shapes, A vs B, as columns; a ``Sequence[ParameterChange]``.

    Columns (one entry per shared name): ``names`` (a list), shapes as ``dims`` and
    ``starts`` (shape ``i`` is ``dims[starts[i]:starts[i + 1]]``, as in a StatsTable),
    ``dtype_a``/``dtype_b`` (codes into ``dtypes``),
    ``norm_a``, ``norm_b``, ``ratio`` (float64; meaningless where ``note_codes`` is
    not 0, the item's ratio is then ``None``), ``flagged`` (bool), ``note_codes``
    (into ``notes``, :data:`NOTES` for a comparison's own; 0 is no note), ``has_ratio``
    (bool; where it is false the item's ratio is ``None``).
    """

    item_noun = "shared tensor"
    __slots__ = (
        "_order",
        "dims",
        "dtype_a",
        "dtype_b",
        "dtypes",
        "flagged",
        "has_ratio",
        "names",
        "norm_a",
        "norm_b",
        "note_codes",
        "notes",
        "ratio",
        "starts",
    )

    def __init__(
        self,
        names: list[str],
        shapes: tuple[np.ndarray, np.ndarray],
        dtypes: tuple[str, ...],
        dtype_codes: tuple[np.ndarray, np.ndarray],
        norms: tuple[np.ndarray, np.ndarray],
        ratio: np.ndarray,
        flagged: np.ndarray,
        note_codes: np.ndarray,
        notes: tuple[str | None, ...] = NOTES,
        has_ratio: np.ndarray | None = None,
    ) -> None:
        self.names = names
        self.dims, self.starts = shapes
        self.dtypes = dtypes
        self.dtype_a, self.dtype_b = dtype_codes
        self.norm_a, self.norm_b = norms
        self.ratio = ratio
        self.flagged = flagged
        self.note_codes = note_codes
        self.notes = notes
        # A comparison's own: a ratio exactly where no note says why not.
        self.has_ratio: np.ndarray = note_codes == 0 if has_ratio is None else has_ratio
        self._order: np.ndarray | None = None

    @classmethod
    def between(
        cls,
        table: StatsTable,
        keys: list[str],
        pairs: tuple[np.ndarray, np.ndarray],
        max_change: float,
    ) -> ChangeTable:
        """A vs B for the tensors ``a[i]`` and ``b[i]`` of ``table`` (``pairs``, equal
        shapes), named ``keys[i]``.

        The rule: NaN/Inf on a side, no elements, or both norms 0 give no ratio (a
        note says which); a zero A norm gives ``inf``, a zero B norm ``0.0``; else
        ``norm_b / norm_a`` without spurious overflow. A ratio outside ``[1/k, k]``
        is flagged.
        """
        a, b = pairs
        norm_a, norm_b = table.norm[a], table.norm[b]
        bad_a, bad_b = table.nonfinite[a] > 0, table.nonfinite[b] > 0
        notes = np.zeros(len(keys), dtype=np.int8)
        notes[bad_a & ~bad_b] = _NOTE_CODES["NaN/Inf in A"]
        notes[~bad_a & bad_b] = _NOTE_CODES["NaN/Inf in B"]
        notes[bad_a & bad_b] = _NOTE_CODES["NaN/Inf in A and B"]
        rest = ~(bad_a | bad_b)
        empty = rest & (table.numel[a] == 0)
        notes[empty] = _NOTE_CODES["no elements"]
        rest &= ~empty
        zero_a, zero_b = norm_a == 0.0, norm_b == 0.0
        notes[rest & zero_a & zero_b] = _NOTE_CODES["both norms are 0"]
        ratio = np.full(len(keys), math.nan)
        ratio[rest & zero_a & ~zero_b] = math.inf
        ratio[rest & ~zero_a & zero_b] = 0.0
        plain = rest & ~zero_a & ~zero_b
        # scaled_ratio: mantissas and exponents divided apart, as math.frexp/ldexp do.
        mantissa_b, exponent_b = np.frexp(norm_b[plain])
        mantissa_a, exponent_a = np.frexp(norm_a[plain])
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            ratio[plain] = np.ldexp(mantissa_b / mantissa_a, exponent_b - exponent_a)
            flagged = (notes == 0) & ((ratio > max_change) | (ratio < 1.0 / max_change))
        return cls(
            keys,
            gathered(table.dims, table.starts, a),
            table.dtypes,
            (table.dtype_codes[a], table.dtype_codes[b]),
            (norm_a, norm_b),
            ratio,
            flagged,
            notes,
        )

    @classmethod
    def from_changes(cls, changes: Sequence[ParameterChange]) -> ChangeTable:
        """Columns of ParameterChanges made elsewhere (a library user, a test): as given."""
        if isinstance(changes, ChangeTable):
            return changes
        items = list(changes)
        dtypes, codes = coded([c.dtype_a for c in items] + [c.dtype_b for c in items], np.int16)
        notes = tuple(dict.fromkeys([None, *(c.note for c in items)]))
        note_of = {note: code for code, note in enumerate(notes)}
        return cls(
            [c.name for c in items],
            shape_columns([c.shape for c in items]),
            dtypes,
            (codes[: len(items)], codes[len(items) :]),
            (
                np.array([c.norm_a for c in items], dtype=np.float64),
                np.array([c.norm_b for c in items], dtype=np.float64),
            ),
            np.array([math.nan if c.ratio is None else c.ratio for c in items], dtype=np.float64),
            np.array([c.flagged for c in items], dtype=bool),
            np.array([note_of[c.note] for c in items], dtype=np.int32),
            notes,
            np.array([c.ratio is not None for c in items], dtype=bool),
        )

    # -- the rows a renderer shows, picked on the columns ------------------------

    def order(self) -> np.ndarray:
        """The rows in the order every format lists them: flagged first, then not
        comparable, then the rest; each by how far B/A is from 1 (``|log B/A|``, a ratio
        of 0 or inf the farthest), the file's order among equals.

        ``math.log`` per ratio (not numpy's, whose last bits may differ by CPU), so
        ties fall the same on every machine. Computed once.
        """
        if self._order is not None:
            return self._order
        group = np.where(~self.has_ratio, 1, np.where(self.flagged, 0, 2))
        ratios = self.ratio.tolist()
        distance = np.array(
            [
                0.0 if not has else math.inf if r in (0.0, math.inf) else abs(math.log(r))
                for r, has in zip(ratios, self.has_ratio.tolist(), strict=True)
            ],
            dtype=np.float64,
        )
        # lexsort is stable: equal keys keep their order, as sorted() does.
        order: np.ndarray = np.lexsort((-distance, group))
        self._order = order
        return order

    def notable_mask(self) -> np.ndarray:
        """Flagged, or a note (why no ratio): the rows shown on their own."""
        mask: np.ndarray = self.flagged | (self.note_codes != 0)
        return mask

    def each(self, indices: Sequence[int] | np.ndarray) -> Iterator[ParameterChange]:
        """The changes at ``indices``, in that order, a step's worth built at a time."""
        chosen = np.asarray(indices, dtype=np.int64)
        for start in range(0, len(chosen), _STEP):
            yield from self._build(chosen[start : start + _STEP])

    def flagged_view(self) -> ChangeTable:
        """The flagged changes, in order, as a table (no object each)."""
        return self.subset(np.flatnonzero(self.flagged))

    def subset(self, indices: np.ndarray) -> ChangeTable:
        chosen = indices.tolist()
        return ChangeTable(
            [self.names[i] for i in chosen],
            gathered(self.dims, self.starts, indices),
            self.dtypes,
            (self.dtype_a[indices], self.dtype_b[indices]),
            (self.norm_a[indices], self.norm_b[indices]),
            self.ratio[indices],
            self.flagged[indices],
            self.note_codes[indices],
            self.notes,
            self.has_ratio[indices],
        )

    # -- the Sequence[ParameterChange] view ---------------------------------------

    def __len__(self) -> int:
        return len(self.names)

    def _build(self, where: np.ndarray) -> Iterator[ParameterChange]:
        dtypes, notes = self.dtypes, self.notes
        dims, starts = gathered(self.dims, self.starts, where)
        shapes = shapes_of(dims, starts, 0, len(where))
        for i, shape, dtype_a, dtype_b, norm_a, norm_b, ratio, has, flagged, note in zip(
            where.tolist(),
            shapes,
            self.dtype_a[where].tolist(),
            self.dtype_b[where].tolist(),
            self.norm_a[where].tolist(),
            self.norm_b[where].tolist(),
            self.ratio[where].tolist(),
            self.has_ratio[where].tolist(),
            self.flagged[where].tolist(),
            self.note_codes[where].tolist(),
            strict=True,
        ):
            yield ParameterChange(
                name=self.names[i],
                shape=shape,
                dtype_a=dtypes[dtype_a],
                dtype_b=dtypes[dtype_b],
                norm_a=norm_a,
                norm_b=norm_b,
                ratio=ratio if has else None,
                flagged=flagged,
                note=notes[note],
            )

    def _take(self, indices: range) -> Iterator[ParameterChange]:
        return self.each(np.arange(indices.start, indices.stop, indices.step, dtype=np.int64))

    def __repr__(self) -> str:
        return f"ChangeTable({len(self)} shared tensors)"
