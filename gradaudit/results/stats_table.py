"""Per-tensor results as columns: a :class:`TensorStats` is made only when one is asked for.

A dump of a million tiny tensors (LoRA adapters, MoE experts) made a million
frozen :class:`TensorStats` (~590 bytes each), then a copy of each with its role:
more than a gigabyte for results that a table summarises in a dozen lines. A
:class:`StatsTable` holds the same facts as numpy columns and a list of names
(~100 bytes per tensor besides the name) and is a ``Sequence[TensorStats]``:
indexing and iterating give the same :class:`TensorStats` values as before,
built on demand, so renderers and library users see no difference. The judging
code reads the columns directly where that is simpler (:mod:`gradaudit.scan.judge`).

Every number is derived exactly as :class:`~gradaudit.results.row.HostRow` derives it
(the same IEEE operations), so a value read through a column equals the one
read through a :class:`TensorStats`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TypeVar

import numpy as np

from gradaudit.policy import Role
from gradaudit.results import TensorStats
from gradaudit.results.column_view import ColumnView
from gradaudit.results.row import MAX_ABS, NAN, SCALE, SSQ, ZEROS

__all__ = ["ROLES", "StatsTable", "coded", "gathered", "same_shapes", "shapes_of"]

#: Role by code, in the enum's order.
ROLES: tuple[Role, ...] = tuple(Role)
_ROLE_CODES = {role: code for code, role in enumerate(ROLES)}
#: Tensors turned into :class:`TensorStats` per step of an iteration.
_STEP = 1 << 14
_K = TypeVar("_K")


def shapes_of(dims: np.ndarray, starts: np.ndarray, start: int, end: int) -> list[tuple[int, ...]]:
    """Shapes ``start`` to ``end``; shape ``i`` is ``dims[starts[i] : starts[i + 1]]``.

    One pass when they share a rank: no list per shape made and thrown away. Equal
    shapes come as one tuple: a run of a million tensors of one shape (a collection
    keeps every shape until it is read back) holds one tuple, not a million.
    """
    if end <= start:
        return []
    first, last = int(starts[start]), int(starts[end])
    ranks = np.diff(starts[start : end + 1])
    rank = int(ranks[0])
    if (ranks == rank).all():
        if rank == 0:
            return [()] * (end - start)
        columns = dims[first:last].reshape(-1, rank).T.tolist()
        shapes: list[tuple[int, ...]] = list(zip(*columns, strict=True))
    else:
        shapes = [tuple(dims[starts[i] : starts[i + 1]].tolist()) for i in range(start, end)]
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}
    return list(map(seen.setdefault, shapes, shapes))


def shape_columns(shapes: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(dims, starts)`` of ``shapes``, the columns :func:`shapes_of` reads back: every
    dimension end to end (int64), and where each shape starts (one more: the end)."""
    starts = np.zeros(len(shapes) + 1, dtype=np.int64)
    np.cumsum([len(shape) for shape in shapes], out=starts[1:])
    dims = np.array([size for shape in shapes for size in shape], dtype=np.int64)
    return dims, starts


def gathered(
    dims: np.ndarray, starts: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The shapes of ``rows`` (in that order) as their own ``(dims, starts)`` columns.

    One gather, no slice per shape: a million shared tensors' shapes cost two arrays.
    """
    ranks = starts[rows + 1] - starts[rows]
    new_starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(ranks, out=new_starts[1:])
    where = np.repeat(starts[rows] - new_starts[:-1], ranks) + np.arange(new_starts[-1])
    return dims[where], new_starts


def same_shapes(dims: np.ndarray, starts: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether shape ``a[i]`` equals shape ``b[i]``, for each ``i``: compared a rank at a
    time on the columns, no tuple made."""
    ranks = np.diff(starts)
    same: np.ndarray = ranks[a] == ranks[b]
    for rank in np.unique(ranks[a][same]).tolist():
        chosen = np.flatnonzero(same & (ranks[a] == rank))
        if rank and len(chosen):
            offsets = np.arange(rank)
            left = dims[starts[a[chosen]][:, None] + offsets]
            right = dims[starts[b[chosen]][:, None] + offsets]
            same[chosen] = (left == right).all(axis=1)
    return same


def coded(values: Sequence[_K], dtype: type[np.integer]) -> tuple[tuple[_K, ...], np.ndarray]:
    """The distinct ``values`` in order of first appearance, and each value's index among
    them: how the columns hold a text per tensor (dtype, source, evidence).

    One value (a whole collection of one dtype, from one source) costs no lookup per item:
    ``count`` compares by identity first, at C speed.
    """
    if values and values.count(values[0]) == len(values):
        return (values[0],), np.zeros(len(values), dtype=dtype)
    distinct = tuple(dict.fromkeys(values))
    if len(distinct) <= 1:
        return distinct, np.zeros(len(values), dtype=dtype)
    index = {value: code for code, value in enumerate(distinct)}
    return distinct, np.fromiter(map(index.__getitem__, values), dtype=dtype, count=len(values))


def numels_of(dims: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Elements of each shape (int64; a shape of rank 0 holds one element)."""
    count = len(starts) - 1
    numel = np.ones(count, dtype=np.int64)
    ranks = np.diff(starts)
    shaped = np.flatnonzero(ranks > 0)
    if len(shaped):
        numel[shaped] = np.multiply.reduceat(dims, starts[shaped])
    return numel


class StatsTable(ColumnView[TensorStats]):
    """The stats of many tensors as columns; a ``Sequence[TensorStats]``.

    Columns (numpy, one entry per tensor): ``numel``, ``nan``, ``pos_inf``,
    ``neg_inf``, ``zeros`` (int64), ``max_abs``, ``norm`` (float64); codes into
    small tuples for ``dtype``, ``source``, ``role`` (:data:`ROLES`) and
    ``role_evidence`` (with ``evidence_thin``: whether each evidence is thin); shapes as
    ``dims``/``starts``. ``names`` is a list.
    """

    item_noun = "tensor"
    __slots__ = (
        "_finite",
        "_nonfinite",
        "dims",
        "dtype_codes",
        "dtypes",
        "evidence_codes",
        "evidence_thin",
        "evidences",
        "max_abs",
        "names",
        "nan",
        "neg_inf",
        "norm",
        "numel",
        "pos_inf",
        "rms",
        "role_codes",
        "source_codes",
        "sources",
        "starts",
        "zeros",
    )

    def __init__(
        self,
        names: list[str],
        dims: np.ndarray,
        starts: np.ndarray,
        dtype_codes: np.ndarray,
        dtypes: tuple[str, ...],
        source_codes: np.ndarray,
        sources: tuple[str | None, ...],
        counts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        max_abs: np.ndarray,
        norm: np.ndarray,
        rms: np.ndarray,
    ) -> None:
        """Columns as they are; ``counts`` is ``(numel, nan, pos_inf, neg_inf, zeros)``.

        Use :meth:`from_rows` (host stats rows) or :meth:`from_stats` (TensorStats).
        Every tensor starts as a gradient with no evidence (see :meth:`with_roles`).
        """
        self.names = names
        self.dims = dims
        self.starts = starts
        self.dtype_codes = dtype_codes
        self.dtypes = dtypes
        self.source_codes = source_codes
        self.sources = sources
        self.numel, self.nan, self.pos_inf, self.neg_inf, self.zeros = counts
        self.max_abs = max_abs
        self.norm = norm
        #: NaN where a TensorStats has ``None`` (no finite element).
        self.rms = rms
        self.role_codes = np.full(len(names), _ROLE_CODES[Role.GRADIENT], dtype=np.int8)
        self.evidence_codes = np.zeros(len(names), dtype=np.int32)
        self.evidences: tuple[str, ...] = ("",)
        self.evidence_thin: tuple[bool, ...] = (False,)
        # Derived from the counts when first asked for, then kept: the columns are never
        # changed in place, and a report reads these several times (issue 28 item 9).
        self._finite: np.ndarray | None = None
        self._nonfinite: np.ndarray | None = None

    @classmethod
    def from_rows(
        cls,
        names: list[str],
        dims: np.ndarray,
        starts: np.ndarray,
        dtype_codes: np.ndarray,
        dtypes: tuple[str, ...],
        source_codes: np.ndarray,
        sources: tuple[str | None, ...],
        rows: np.ndarray,
        *,
        numel: np.ndarray | None = None,
    ) -> StatsTable:
        """From the host stats rows ``[n, 7]`` (float64) of the tensors, in order.

        The same derivations as :class:`~gradaudit.results.row.HostRow`: ``int()`` of each
        count (exact below 2**53), norm ``scale * sqrt(ssq)``, RMS ``norm /
        sqrt(finite)``, each a correctly rounded IEEE operation in numpy as in Python.
        ``numel``: the shapes' element counts, when known (a monitor's layout).
        """
        if numel is None:
            numel = numels_of(dims, starts)
        # The four count slots in one cast, one contiguous row per count.
        nan, pos_inf, neg_inf, zeros = np.ascontiguousarray(rows[:, NAN : ZEROS + 1].T, np.int64)
        nonfinite = nan + pos_inf + neg_inf
        finite = numel - nonfinite
        # Overflow to inf is a value here (a float64 norm beyond range), as in Python.
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            norm = rows[:, SCALE] * np.sqrt(rows[:, SSQ])
            rms = np.where(finite > 0, norm / np.sqrt(finite), np.nan)
        table = cls(
            names,
            dims,
            starts,
            dtype_codes,
            dtypes,
            source_codes,
            sources,
            (numel, nan, pos_inf, neg_inf, zeros),
            np.ascontiguousarray(rows[:, MAX_ABS]),
            norm,
            rms,
        )
        table._finite, table._nonfinite = finite, nonfinite
        return table

    @classmethod
    def from_stats(cls, tensors: Sequence[TensorStats]) -> StatsTable:
        """Columns of TensorStats made elsewhere (tests, a library user): the values as given."""
        if isinstance(tensors, StatsTable):
            return tensors
        items = list(tensors)
        dims, starts = shape_columns([t.shape for t in items])
        dtypes = tuple(dict.fromkeys(t.dtype for t in items))
        sources = tuple(dict.fromkeys(t.source for t in items))
        evidences = tuple(dict.fromkeys(["", *(t.role_evidence for t in items)]))
        thin = {t.role_evidence for t in items if t.role_thin}
        dtype_of = {d: i for i, d in enumerate(dtypes)}
        source_of = {s: i for i, s in enumerate(sources)}
        evidence_of = {e: i for i, e in enumerate(evidences)}

        def column(values: list[int] | list[float], dtype: type) -> np.ndarray:
            return np.array(values, dtype=dtype)

        table = cls(
            [t.name for t in items],
            dims,
            starts,
            column([dtype_of[t.dtype] for t in items], np.int16),
            dtypes,
            column([source_of[t.source] for t in items], np.int32),
            sources,
            (
                column([t.numel for t in items], np.int64),
                column([t.nan for t in items], np.int64),
                column([t.pos_inf for t in items], np.int64),
                column([t.neg_inf for t in items], np.int64),
                column([t.zeros for t in items], np.int64),
            ),
            column([t.max_abs for t in items], np.float64),
            column([t.norm for t in items], np.float64),
            column([math.nan if t.rms is None else t.rms for t in items], np.float64),
        )
        table.with_roles(
            column([_ROLE_CODES[t.role] for t in items], np.int8),
            column([evidence_of[t.role_evidence] for t in items], np.int32),
            evidences,
            tuple(e in thin for e in evidences),
        )
        return table

    # -- columns derived on demand ----------------------------------------------

    @property
    def finite(self) -> np.ndarray:
        if self._finite is None:
            self._finite = self.numel - self.nonfinite
        return self._finite

    @property
    def nonfinite(self) -> np.ndarray:
        if self._nonfinite is None:
            self._nonfinite = self.nan + self.pos_inf + self.neg_inf
        return self._nonfinite

    @property
    def ranks(self) -> np.ndarray:
        return np.diff(self.starts)

    def role_mask(self, role: Role) -> np.ndarray:
        mask: np.ndarray = self.role_codes == _ROLE_CODES[role]
        return mask

    def with_roles(
        self,
        role_codes: np.ndarray,
        evidence_codes: np.ndarray,
        evidences: tuple[str, ...],
        evidence_thin: tuple[bool, ...] | None = None,
    ) -> None:
        """Set every tensor's role and evidence (codes into :data:`ROLES` and ``evidences``;
        ``evidence_thin[code]``: that evidence is a default or a guess, none by default)."""
        self.role_codes = role_codes
        self.evidence_codes = evidence_codes
        self.evidences = evidences
        self.evidence_thin = evidence_thin or (False,) * len(evidences)

    def thin_mask(self) -> np.ndarray:
        """A mask of the tensors whose role a default or a guess decided (``role_thin``)."""
        if not any(self.evidence_thin):
            return np.zeros(len(self.names), dtype=bool)
        mask: np.ndarray = np.asarray(self.evidence_thin, dtype=bool)[self.evidence_codes]
        return mask

    def source_indices(self, source: str | None) -> np.ndarray:
        """Indices of the tensors read from ``source``."""
        if source not in self.sources:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.source_codes == self.sources.index(source))

    # -- the Sequence[TensorStats] view -----------------------------------------

    def __len__(self) -> int:
        return len(self.names)

    def _slice(self, start: int, end: int) -> Iterator[TensorStats]:
        """TensorStats ``start`` to ``end``."""
        return self._build(slice(start, end), shapes_of(self.dims, self.starts, start, end))

    def _build(
        self, where: slice | np.ndarray, shapes: list[tuple[int, ...]]
    ) -> Iterator[TensorStats]:
        """TensorStats of the tensors ``where`` selects, from lists of each column's values."""
        dtypes, sources, evidences = self.dtypes, self.sources, self.evidences
        thin = self.evidence_thin
        names = (
            self.names[where]
            if isinstance(where, slice)
            else [self.names[i] for i in where.tolist()]
        )
        columns = zip(
            names,
            shapes,
            self.dtype_codes[where].tolist(),
            self.numel[where].tolist(),
            self.nan[where].tolist(),
            self.pos_inf[where].tolist(),
            self.neg_inf[where].tolist(),
            self.zeros[where].tolist(),
            self.max_abs[where].tolist(),
            self.norm[where].tolist(),
            self.rms[where].tolist(),
            self.source_codes[where].tolist(),
            self.role_codes[where].tolist(),
            self.evidence_codes[where].tolist(),
            strict=True,
        )
        for name, shape, dtype, numel, nan, pos, neg, zeros, peak, norm, rms, *codes in columns:
            source, role, evidence = codes
            yield TensorStats(
                name,
                shape,
                dtypes[dtype],
                numel,
                nan,
                pos,
                neg,
                zeros,
                peak,
                norm,
                None if rms != rms else rms,  # NaN: no finite element
                sources[source],
                ROLES[role],
                evidences[evidence],
                thin[evidence],
            )

    def __iter__(self) -> Iterator[TensorStats]:
        for start in range(0, len(self), _STEP):
            yield from self._slice(start, min(len(self), start + _STEP))

    def take(self, indices: Sequence[int] | np.ndarray) -> list[TensorStats]:
        """The TensorStats of ``indices``, in that order."""
        return list(self.each(indices))

    def each(self, indices: Sequence[int] | np.ndarray) -> Iterator[TensorStats]:
        """:meth:`take` one at a time: only a step's worth exists at once."""
        chosen = np.asarray(indices, dtype=np.int64)
        for start in range(0, len(chosen), _STEP):
            part = chosen[start : start + _STEP]
            shapes = [
                tuple(self.dims[self.starts[i] : self.starts[i + 1]].tolist())
                for i in part.tolist()
            ]
            yield from self._build(part, shapes)

    def subset(self, indices: Sequence[int] | np.ndarray) -> StatsTable:
        """A table of the tensors ``indices`` (in that order), roles included."""
        chosen = np.asarray(indices, dtype=np.int64)
        ranks = self.ranks[chosen]
        starts = np.zeros(len(chosen) + 1, dtype=np.int64)
        np.cumsum(ranks, out=starts[1:])
        pieces = [self.dims[self.starts[i] : self.starts[i + 1]] for i in chosen.tolist()]
        table = StatsTable(
            [self.names[i] for i in chosen.tolist()],
            np.concatenate(pieces) if pieces else self.dims[:0],
            starts,
            self.dtype_codes[chosen],
            self.dtypes,
            self.source_codes[chosen],
            self.sources,
            (
                self.numel[chosen],
                self.nan[chosen],
                self.pos_inf[chosen],
                self.neg_inf[chosen],
                self.zeros[chosen],
            ),
            self.max_abs[chosen],
            self.norm[chosen],
            self.rms[chosen],
        )
        table.with_roles(
            self.role_codes[chosen], self.evidence_codes[chosen], self.evidences, self.evidence_thin
        )
        return table

    def _take(self, indices: range) -> Iterator[TensorStats]:
        if indices.step == 1:
            return iter(self._slice(indices.start, max(indices.start, indices.stop)))
        return self.each(indices)

    def __repr__(self) -> str:
        return f"StatsTable({len(self)} tensors)"
