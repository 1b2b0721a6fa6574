"""Sentences, counts and orderings shared by the comparison renderers, so they never disagree.

The comparison counterpart of ``verdict.py``: the table, Markdown, GitHub and
JUnit formats say what was compared, what the ratio means and what the verdict
is with these functions, and JSON writes the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from typing import Literal, overload

import numpy as np

from gradaudit.errors import ExitCode
from gradaudit.policy import Role, Severity
from gradaudit.report.text import count, internal_note, number, plural, printable
from gradaudit.report.verdict import failing_kinds as report_failing_kinds
from gradaudit.report.verdict import finding_columns
from gradaudit.results import Finding
from gradaudit.results.change_table import ChangeTable
from gradaudit.results.comparison import (
    CompareFindingKind,
    Comparison,
    DualGradientStats,
    Mismatch,
    ParameterChange,
    ParameterComparison,
    SideStats,
)
from gradaudit.results.stats_table import StatsTable
from gradaudit.results.verdict import comparison_exit_code
from gradaudit.scan.finding_table import KINDS, SEVERITIES

#: How the normalized ratio is defined, written into the JSON next to it.
FORMULA = "(seed_norm / host_norm) * sqrt(host_params / seed_params)"
#: The same, short enough for the table's ratio line.
SHORT_FORMULA = "raw × √(host_params / seed_params)"


def ab_mode(comparison: Comparison) -> bool:
    """Two dumps of one model (no prefixes, mostly the same names): the sides are A and B.

    Host and seed are roles inside one model (``--host-prefix``/``--seed-prefix``)
    or two different modules' dumps; two dumps of the *same* model are just a
    before and an after, and calling them host and seed would suggest a
    relation that is not there. "The same model" is: at least half of each
    side's tensors have a namesake on the other side.
    """
    dual, parameters = comparison.dual, comparison.parameters
    if dual.host.prefix is not None or dual.seed.prefix is not None or parameters is None:
        return False
    shared = len(parameters.changes) + len(shape_mismatches(parameters))
    return 2 * shared >= max(dual.host.tensors, dual.seed.tensors)


def side_name(comparison: Comparison, label: str | None) -> str:
    """``A``/``B`` for two dumps of one model, ``host``/``seed`` otherwise."""
    if label is None:
        return ""
    if ab_mode(comparison):
        return "A" if label == comparison.dual.host.label else "B"
    return label


def compared(comparison: Comparison) -> str:
    """What the two sides hold, as the sentences say it: ``weights`` when more of the
    compared tensors are weights than gradients (``compare checkpoint-10/ checkpoint-30/``;
    the comparison refused sides of different roles already), else ``gradients``."""
    table = StatsTable.from_stats(comparison.report.tensors)
    weights = int(table.role_mask(Role.WEIGHT).sum())
    return "weights" if weights > int(table.role_mask(Role.GRADIENT).sum()) else "gradients"


def interpretation(dual: DualGradientStats, ab: bool = False, noun: str = "gradients") -> str:
    """One plain sentence on what the normalized ratio says (``ab``: in A/B words; ``noun``:
    what the sides hold, :func:`compared`)."""
    ratio = dual.normalized_ratio
    if ratio is None:
        note = dual.ratio_note or ""
        return f"ratio not computed: {_ab_words(note) if ab else note}"
    first, second = ("A's", "B's") if ab else ("host", "seed")
    intense, more = ("intense", "more intense") if noun == "gradients" else ("large", "larger")
    if math.isinf(ratio):
        return f"{first} {noun} are zero: {second} are infinitely {more} per parameter"
    if ratio == 0.0:
        if noun != "gradients":
            return f"{second} {noun} are zero"
        return f"{second} gradients are zero: the {second} side receives no gradient".replace(
            "the seed side", "the seed"
        )
    shown = number(ratio)
    whose = "A's" if ab else "the host's"
    if shown == "1":
        return f"{second} {noun} are as {intense} per parameter as {whose} (ratio {shown})"
    text = f"{second} {noun} are {shown}× as {intense} per parameter as {whose}"
    if ratio < 1.0:
        text += f" ({number(1.0 / ratio)}× {'weaker' if noun == 'gradients' else 'smaller'})"
    return text


def _ab_words(text: str) -> str:
    for said, meant in _AB_WORDS:
        text = text.replace(said, meant)
    return text


def side_words(comparison: Comparison, text: str) -> str:
    """``text`` with "host"/"seed" said as "A"/"B" when the sides are two dumps of one model."""
    return _ab_words(text) if ab_mode(comparison) else text


_AB_WORDS = (
    ("on the host and seed side", "on both sides"),
    ("host and seed", "A and B"),
    ("the host side", "A"),
    ("the seed side", "B"),
    ("the host gradient norm", "A's gradient norm"),
    ("the seed gradient norm", "B's gradient norm"),
    ("the seed receives", "B receives"),
    ("the host", "A"),
    ("the seed", "B"),
)


def ratio_sentence(dual: DualGradientStats, ab: bool = False, noun: str = "gradients") -> str:
    """``normalized ratio 1.76: seed gradients are …`` or ``normalized ratio not computed: …``."""
    if dual.normalized_ratio is None:
        note = dual.ratio_note or ""
        return f"normalized ratio not computed: {_ab_words(note) if ab else note}"
    return f"normalized ratio {number(dual.normalized_ratio)}: {interpretation(dual, ab, noun)}"


def ratio_line(dual: DualGradientStats, ab: bool = False) -> str:
    """``raw ratio seed/host 0.206 · normalized ratio 1.76`` (``B/A`` for two whole dumps)."""
    which = "B/A" if ab else "seed/host"
    return (
        f"raw ratio {which} {number(dual.raw_ratio)} · "
        f"normalized ratio {number(dual.normalized_ratio)}"
    )


def short_formula(ab: bool) -> str:
    """:data:`SHORT_FORMULA`, in A/B words for two dumps of one model."""
    return "raw × √(params A / params B)" if ab else SHORT_FORMULA


def side_input(side: SideStats) -> str:
    """Where a side's tensors come from: the file and the prefix, if any."""
    where = side.path if side.path is not None else "(in memory)"
    return f"{where} [{side.prefix}*]" if side.prefix else where


def shape_text(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape) or "()"


def mismatch_parts(mismatch: Mismatch) -> list[str]:
    """What differs: ``shape 64×32 vs 32×64 (not compared)``, ``dtype bfloat16 vs float32``."""
    parts = []
    if mismatch.shape_differs:
        shapes = f"{shape_text(mismatch.shape_a)} vs {shape_text(mismatch.shape_b)}"
        parts.append(f"shape {shapes} (not compared)")
    if mismatch.dtype_differs:
        parts.append(f"dtype {mismatch.dtype_a} vs {mismatch.dtype_b}")
    return parts


def finding_subjects(
    comparison: Comparison, kind: CompareFindingKind, limit: int | None = None
) -> tuple[list[str], int]:
    """The shared tensors a per-parameter finding is about, one phrase each (names printable):
    the first ``limit`` (all for ``None``), and how many there are.

    ``mlp.weight: B/A 4.5 (+350%)`` for a large change, ``pooler.weight: shape
    2×3 vs 3×2 (not compared)`` for a mismatch; nothing for other kinds.
    """
    parameters = comparison.parameters
    if parameters is None:
        return [], 0
    if kind is CompareFindingKind.LARGE_CHANGE:
        flagged, total = ordered_changes(parameters, FLAGGED, limit)
        return [
            f"{printable(c.name)}: B/A {number(c.ratio)} ({change_text(c)})" for c in flagged
        ], total
    if kind is CompareFindingKind.MISMATCH:
        mismatches = shape_mismatches(parameters)
        return [
            f"{printable(m.name)}: {'; '.join(mismatch_parts(m))}" for m in mismatches[:limit]
        ], len(mismatches)
    return [], 0


#: Which shared tensors :func:`ordered_changes` lists.
FLAGGED, NOTABLE, REST, ALL = "flagged", "notable", "rest", "all"


@overload
def ordered_changes(
    parameters: ParameterComparison,
    rows: str = ALL,
    limit: int | None = None,
    stream: Literal[False] = False,
) -> tuple[list[ParameterChange], int]: ...


@overload
def ordered_changes(
    parameters: ParameterComparison, rows: str, limit: None, stream: Literal[True]
) -> tuple[Iterator[ParameterChange], int]: ...


def ordered_changes(
    parameters: ParameterComparison,
    rows: str = ALL,
    limit: int | None = None,
    stream: bool = False,
) -> tuple[list[ParameterChange] | Iterator[ParameterChange], int]:
    """Shared tensors in order: flagged first, then not comparable, then the rest, each by
    how far B/A is from 1 (:meth:`ChangeTable.order`); the first ``limit`` of ``rows``
    (:data:`FLAGGED`, :data:`NOTABLE`: flagged or not comparable, :data:`REST`: the others,
    :data:`ALL`), and how many there are.

    Picked on the columns: a million shared tensors build only the changes shown.
    ``stream=True`` (every row) gives them one at a time, as the JSON writes them.
    """
    table = ChangeTable.from_changes(parameters.changes)
    order = table.order()
    if rows == ALL and limit is None and stream:
        return table.each(order), len(order)
    if rows != ALL:
        mask = table.flagged if rows == FLAGGED else table.notable_mask()
        order = order[(~mask if rows == REST else mask)[order]]
    return list(table.each(order[:limit])), len(order)


def change_text(change: ParameterChange) -> str:
    """The change B/A: ``+39.6%``, ``-98%`` within a factor of 10, ``×1.6e+21``/``×1e-05`` beyond.

    A percentage of a huge ratio is a wall of digits (``+999,999,978,243…%``)
    that reads worse than the factor it stands for.
    """
    ratio = change.ratio
    relative = change.relative_change
    if ratio is None or relative is None:
        return "-"
    if math.isinf(ratio):
        return "×inf"
    if ratio >= 10.0 or 0.0 < ratio <= 0.1:
        return f"×{number(ratio)}"
    return f"{100.0 * relative:+.3g}%"


def dtype_changes(parameters: ParameterComparison) -> list[tuple[str, str, int]]:
    """``(dtype A, dtype B, how many)`` of the shared tensors stored in different dtypes.

    A norm does not depend on the storage dtype, so these tensors are still
    compared; one summary line says so instead of one line per tensor.
    """
    counts: dict[tuple[str, str], int] = {}
    for mismatch in parameters.mismatches:
        if mismatch.dtype_differs and not mismatch.shape_differs:
            key = (mismatch.dtype_a, mismatch.dtype_b)
            counts[key] = counts.get(key, 0) + 1
    return [(a, b, n) for (a, b), n in sorted(counts.items(), key=lambda kv: -kv[1])]


def dtype_line(parameters: ParameterComparison) -> str | None:
    """``dtype differs for 101 shared tensors (float32 in A, bfloat16 in B): still compared``."""
    changes = dtype_changes(parameters)
    if not changes:
        return None
    total = sum(n for _, _, n in changes)
    several = len(changes) > 1
    pairs = "; ".join(
        f"{a} in A, {b} in B" + (f": {n:,}" if several else "") for a, b, n in changes[:3]
    )
    more = "; …" if len(changes) > 3 else ""
    return (
        f"dtype differs for {plural(total, 'shared tensor')} ({pairs}{more}): still compared, "
        "a norm does not depend on the storage dtype"
    )


def identity_line(parameters: ParameterComparison) -> str:
    """Whether the sides are the same tensors, bit for bit, or which shared tensor differs
    first: what two DDP ranks' dumps of one step are compared for (``identical`` must hold)."""
    if parameters.identical:
        return "identical: every tensor's stats, shape and dtype agree bit for bit"
    if parameters.first_difference is None:
        return "the shared tensors' stats agree bit for bit; the names differ"
    return (
        f"first differing tensor: {printable(parameters.first_difference)} "
        f"({parameters.differing:,} of "
        f"{plural(len(parameters.changes) + len(shape_mismatches(parameters)), 'shared tensor')}"
        " differ)"
    )


def shape_mismatches(parameters: ParameterComparison) -> list[Mismatch]:
    """Shared names whose shapes differ: these are not compared and each is listed."""
    return [m for m in parameters.mismatches if m.shape_differs]


def merged_tensor_findings(
    comparison: Comparison,
    severities: Collection[Severity] = tuple(Severity),
    limit: int | None = None,
) -> tuple[list[tuple[Finding, str]], int]:
    """Per-tensor findings with the same tensor, kind and severity on both sides said once:
    the first ``limit`` (all for ``None``) of those of ``severities``, failing first, then
    warnings, then ignored (stable within each), and how many there are.

    Two dumps of one model usually share their vanishing biases; listing the
    same warning for A and then for B doubles the noise. Each entry is the first
    finding and the sides it holds for (``A``, ``B`` or ``A and B``). Grouped on the
    columns: a million findings build only the ``limit`` shown.
    """
    findings = comparison.tensor_findings
    columns = finding_columns(comparison.report)
    if columns is not None:
        kinds, levels = columns.kinds, columns.severities
        names = list(map(columns.table.names.__getitem__, columns.rows.tolist()))
        for i in np.flatnonzero(columns.rows < 0).tolist():  # findings kept as objects
            names[i] = columns.objects[-1 - int(columns.slots[i])].tensor
    else:
        kinds = np.array([KINDS.index(f.kind) for f in findings], dtype=np.int64)
        levels = np.array([SEVERITIES.index(f.severity) for f in findings], dtype=np.int64)
        names = [f.tensor for f in findings]
    rank = np.array([_RANK[s] for s in SEVERITIES], dtype=np.int64)[levels]
    wanted = np.isin(levels, [SEVERITIES.index(s) for s in severities])
    order = np.flatnonzero(wanted)[np.argsort(rank[wanted], kind="stable")]
    ids: dict[str, int] = {}
    name_ids = np.fromiter(
        (ids.setdefault(names[i], len(ids)) for i in order.tolist()), np.int64, len(order)
    )
    keys = (name_ids * len(KINDS) + kinds[order]) * len(SEVERITIES) + levels[order]
    _, first, group = np.unique(keys, return_index=True, return_inverse=True)
    shown = np.argsort(first, kind="stable")[:limit]  # groups by their first finding
    members = np.flatnonzero(np.isin(group, shown))  # positions in ``order``
    at = np.sort(order[members])
    built = dict(zip(at.tolist(), _findings_at(comparison, at), strict=True))
    by_group: dict[int, list[Finding]] = {int(g): [] for g in shown.tolist()}
    for position in members.tolist():
        by_group[int(group[position])].append(built[int(order[position])])
    merged = [
        (found[0], " and ".join(side_name(comparison, f.source) for f in found))
        for found in by_group.values()
    ]
    return merged, len(first)


#: Failing first, then warnings, then ignored.
_RANK = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.IGNORED: 2}


def _findings_at(comparison: Comparison, indices: np.ndarray) -> list[Finding]:
    """The per-tensor findings at ``indices``, in ascending index order."""
    findings = comparison.tensor_findings
    columns = finding_columns(comparison.report)
    if columns is None:
        return [findings[i] for i in np.sort(indices).tolist()]
    mask = np.zeros(len(columns), dtype=bool)
    mask[indices] = True
    return list(columns.select(mask))


# The per-tensor findings are counted by the report's summary (on the columns: a
# million findings build no object), the comparison's own ones here.


def failing_count(comparison: Comparison) -> int:
    """Failing findings of every level: per tensor, exceeded limits, the comparison's own."""
    # The summary's failing findings hold the exceeded limits.
    return comparison.report.summary.failing_findings + sum(
        1 for f in comparison.findings if f.failing
    )


def warning_count(comparison: Comparison) -> int:
    return comparison.report.summary.warnings + sum(1 for f in comparison.findings if not f.failing)


def ignored_count(comparison: Comparison) -> int:
    return comparison.report.summary.ignored_findings


def failing_kinds(comparison: Comparison) -> list[str]:
    """The kinds of every failing finding (tensor, limit and comparison level), sorted."""
    kinds = set(report_failing_kinds(comparison.report))
    kinds |= {f.kind.value for f in comparison.findings if f.failing}
    return sorted(kinds)


def verdict_line(comparison: Comparison) -> str:
    """``OK: …`` / ``FAIL: …`` / ``INCOMPLETE: …``, matching :func:`comparison_exit_code`."""
    code = comparison_exit_code(comparison)
    if code in (ExitCode.INPUT_ERROR, ExitCode.INTERNAL_ERROR):
        what = plural(len(comparison.errors), "input problem")
        return f"INCOMPLETE: {what}{internal_note(comparison.errors)}; nothing is compared"
    if code is ExitCode.FINDINGS:
        failing = plural(failing_count(comparison), "failing finding")
        return f"FAIL: {failing} ({', '.join(failing_kinds(comparison))})"
    notes = []
    if warnings := warning_count(comparison):
        notes.append(plural(warnings, "warning"))
    if ignored := ignored_count(comparison):
        notes.append(f"{ignored:,} ignored")
    note = f" ({', '.join(notes)})" if notes else ""
    return f"OK: no failing findings{note}"


def compared_line(comparison: Comparison) -> str:
    """``Compared 35 host and 4 seed tensors, skipped 0`` (``35 tensors in A and 35 in B``)."""
    dual = comparison.dual
    if ab_mode(comparison):
        return (
            f"Compared {plural(dual.host.tensors, 'tensor')} in A and "
            f"{count(dual.seed.tensors)} in B, skipped {comparison.report.summary.skipped}"
        )
    return (
        f"Compared {count(dual.host.tensors)} host and {count(dual.seed.tensors)} seed "
        f"tensors, skipped {comparison.report.summary.skipped}"
    )


def side_of(comparison: Comparison, label: str | None) -> SideStats | None:
    """The side a per-tensor result's ``source`` (``"host"``/``"seed"``) names."""
    dual = comparison.dual
    return next((side for side in (dual.host, dual.seed) if side.label == label), None)
