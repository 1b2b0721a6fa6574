"""Sentences, counts and orderings shared by the comparison renderers, so they never disagree.

The comparison counterpart of ``verdict.py``: the table, Markdown, GitHub and
JUnit formats say what was compared, what the ratio means and what the verdict
is with these functions, and JSON writes the same numbers.
"""

from __future__ import annotations

import math

from gradaudit.compare_checks import comparison_exit_code
from gradaudit.comparison import (
    CompareFindingKind,
    Comparison,
    DualGradientStats,
    Mismatch,
    ParameterChange,
    SideStats,
)
from gradaudit.errors import ExitCode
from gradaudit.policy import Severity
from gradaudit.report.text import count, number, plural, printable
from gradaudit.results import Finding

#: How the normalized ratio is defined, written into the JSON next to it.
FORMULA = "(seed_norm / host_norm) * sqrt(host_params / seed_params)"
#: The same, short enough for the table's ratio line.
SHORT_FORMULA = "raw × √(host_params / seed_params)"


def interpretation(dual: DualGradientStats) -> str:
    """One plain sentence on what the normalized ratio says."""
    ratio = dual.normalized_ratio
    if ratio is None:
        return f"ratio not computed: {dual.ratio_note}"
    if math.isinf(ratio):
        return "host gradients are zero: the seed's are infinitely more intense per parameter"
    if ratio == 0.0:
        return "seed gradients are zero: the seed receives no gradient"
    text = f"seed gradients are {ratio:.3g}× as intense per parameter as the host's"
    if ratio < 1.0:
        text += f" ({1.0 / ratio:.3g}× weaker)"
    return text


def ratio_sentence(dual: DualGradientStats) -> str:
    """``normalized ratio 1.76: seed gradients are …`` or ``normalized ratio not computed: …``."""
    if dual.normalized_ratio is None:
        return f"normalized ratio not computed: {dual.ratio_note}"
    return f"normalized ratio {number(dual.normalized_ratio)}: {interpretation(dual)}"


def ratio_line(dual: DualGradientStats) -> str:
    """``raw ratio seed/host 0.206 · normalized ratio 1.76``."""
    return (
        f"raw ratio seed/host {number(dual.raw_ratio)} · "
        f"normalized ratio {number(dual.normalized_ratio)}"
    )


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


def finding_subjects(comparison: Comparison, kind: CompareFindingKind) -> list[str]:
    """The shared tensors a per-parameter finding is about, one phrase each (names printable).

    ``mlp.weight: B/A 4.5 (+350%)`` for a large change, ``pooler.weight: shape
    2×3 vs 3×2 (not compared)`` for a mismatch; nothing for other kinds.
    """
    parameters = comparison.parameters
    if parameters is None:
        return []
    if kind is CompareFindingKind.LARGE_CHANGE:
        return [
            f"{printable(c.name)}: B/A {number(c.ratio)} ({change_text(c)})"
            for c in sorted(parameters.flagged, key=change_order)
        ]
    if kind is CompareFindingKind.MISMATCH:
        return [
            f"{printable(m.name)}: {'; '.join(mismatch_parts(m))}" for m in parameters.mismatches
        ]
    return []


def change_order(change: ParameterChange) -> tuple[int, float]:
    """Flagged first, then not comparable, then the rest; each by how far B/A is from 1."""
    if change.ratio is None:
        return (1, 0.0)
    distance = math.inf if change.ratio in (0.0, math.inf) else abs(math.log(change.ratio))
    return (0 if change.flagged else 2, -distance)


def change_text(change: ParameterChange) -> str:
    """The relative change ``B/A − 1`` as a percentage: ``+39.6%``, ``-98%``, ``+inf``."""
    relative = change.relative_change
    if relative is None:
        return "-"
    if math.isinf(relative):
        return "+inf"
    percent = 100.0 * relative
    return f"{percent:+,.0f}%" if abs(percent) >= 1000 else f"{percent:+.3g}%"


def notable(change: ParameterChange) -> bool:
    """A shared tensor worth showing on its own: flagged, or its ratio could not be computed."""
    return change.flagged or change.note is not None


def tensor_findings_by_severity(comparison: Comparison) -> list[Finding]:
    """Per-tensor findings, failing first, then warnings, then ignored; stable within each."""
    rank = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.IGNORED: 2}
    return sorted(comparison.tensor_findings, key=lambda f: rank[f.severity])


def failing_count(comparison: Comparison) -> int:
    """Failing findings of every level: per tensor, exceeded limits, the comparison's own."""
    return (
        sum(1 for f in comparison.tensor_findings if f.failing)
        + len(comparison.report.limit_findings)
        + sum(1 for f in comparison.findings if f.failing)
    )


def warning_count(comparison: Comparison) -> int:
    return sum(1 for f in comparison.tensor_findings if f.severity is Severity.WARNING) + sum(
        1 for f in comparison.findings if not f.failing
    )


def ignored_count(comparison: Comparison) -> int:
    return sum(1 for f in comparison.tensor_findings if f.ignored)


def failing_kinds(comparison: Comparison) -> list[str]:
    """The kinds of every failing finding (tensor, limit and comparison level), sorted."""
    kinds = {f.kind.value for f in comparison.tensor_findings if f.failing}
    kinds |= {f.kind.value for f in comparison.report.limit_findings}
    kinds |= {f.kind.value for f in comparison.findings if f.failing}
    return sorted(kinds)


def verdict_line(comparison: Comparison) -> str:
    """``OK: …`` / ``FAIL: …`` / ``INCOMPLETE: …``, matching :func:`comparison_exit_code`."""
    code = comparison_exit_code(comparison)
    if code is ExitCode.INPUT_ERROR:
        what = plural(len(comparison.errors), "input problem")
        return f"INCOMPLETE: {what}; nothing is compared"
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
    """``Compared 35 host and 4 seed tensors, skipped 0``."""
    dual = comparison.dual
    return (
        f"Compared {count(dual.host.tensors)} host and {count(dual.seed.tensors)} seed "
        f"tensors, skipped {comparison.report.summary.skipped}"
    )


def side_of(comparison: Comparison, label: str | None) -> SideStats | None:
    """The side a per-tensor result's ``source`` (``"host"``/``"seed"``) names."""
    dual = comparison.dual
    return next((side for side in (dual.host, dual.seed) if side.label == label), None)
