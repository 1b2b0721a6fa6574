"""Findings as columns: a :class:`Finding` is made only when one is asked for.

A dump of a million all-zero tiny tensors (taken after
``zero_grad(set_to_none=False)``) has a million ``vanishing`` findings. As
objects (a :class:`Finding` and its message each, then the sets and dicts that
count and group them) they took more memory than the rest of the scan. A
:class:`FindingTable` holds, per finding, the tensor it is on (an index into the
scan's :class:`~gradaudit.results.stats_table.StatsTable`), its kind and its severity as
numpy columns, and is a ``Sequence[Finding]``: indexing and iterating give the
same findings as before. A finding on a tensor is built by
:func:`gradaudit.scan.rules.evaluate` itself (the one rule for what a finding is
and what it says); the vectorised judging here only decides which tensors it
runs on and which kinds it will return, and a test holds the two together.
Findings that are few (optimizer state, outliers, skipped tensors) are kept as
objects in the same order.

Counts, the health score and the renderers read the columns where they can.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from gradaudit.policy import FindingKind, Role, Severity, Thresholds
from gradaudit.results import Finding, TensorStats
from gradaudit.results.column_view import ColumnView
from gradaudit.results.stats_table import ROLES, StatsTable
from gradaudit.scan.rules import (
    cast_limits,
    diverged_weight_mask,
    evaluate,
    judged_candidates,
    tensor_indices,
    thin_demoted,
)

__all__ = ["KINDS", "SEVERITIES", "FindingTable"]

#: Kind and severity by code, in the enums' order.
KINDS: tuple[FindingKind, ...] = tuple(FindingKind)
SEVERITIES: tuple[Severity, ...] = tuple(Severity)
_KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}
_SEVERITY_CODES = {severity: code for code, severity in enumerate(SEVERITIES)}
#: Findings built at once when iterating: memory stays bounded whatever the count.
_STEP = 1 << 14


def judge_columns(table: StatsTable, thresholds: Thresholds) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, kinds)``: the tensor and the kind of each finding :func:`evaluate` returns.

    In tensor order, each tensor's kinds in :func:`~gradaudit.scan.rules.evaluate`'s
    order (NaN, Inf, then all-zero and cast for a weight, exploding or vanishing for a
    gradient): the same comparisons on the columns. Only the tensors
    :func:`~gradaudit.scan.rules.judged_candidates` picks are looked at.
    """
    rows = judged_candidates(table, thresholds)
    if not len(rows):  # a healthy step: nothing below to do
        return rows, np.zeros(0, dtype=np.int8)
    none = np.int8(-1)
    nan = table.nan[rows] > 0
    inf = (table.pos_inf[rows] > 0) | (table.neg_inf[rows] > 0)
    finite = table.finite[rows] > 0
    role = table.role_codes[rows]
    weight = role == ROLES.index(Role.WEIGHT)
    gradient = (role == ROLES.index(Role.GRADIENT)) & finite
    norm, numel = table.norm[rows], table.numel[rows]
    exploding = gradient & (norm > thresholds.exploding)
    vanishing = gradient & ~exploding & (norm < thresholds.vanishing)
    # A 1-D or 0-d weight at zero is an initialisation (biases, zero-init residual
    # scales), not a dead layer: only matrices are flagged.
    all_zero = weight & (numel > 0) & (table.zeros[rows] == numel) & (table.ranks[rows] >= 2)
    large = weight & finite & ~all_zero
    large[np.flatnonzero(large)] = diverged_weight_mask(table, rows[large])
    exploding |= large  # a weight far above any initialisation: the run diverged
    cast = np.zeros(len(rows), dtype=bool)
    if thresholds.cast_check is not None:
        overflow, underflow = cast_limits(thresholds.cast_check)
        peak = table.max_abs[rows]
        cast = weight & finite & ((peak >= overflow) | ((peak > 0) & (peak < underflow)))

    def code(kind: FindingKind, where: np.ndarray) -> np.ndarray:
        codes: np.ndarray = np.where(where, np.int8(_KIND_CODES[kind]), none)
        return codes

    third = np.where(
        all_zero,
        np.int8(_KIND_CODES[FindingKind.ALL_ZERO]),
        np.where(
            exploding,
            np.int8(_KIND_CODES[FindingKind.EXPLODING]),
            code(FindingKind.VANISHING, vanishing),
        ),
    )
    grid = np.stack(
        [
            code(FindingKind.NAN, nan),
            code(FindingKind.INF, inf),
            third,
            code(FindingKind.CAST, cast),
        ],
        axis=1,
    ).astype(np.int8)
    present = grid >= 0
    return np.repeat(rows, present.sum(axis=1)), grid[present]


class FindingTable(ColumnView[Finding]):
    """Findings as columns over a :class:`StatsTable`; a ``Sequence[Finding]``.

    Columns, one entry per finding: ``rows`` (the tensor's index in ``table``, -1
    for a finding on no tensor of it), ``kinds`` and ``severities`` (codes into
    :data:`KINDS`, :data:`SEVERITIES`) and ``slots``: for a finding judged on the
    columns its position among :func:`evaluate`'s findings for that tensor, for one
    kept as an object ``-1 - i`` (``objects[i]``). ``ordered`` says the findings are
    grouped tensor by tensor in the tensors' order (:meth:`in_tensor_order`).
    """

    item_noun = "finding"
    __slots__ = (
        "kinds",
        "objects",
        "ordered",
        "rows",
        "severities",
        "slots",
        "table",
        "thresholds",
    )

    def __init__(
        self,
        table: StatsTable,
        thresholds: Thresholds,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        objects: tuple[Finding, ...] = (),
        ordered: bool = False,
    ) -> None:
        self.table = table
        self.thresholds = thresholds
        self.rows, self.kinds, self.severities, self.slots = columns
        self.objects = objects
        self.ordered = ordered

    @classmethod
    def judge(cls, table: StatsTable, thresholds: Thresholds) -> FindingTable:
        """:func:`evaluate`'s findings for every tensor of ``table``, in tensor order."""
        rows, kinds = judge_columns(table, thresholds)
        if not len(rows):  # a healthy step (a monitor's, every step): no finding to place
            empty = (rows, kinds, np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.int32))
            return cls(table, thresholds, empty, ordered=True)
        starts = np.ones(len(rows), dtype=bool)
        starts[1:] = rows[1:] != rows[:-1]
        position = np.arange(len(rows), dtype=np.int64)
        slots = (position - np.maximum.accumulate(np.where(starts, position, 0))).astype(np.int32)
        by_kind = np.array(
            [_SEVERITY_CODES[thresholds.severity(kind)] for kind in KINDS], dtype=np.int8
        )
        severities = by_kind[kinds] if len(kinds) else np.zeros(0, dtype=np.int8)
        if len(rows) and any(table.evidence_thin):
            error = severities == _SEVERITY_CODES[Severity.ERROR]
            demoted = error & thin_demoted(table, rows, kinds, thresholds)
            severities[demoted] = _SEVERITY_CODES[Severity.WARNING]
        if thresholds.ignore and len(rows):
            flagged = np.unique(rows)
            names = table.names
            ignored = [i for i in flagged.tolist() if thresholds.ignored_by(names[i]) is not None]
            severities[np.isin(rows, ignored)] = _SEVERITY_CODES[Severity.IGNORED]
        return cls(table, thresholds, (rows, kinds, severities, slots), ordered=True)

    def extended(self, findings: Sequence[Finding]) -> FindingTable:
        """These findings, then ``findings`` (kept as objects), in that order."""
        if not findings:
            return self
        if (
            isinstance(findings, FindingTable)
            and findings.table is self.table
            and findings.thresholds is self.thresholds
        ):
            return self._join(findings)
        objects = tuple(findings)
        keys = {(f.source, f.tensor) for f in objects}

        found = tensor_indices(self.table, keys).tolist()
        table = self.table
        at = {(table.sources[table.source_codes[i]], table.names[i]): i for i in found}
        base = len(self.objects)
        added = (
            np.array([at.get((f.source, f.tensor), -1) for f in objects], dtype=np.int64),
            np.array([_KIND_CODES[f.kind] for f in objects], dtype=np.int8),
            np.array([_SEVERITY_CODES[f.severity] for f in objects], dtype=np.int8),
            np.arange(-1 - base, -1 - base - len(objects), -1, dtype=np.int32),
        )
        columns = (self.rows, self.kinds, self.severities, self.slots)
        joined = tuple(np.concatenate([a, b]) for a, b in zip(columns, added, strict=True))
        return FindingTable(
            self.table,
            self.thresholds,
            (joined[0], joined[1], joined[2], joined[3]),
            self.objects + objects,
            ordered=self.ordered and not objects,
        )

    def _join(self, other: FindingTable) -> FindingTable:
        shift = len(self.objects)
        slots = np.where(other.slots < 0, other.slots - shift, other.slots).astype(np.int32)
        return FindingTable(
            self.table,
            self.thresholds,
            (
                np.concatenate([self.rows, other.rows]),
                np.concatenate([self.kinds, other.kinds]),
                np.concatenate([self.severities, other.severities]),
                np.concatenate([self.slots, slots]),
            ),
            self.objects + other.objects,
            ordered=False,
        )

    def __add__(self, other: object) -> FindingTable:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self.extended(other)

    def in_tensor_order(self) -> FindingTable:
        """Grouped tensor by tensor in the tensors' order, each tensor's own order kept;
        findings on no tensor of the table last."""
        if self.ordered:  # already so (judged on the columns, nothing added after)
            return self
        key = np.where(self.rows < 0, len(self.table), self.rows)
        order = np.argsort(key, kind="stable")
        return FindingTable(
            self.table,
            self.thresholds,
            (self.rows[order], self.kinds[order], self.severities[order], self.slots[order]),
            self.objects,
            ordered=True,
        )

    # -- questions answered on the columns ---------------------------------------

    def kind_is(self, *kinds: FindingKind) -> np.ndarray:
        """A mask of the findings of these kinds."""
        # One comparison per kind: np.isin costs ~15 us a call on a few findings, and a
        # report asks a dozen times (a monitor's step, issue 28 item 9).
        mask: np.ndarray = np.zeros(len(self.kinds), dtype=bool)
        for kind in kinds:
            mask |= self.kinds == _KIND_CODES[kind]
        return mask

    def severity_is(self, severity: Severity) -> np.ndarray:
        """A mask of the findings of this severity."""
        mask: np.ndarray = self.severities == _SEVERITY_CODES[severity]
        return mask

    def source_is(self, source: str | None) -> np.ndarray:
        """A mask of the findings in file ``source`` (``None``: tensors from memory)."""
        table = self.table
        on_table = self.rows >= 0
        mask = np.zeros(len(self), dtype=bool)
        if source in table.sources:
            code = table.sources.index(source)
            mask[on_table] = table.source_codes[self.rows[on_table]] == code
        for position in np.flatnonzero(~on_table).tolist():
            mask[position] = self.objects[-1 - int(self.slots[position])].source == source
        return mask

    def tensors_where(self, mask: np.ndarray) -> np.ndarray:
        """The tensors (indices in ``table``, ascending, once each) with a finding in ``mask``."""
        rows = self.rows[mask]
        unique: np.ndarray = np.unique(rows[rows >= 0])
        return unique

    def select(self, mask: np.ndarray) -> Iterator[Finding]:
        """The findings ``mask`` selects, in order, built a step at a time."""
        positions = np.flatnonzero(mask)
        for start in range(0, len(positions), _STEP):
            yield from self._build(positions[start : start + _STEP])

    def per_tensor(
        self, tensors: Iterable[TensorStats]
    ) -> Iterator[tuple[TensorStats, list[Finding]]]:
        """Each tensor with its findings (a list, maybe empty), in ``table``'s order.

        ``tensors`` are ``table``'s, in its order (iterating it): :func:`evaluate`
        judges each flagged one as it passes, so no TensorStats is made twice. Needs
        :attr:`ordered`; findings on no tensor of the table are in no list.
        """

        if not self.ordered:
            raise ValueError("per_tensor needs findings in tensor order")
        count = len(self.table)
        keys = np.where(self.rows < 0, count, self.rows)  # findings on no tensor are last
        bounds = np.searchsorted(keys, np.arange(count + 1), side="left")
        each = iter(tensors)
        objects, thresholds = self.objects, self.thresholds
        for start in range(0, count, _STEP):
            end = min(count, start + _STEP)
            local = bounds[start : end + 1].tolist()
            base = local[0]
            slots = self.slots[base : local[-1]].tolist()
            for i in range(end - start):
                stats = next(each)
                lo, hi = local[i] - base, local[i + 1] - base
                if lo == hi:
                    yield stats, []
                    continue
                judged: tuple[Finding, ...] = ()
                found = []
                for slot in slots[lo:hi]:
                    if slot < 0:
                        found.append(objects[-1 - slot])
                        continue
                    judged = judged or evaluate(stats, thresholds)
                    found.append(judged[slot])
                yield stats, found

    def severity_bits(self) -> np.ndarray:
        """Per tensor of ``table``, the severities of its findings as bits (``1 << code``,
        codes into :data:`SEVERITIES`); 0 for a tensor without findings."""
        bits = np.zeros(len(self.table), dtype=np.int8)
        on_table = self.rows >= 0
        np.bitwise_or.at(
            bits, self.rows[on_table], np.left_shift(1, self.severities[on_table]).astype(np.int8)
        )
        return bits

    # -- the Sequence[Finding] view ----------------------------------------------

    def _build(self, positions: np.ndarray) -> list[Finding]:
        """The findings at ``positions``: :func:`evaluate` run once per tensor needed."""

        slots = self.slots[positions]
        rows = self.rows[positions]
        judged = slots >= 0
        wanted = np.unique(rows[judged])
        evaluated = dict(
            zip(
                wanted.tolist(),
                (evaluate(stats, self.thresholds) for stats in self.table.each(wanted)),
                strict=True,
            )
        )
        objects = self.objects
        return [
            evaluated[row][slot] if slot >= 0 else objects[-1 - slot]
            for row, slot in zip(rows.tolist(), slots.tolist(), strict=True)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Finding]:
        for start in range(0, len(self), _STEP):
            yield from self._build(np.arange(start, min(len(self), start + _STEP)))

    def _take(self, indices: range) -> Iterator[Finding]:
        return iter(self._build(np.array(indices, dtype=np.int64)))

    def __repr__(self) -> str:
        return f"FindingTable({len(self)} findings)"


def column_findings(table: StatsTable, findings: Sequence[Finding]) -> FindingTable | None:
    """``findings`` when they are a :class:`~gradaudit.scan.finding_table.FindingTable` over
    ``table`` (their counts and sets are then read on the columns), else ``None``."""
    if isinstance(findings, FindingTable) and findings.table is table:
        return findings
    return None


def flagged_indices(
    table: StatsTable,
    findings: Sequence[Finding],
    kinds: Iterable[FindingKind] | None = None,
    *,
    ignored: bool = True,
) -> np.ndarray:
    """Indices (ascending) of the tensors with a finding of ``kinds`` (any kind: ``None``);
    ``ignored=False`` leaves out the ignored findings."""
    wanted = None if kinds is None else tuple(kinds)
    columns = column_findings(table, findings)
    if columns is not None:
        if not len(columns):  # a healthy step: asked several times per report
            return np.zeros(0, dtype=np.int64)
        mask = np.ones(len(columns), dtype=bool) if wanted is None else columns.kind_is(*wanted)
        if not ignored:
            mask &= ~columns.severity_is(Severity.IGNORED)
        return columns.tensors_where(mask)
    keys = {
        (f.source, f.tensor)
        for f in findings
        if (wanted is None or f.kind in wanted) and (ignored or not f.ignored)
    }
    return tensor_indices(table, keys)
