"""Headroom judged: which tensors would lose values in a format (findings), a scan's
headroom of every tensor, layer and file (:class:`PrecisionReport`), a training step's
(:class:`StepHeadroom`), and their findings as the scan's ``cast`` findings.

The counts come from :mod:`gradaudit.precision.headroom`; this module decides what they
mean. numpy is imported where it is used: the CLI's ``--help`` imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradaudit.grouping import model_order
from gradaudit.policy import FindingKind, Thresholds, fraction_exceeds
from gradaudit.precision.formats import FORMATS, ExponentHistogram, Precision
from gradaudit.precision.headroom import Headroom, headroom, headroom_columns
from gradaudit.results import Finding, Report

if TYPE_CHECKING:
    import numpy as np


#: A tensor in which more than this fraction of the non-zero values would flush to zero
#: (``--max-underflow``) gets a finding.
DEFAULT_MAX_UNDERFLOW = 0.01


@dataclass(frozen=True)
class PrecisionFinding:
    """A tensor that would lose values in the target format: underflow or overflow."""

    kind: str  # "underflow" or "overflow"
    tensor: str
    precision: Precision
    fraction: float
    message: str
    source: str | None = None


def _count(n: int, noun: str) -> str:
    """``1 value``, ``2,070 values``: a finding's message reads as English for every count,
    with the thousands separator the tables beside it use."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def judge(
    rows: Sequence[Headroom], max_underflow: float = DEFAULT_MAX_UNDERFLOW
) -> tuple[PrecisionFinding, ...]:
    """Findings: more than ``max_underflow`` of a tensor's values flush, or any overflows."""
    out: list[PrecisionFinding] = []
    for row in rows:
        label = row.precision.value
        if fraction_exceeds(row.flushed, row.nonzero, max_underflow):
            out.append(
                PrecisionFinding(
                    "underflow",
                    row.name,
                    row.precision,
                    row.flushed_fraction,
                    f"{row.flushed_fraction:.1%} of {_count(row.nonzero, 'non-zero value')} "
                    f"{'flushes' if row.nonzero == 1 else 'flush'} to zero in {label} "
                    f"(> {max_underflow:g})"
                    + ("" if row.scale_log2 is None else f"; scale by 2**{row.scale_log2}"),
                    row.source,
                )
            )
        if row.overflowed:
            spec = FORMATS[row.precision]
            out.append(
                PrecisionFinding(
                    "overflow",
                    row.name,
                    row.precision,
                    row.overflowed_fraction,
                    f"{_count(row.overflowed, 'value')} "
                    f"{'overflows' if row.overflowed == 1 else 'overflow'} {label} "
                    f"({spec.overflow_result})"
                    + ("" if row.scale_log2 is None else f"; scale by 2**{row.scale_log2}"),
                    row.source,
                )
            )
    return tuple(out)


@dataclass(frozen=True)
class PrecisionReport:
    """Headroom of every audited tensor, layer and the whole model for one format."""

    precision: Precision
    max_underflow: float
    tensors: tuple[Headroom, ...]
    #: Tensors grouped by owning module (``a.b.weight`` -> ``a.b``), in model order.
    layers: tuple[Headroom, ...]
    total: Headroom
    #: The whole run per input file, in the order first seen (one row for one file; the
    #: in-memory tensors of a library report are one row named :data:`IN_MEMORY`). JUnit
    #: reports each file's headroom in that file's test suite.
    files: tuple[Headroom, ...]
    #: The whole model's histogram (what ``--plot`` draws).
    histogram: ExponentHistogram
    findings: tuple[PrecisionFinding, ...]


def as_findings(report: PrecisionReport, thresholds: Thresholds) -> tuple[Finding, ...]:
    """The headroom findings as ``cast`` findings of the scan (they always fail, as
    ``--cast-check`` does; ``ignore`` patterns still apply): one verdict counts them."""
    return cast_findings(report.findings, thresholds)


def cast_findings(
    findings: Iterable[PrecisionFinding], thresholds: Thresholds
) -> tuple[Finding, ...]:
    """Headroom findings as ``cast`` findings (:func:`as_findings`, a monitor's step)."""
    return tuple(
        Finding(
            FindingKind.CAST,
            thresholds.severity(FindingKind.CAST, f.tensor),
            f.tensor,
            f"{f.precision.value} headroom: {f.message}",
            f.source,
        )
        for f in findings
    )


#: The name of the headroom row of every tensor together.
ALL_TENSORS = "(all tensors)"
#: The name of the headroom row of tensors audited from memory (no input file).
IN_MEMORY = "(in memory)"


def _merged(
    name: str,
    members: Sequence[tuple[ExponentHistogram, float]],
    precision: Precision,
    source: str | None = None,
) -> Headroom:
    """The headroom of several tensors together: histograms add, the largest max |x| scales."""
    merged = ExponentHistogram.merge(h for h, _ in members)
    return headroom(name, merged, precision, max_abs=max(m for _, m in members), source=source)


def precision_report(
    report: Report, precision: Precision, max_underflow: float = DEFAULT_MAX_UNDERFLOW
) -> PrecisionReport:
    """Judge a report collected with histograms (``scan_paths(..., histograms=True)``)."""
    if len(report.histograms) != len(report.tensors):
        raise ValueError("the report was collected without exponent histograms")
    rows: list[Headroom] = []
    groups: dict[str, list[tuple[ExponentHistogram, float]]] = {}
    by_file: dict[str | None, list[tuple[ExponentHistogram, float]]] = {}
    kept: list[ExponentHistogram] = []
    for stats, histogram in zip(report.tensors, report.histograms, strict=True):
        if histogram is None:
            continue
        kept.append(histogram)
        rows.append(
            headroom(stats.name, histogram, precision, max_abs=stats.max_abs, source=stats.source)
        )
        layer = stats.name.rsplit(".", 1)[0] if "." in stats.name else stats.name
        groups.setdefault(layer, []).append((histogram, stats.max_abs))
        by_file.setdefault(stats.source, []).append((histogram, stats.max_abs))
    layers = []
    for name in model_order(groups):
        layers.append(_merged(name, groups[name], precision))
    files = tuple(
        _merged(IN_MEMORY if source is None else source, members, precision, source)
        for source, members in by_file.items()
    )
    total_histogram = ExponentHistogram.merge(kept)
    top = max((t.max_abs for t in report.tensors), default=0.0)
    total = headroom(ALL_TENSORS, total_histogram, precision, max_abs=top)
    return PrecisionReport(
        precision,
        max_underflow,
        tuple(rows),
        tuple(layers),
        total,
        files,
        total_histogram,
        judge(rows, max_underflow),
    )


@dataclass(frozen=True)
class StepHeadroom:
    """The headroom of one training step's gradients, as a monitor keeps it.

    What a training loop needs on every collected step, and no more: the whole model's
    row (the logged scalars), and the rows of the tensors with a finding (what the
    warning names). :func:`precision_report` has every tensor's and layer's row, for a
    scan; the counts are the same (:class:`HeadroomColumns`).
    """

    precision: Precision
    max_underflow: float
    #: Every gradient together (``(all tensors)``).
    total: Headroom
    #: The gradients with a finding, in collection order.
    flagged: tuple[Headroom, ...]
    findings: tuple[PrecisionFinding, ...]


def step_headroom(
    names: Sequence[str],
    counts: np.ndarray,
    max_abs: np.ndarray,
    precision: Precision,
    max_underflow: float = DEFAULT_MAX_UNDERFLOW,
) -> StepHeadroom:
    """Judge ``counts`` (one histogram row per name) with ``max_abs`` (each one's max |x|).

    Only the rows that may have a finding become :class:`Headroom` objects, and
    :func:`judge` decides on them exactly: the columns pick every row with an overflow or
    a flushed fraction within a rounding error of ``max_underflow`` (a float product may
    err; :func:`~gradaudit.policy.fraction_exceeds` does not).
    """
    import numpy as np  # here, not at the top: the CLI's --help imports this module

    if len(names) != counts.shape[0] or len(names) != len(max_abs):
        raise ValueError("one histogram row and one max |x| per name")
    columns = headroom_columns(counts, precision)
    limit = max_underflow * columns.nonzero.astype(np.float64) * (1 - 1e-9)
    maybe = (columns.overflowed > 0) | ((columns.flushed > 0) & (columns.flushed >= limit))
    rows = [
        columns.row(i, names[i], max_abs=float(max_abs[i])) for i in np.flatnonzero(maybe).tolist()
    ]
    findings = judge(rows, max_underflow)
    flagged_names = {f.tensor for f in findings}
    total_columns = headroom_columns(counts.sum(axis=0, keepdims=True), precision)
    top = float(max_abs.max()) if len(max_abs) else 0.0
    return StepHeadroom(
        precision,
        max_underflow,
        total_columns.row(0, ALL_TENSORS, max_abs=top),
        tuple(row for row in rows if row.name in flagged_names),
        findings,
    )
