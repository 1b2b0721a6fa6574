"""The host half of a collection: what is known of each tensor without its values, and the
report made from the stats rows once they are on the host.

:class:`~gradaudit.scan.pending.PendingStats` (rows on a device, torch) and
:class:`~gradaudit.scan.torch_free.NativeScan` (rows written by the native kernel into
host memory, no torch) are both a :class:`Collected`: one set of columns, one way from
rows to a :class:`~gradaudit.results.Report` (:meth:`Collected.report`: roles,
findings, per-file and global norms by the one merge rule, the summary). Nothing here
imports torch, so the torch-free scan is not a second implementation of any of it.
"""

from __future__ import annotations

import array
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np

from gradaudit.io.discover import BadInput, Expanded, SkippedPath
from gradaudit.io.trainer_state import LoggedStep, describe_history
from gradaudit.no_gc import paused_gc
from gradaudit.policy import Role, Thresholds
from gradaudit.precision.formats import ExponentHistogram
from gradaudit.results import FileResult, InputProblem, LoggedHistory, Report, Skipped
from gradaudit.results.roles import FileEvidence, TensorHint
from gradaudit.results.row import NAN, NEG_INF, POS_INF, merge_rows, row_norm
from gradaudit.results.stats_table import ROLES, StatsTable, coded, shapes_of
from gradaudit.roles import metadata_evidence
from gradaudit.scan.estimates import gradient_estimates
from gradaudit.scan.history import evaluate_history
from gradaudit.scan.judge import (
    RoleDecision,
    decide_roles,
    evaluate_all,
    evaluate_limits,
    evaluate_optimizer_state,
    evaluate_skipped,
    in_tensor_order,
    summarize,
)
from gradaudit.scan.layout import LayoutCache, LayoutKey, ReportLayout
from gradaudit.scan.outliers import find_outliers, outlier_groups


class Routing(Protocol):
    """Which source label each tensor of a file is collected under."""

    @property
    def labels(self) -> tuple[str, ...]:
        """The labels the file's metadata evidence is recorded under (every route's)."""
        ...

    def route(self, name: str) -> str | Skipped:
        """The label of the tensor ``name``, or why it is left out."""
        ...

    @property
    def whole(self) -> str | None:
        """The label of every tensor of the file when no name is routed (else ``None``):
        the file is then read as runs of tensors, like a scan's, with no call per name."""
        ...


#: Role codes of optimizer state in a StatsTable (their gradient estimates need each one).
_OPTIMIZER_CODES = [ROLES.index(Role.OPTIMIZER_MOMENT), ROLES.index(Role.OPTIMIZER_SECOND_MOMENT)]


#: Collected's attributes that hold one item per collected tensor, in order.
_FACT_COLUMNS = ("_names", "_ranks", "_dims", "_dtypes", "_sources", "_hints")


class Collected:
    """Per-tensor facts as columns, plus the skipped, excluded and failed inputs.

    Subclasses add the rows (:meth:`report` takes them on the host, in the order the
    tensors were collected).
    """

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._names: list[str] = []
        #: Shapes as columns: each entry's rank, and every entry's dimensions back to back
        #: (a million tiny tensors keep no tuple each).
        self._ranks = array.array("q")
        self._dims = array.array("q")
        self._dtypes: list[str] = []
        self._sources: list[str | None] = []
        self._hints: list[TensorHint | None] = []
        #: What each file's metadata says it holds, where it says anything.
        self._file_evidence: dict[str, FileEvidence] = {}
        #: Each file's logged training history (``trainer_state.json``), judged with the rows.
        self._histories: dict[str, tuple[LoggedStep, ...]] = {}
        self._skipped: list[Skipped] = []
        self._files: list[str] = []
        self._errors: list[InputProblem] = []
        self._excluded: Counter[str | None] = Counter()

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        return tuple(self._skipped)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self._files)

    @property
    def errors(self) -> tuple[InputProblem, ...]:
        return tuple(self._errors)

    @property
    def excluded(self) -> dict[str | None, int]:
        """Names left out by ``--include``/``--exclude``, counted per source."""
        return dict(self._excluded)

    @property
    def file_evidence(self) -> dict[str, FileEvidence]:
        """What each file's metadata says it holds (see :meth:`read_hints`)."""
        return dict(self._file_evidence)

    def add_file_evidence(self, evidence: Mapping[str, FileEvidence]) -> None:
        """Add file evidence gathered elsewhere (another rank's share of the inputs)."""
        self._file_evidence.update(evidence)

    def add_excluded(self, counts: Mapping[str | None, int]) -> None:
        """Add exclusion counts gathered elsewhere (another rank's share of the inputs)."""
        self._excluded.update(counts)

    def skip(self, skipped: Skipped) -> None:
        self._skipped.append(skipped)

    def exclude(self, source: str | None = None) -> None:
        """Count a name left out by ``--include``/``--exclude`` (counted, never listed)."""
        self._excluded[source] += 1

    def add_file(self, path: str) -> None:
        """Record an input file, so it is reported even when it holds nothing to audit."""
        self._files.append(path)

    def add_error(self, problem: InputProblem) -> None:
        self._errors.append(problem)

    def add_input(
        self,
        entry: Expanded,
        select: Callable[[str], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Collect one expanded input: a file, or a path that was skipped or is bad."""
        if isinstance(entry, SkippedPath):
            self.skip(Skipped(entry.path, entry.reason, entry.within))
        elif isinstance(entry, BadInput):
            self.add_error(InputProblem(entry.path, entry.cause))
        else:
            self.add_path(entry.path, select, progress)

    def add_path(
        self,
        path: str,
        select: Callable[[str], bool] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Collect one file; a file that fails is recorded as an error and contributes nothing."""
        self.add_file(path)
        problem = self.read_file(path, select, progress)
        if problem is not None:
            self.add_error(problem)

    def read_file(
        self,
        path: str,
        select: Callable[[str], bool] | None = None,
        progress: Callable[[int], None] | None = None,
        routing: Routing | None = None,
    ) -> InputProblem | None:
        """Collect one file's tensors, all or nothing; return its problem if it fails.

        ``select`` keeps tensors by name; ``progress`` hears the bytes read; ``routing``
        labels each tensor (``compare``'s sides; default: the path).
        """
        raise NotImplementedError

    def materialize(self, thresholds: Thresholds | None = None) -> Report:
        """The report of everything collected: the rows read to the host, then :meth:`report`."""
        raise NotImplementedError

    def read_hints(self, reader: object, label: str) -> Mapping[str, TensorHint]:
        """Note what ``reader``'s file says it holds (under ``label``); return its tensor hints.

        Both are optional reader attributes (see :class:`gradaudit.io.base.TensorSource`):
        ``metadata`` decides the file's default role, ``role_hints`` (filled while the
        reader yields) each tensor's.
        """
        metadata = getattr(reader, "metadata", None)
        evidence = metadata_evidence(metadata if isinstance(metadata, Mapping) else None)
        if evidence is not None:
            self._file_evidence[label] = evidence
        history = getattr(reader, "logged_history", None)
        if isinstance(history, tuple) and history:
            self._histories[label] = history
        hints = getattr(reader, "role_hints", None)
        return hints if isinstance(hints, Mapping) else {}

    def add_columns(
        self,
        names: list[str],
        ranks: Sequence[int],
        dims: Sequence[int],
        dtype: str,
        source: str | None,
        hint: TensorHint | None = None,
    ) -> None:
        """The facts of ``len(names)`` tensors of one dtype, a column at a time (one hint
        for all of them: a reader that knows one gives one tensor at a time)."""
        count = len(names)
        self._names += names
        self._ranks += array.array("q", ranks) if not isinstance(ranks, array.array) else ranks
        self._dims += array.array("q", dims) if not isinstance(dims, array.array) else dims
        self._dtypes += [dtype] * count
        self._sources += [source] * count
        self._hints += [hint] * count

    def absorb_facts(self, other: Collected, columns: tuple[str, ...] = ()) -> None:
        """Take ``other``'s facts after this one's (a file read to the end), and the
        subclass's own per-tensor ``columns``; ``other`` is left without them.

        Moved, not copied: a file's child is absorbed once, and a file of a million tiny
        tensors would otherwise hold its facts twice at that moment (the peak of the scan).
        """
        for column in (*_FACT_COLUMNS, *columns):
            mine, theirs = getattr(self, column), getattr(other, column)
            if mine:
                mine += theirs
            else:
                setattr(self, column, theirs)
            setattr(other, column, theirs[:0])
        self._file_evidence.update(other._file_evidence)
        self._histories.update(other._histories)
        self._skipped += other._skipped
        self._excluded += other._excluded

    def _starts(self) -> np.ndarray:
        """Where each entry's dimensions start in :attr:`_dims` (one more: the end)."""
        starts = np.zeros(len(self._ranks) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self._ranks, dtype=np.int64), out=starts[1:])
        return starts

    def _shapes(self) -> list[tuple[int, ...]]:
        return shapes_of(
            np.frombuffer(self._dims, dtype=np.int64), self._starts(), 0, len(self._ranks)
        )

    def _table(self, host: np.ndarray, layout: ReportLayout | None = None) -> StatsTable:
        """The collected tensors' facts and their host rows as a :class:`StatsTable`
        (the facts' columns taken from ``layout``, made for these facts, when given)."""
        if layout is not None:
            return StatsTable.from_rows(
                self._names,
                layout.dims,
                layout.starts,
                layout.dtype_codes,
                layout.dtypes,
                layout.source_codes,
                layout.sources,
                host,
                numel=layout.numel,
            )
        starts = self._starts()
        dims = np.frombuffer(self._dims, dtype=np.int64).copy()
        dtypes, dtype_codes = coded(self._dtypes, np.int16)
        sources, source_codes = coded(self._sources, np.int32)
        return StatsTable.from_rows(
            self._names, dims, starts, dtype_codes, dtypes, source_codes, sources, host
        )

    def _layout_key(self, thresholds: Thresholds) -> LayoutKey:
        """The facts a :class:`~gradaudit.scan.layout.ReportLayout` of these tensors is
        made from."""
        return LayoutKey(
            self._names,
            self._ranks,
            self._dims,
            self._dtypes,
            self._sources,
            thresholds,
            self._file_evidence,
        )

    def report(
        self,
        host: np.ndarray,
        thresholds: Thresholds | None,
        *,
        device: str,
        engine: str,
        histograms: tuple[ExponentHistogram | None, ...] = (),
        layouts: LayoutCache | None = None,
    ) -> Report:
        """Judge the host rows ``[len(names), 7]`` (float64, in collection order).

        The per-tensor results are a :class:`~gradaudit.results.stats_table.StatsTable`
        (columns; a TensorStats is made when one is asked for), judged on the
        columns where that is simple: a million tiny tensors make no object each.
        ``histograms`` (``--precision``) come one per entry, read with the rows.
        ``layouts`` keeps what follows from the tensors' facts alone for the next report
        of the same tensors, and takes it from there when they are the same
        (:mod:`gradaudit.scan.layout`; tensors without hints only).
        """
        thresholds = thresholds or Thresholds()
        with paused_gc():
            hints = self._hints
            plain = hints.count(None) == len(hints)  # C speed: most collections hold no hint
            key = self._layout_key(thresholds) if layouts is not None and plain else None
            layout = None if layouts is None or key is None else layouts.get(key)
            table = self._table(host, layout)
            aux = (
                []
                if plain
                else [
                    i for i, hint in enumerate(hints) if hint is not None and hint.aux is not None
                ]
            )
            derived = (
                {
                    (stats.source, hint.aux_for, hint.aux): stats
                    for stats, hint in zip(table.take(aux), [hints[i] for i in aux], strict=True)
                    if hint is not None and hint.aux is not None
                }
                if aux
                else {}
            )
            main: list[int] = []
            if aux:  # derived rows ride along; they are not audited tensors
                skip = set(aux)
                main = [i for i in range(len(table)) if i not in skip]
                host = host[main]
                table = table.subset(main)
                hints = [hints[i] for i in main]
            roles = (
                decide_roles(table, hints, thresholds, self._file_evidence)
                if layout is None
                else layout.roles
            )
            readings = roles.apply(table)
            optimizer = (
                np.flatnonzero(np.isin(table.role_codes, _OPTIMIZER_CODES)).tolist()
                if layout is None
                else layout.optimizer
            )
            estimates, negatives = (
                gradient_estimates(table.take(optimizer), [hints[i] for i in optimizer], derived)
                if optimizer
                else ((), [])
            )
            judged = evaluate_all(table, thresholds) + evaluate_optimizer_state(
                estimates, negatives, thresholds
            )
            groups = None if layout is None else layout.outliers
            outliers, references = find_outliers(table, thresholds, judged, groups)
            # Roles guessed from the values hold for those values only: no layout then.
            if layouts is not None and key is not None and layout is None and not roles.from_values:
                layouts.keep(_layout_of(key.frozen(), table, roles, optimizer))
            findings = (
                in_tensor_order(table, judged + outliers)
                + evaluate_skipped(self._skipped, thresholds)
                + evaluate_history(self._histories, thresholds)
            )
        global_row = merge_rows(host) if len(table) else None
        global_norm = 0.0 if global_row is None else row_norm(global_row.tolist())
        files = tuple(self._file_results(host, table, readings, global_row))
        limit_findings = evaluate_limits(table, findings, files, global_norm, thresholds)
        if histograms and aux:
            histograms = tuple(histograms[i] for i in main)
        return Report(
            tensors=table,
            findings=findings,
            skipped=tuple(self._skipped),
            summary=summarize(
                table,
                findings,
                limit_findings,
                len(self._skipped),
                global_norm,
                self._excluded.total(),
            ),
            device=device,
            engine=engine,
            elapsed_s=time.perf_counter() - self._started,
            files=files,
            errors=tuple(self._errors),
            thresholds=thresholds,
            limit_findings=limit_findings,
            estimates=estimates,
            outlier_references=references,
            histograms=histograms,
            histories=tuple(
                LoggedHistory(path, len(rows), describe_history(rows))
                for path, rows in self._histories.items()
            ),
        )

    def _file_results(
        self,
        host: np.ndarray,
        table: StatsTable,
        readings: Mapping[str | None, tuple[str, str, bool]],
        global_row: np.ndarray | None,
    ) -> Iterator[FileResult]:
        if not self._files and not self._errors:  # gradients in memory (a monitor's step)
            return
        errors = {problem.path: problem.message for problem in self._errors}
        skipped = Counter(s.source for s in self._skipped)
        for path in dict.fromkeys(self._files + list(errors)):
            indices = table.source_indices(path)
            if not len(indices):
                norm = None
            else:
                # A file that holds every tensor has the global row (no copy of the rows).
                row = (
                    global_row
                    if global_row is not None and len(indices) == len(table)
                    else merge_rows(host[indices])
                )
                values = row.tolist()
                elements = int(table.numel[indices].sum())
                # No finite element in the file (all NaN/Inf): no norm, never a 0.
                unmeasured = (
                    elements and values[NAN] + values[POS_INF] + values[NEG_INF] >= elements
                )
                norm = None if unmeasured else row_norm(values)
            read_as, evidence, thin = readings.get(path, ("nothing", "", False))
            yield FileResult(
                path=path,
                tensors=len(indices),
                skipped=skipped[path],
                elements=int(table.numel[indices].sum()),
                global_norm=norm,
                error=errors.get(path),
                excluded=self._excluded[path],
                read_as=read_as,
                read_as_evidence=evidence,
                evidence_thin=thin,
            )


def _layout_of(
    key: LayoutKey, table: StatsTable, roles: RoleDecision, optimizer: list[int]
) -> ReportLayout:
    """The layout of ``table``'s tensors, made from their facts (``key``) and what the
    report just worked out from them."""
    return ReportLayout(
        key,
        table.dims,
        table.starts,
        table.numel,
        table.dtype_codes,
        table.dtypes,
        table.source_codes,
        table.sources,
        roles,
        optimizer,
        outlier_groups(table),
    )
