"""The sentences every human-readable format shares, so they never disagree.

The table, Markdown and GitHub formats all say what was audited and what the
verdict is; they say it with these functions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterable, Iterator

import numpy as np

from gradaudit.errors import ExitCode
from gradaudit.io.discover import COMPANION_REASON
from gradaudit.policy import FindingKind, Role, Severity
from gradaudit.report.text import count, internal_note, number, plural, printable
from gradaudit.results import (
    HISTORY_KEYS,
    HISTORY_NAME,
    FileResult,
    Finding,
    LoggedHistory,
    Report,
    Skipped,
    TensorStats,
)
from gradaudit.results.stats_table import StatsTable
from gradaudit.results.verdict import exit_code
from gradaudit.scan.finding_table import KINDS, SEVERITIES, FindingTable
from gradaudit.scan.rules import tensor_indices

#: Short role names for table cells.
ROLE_LABELS: dict[Role, str] = {
    Role.GRADIENT: "grad",
    Role.WEIGHT: "weight",
    Role.OPTIMIZER_MOMENT: "opt m",
    Role.OPTIMIZER_SECOND_MOMENT: "opt v",
    Role.BUFFER: "buffer",
    Role.UNKNOWN: "?",
}

TensorKey = tuple[str | None, str]

#: Tensors skipped for one reason that share a line in the human formats.
GROUP_SKIPPED = 4


def finding_columns(report: Report) -> FindingTable | None:
    """The report's findings when they are columns over its tensors, else ``None``."""
    findings = report.findings
    if isinstance(findings, FindingTable) and findings.table is report.tensors:
        return findings
    return None


def findings_by_tensor(
    report: Report,
    kinds: Collection[FindingKind] | None = None,
    only: Collection[TensorKey] | None = None,
) -> dict[TensorKey, list[Finding]]:
    """Findings grouped by ``(file, tensor name)``, in report order.

    ``kinds`` and ``only`` (tensor keys) keep some: with a million findings as
    columns, only those are built.
    """
    columns = finding_columns(report)
    found: Iterable[Finding] = report.findings
    if columns is not None and (kinds is not None or only is not None):
        mask = np.ones(len(columns), dtype=bool) if kinds is None else columns.kind_is(*kinds)
        if only is not None:
            mask &= np.isin(columns.rows, tensor_indices(columns.table, only)) | (columns.rows < 0)
        found = columns.select(mask)
    by_tensor: dict[TensorKey, list[Finding]] = {}
    for finding in found:
        key = (finding.source, finding.tensor)
        if (kinds is None or finding.kind in kinds) and (only is None or key in only):
            by_tensor.setdefault(key, []).append(finding)
    return by_tensor


def tensor_findings(report: Report) -> Iterator[tuple[TensorStats, list[Finding]]]:
    """Each audited tensor with its findings (a list, maybe empty), in the tensors' order.

    Findings as columns in tensor order are walked alongside the tensors, a step
    at a time; otherwise they are grouped by ``(file, tensor name)`` first.
    """
    columns = finding_columns(report)
    if columns is not None and columns.ordered:
        yield from columns.per_tensor(report.tensors)
        return
    by_tensor = findings_by_tensor(report)
    for stats in report.tensors:
        yield stats, by_tensor.get((stats.source, stats.name), [])


def tensor_severities(report: Report) -> Iterator[tuple[TensorStats, frozenset[Severity]]]:
    """Each audited tensor with the severities of its findings (empty: none).

    What the table sorts its rows by; read on the columns, no Finding is built.
    """
    columns = finding_columns(report)
    if columns is None:
        for stats, found in tensor_findings(report):
            yield stats, frozenset(f.severity for f in found)
        return

    sets = [
        frozenset(s for code, s in enumerate(SEVERITIES) if bits >> code & 1)
        for bits in range(1 << len(SEVERITIES))
    ]
    bits = columns.severity_bits().tolist()
    yield from zip(report.tensors, map(sets.__getitem__, bits), strict=True)


def file_findings(report: Report, source: str | None) -> tuple[list[str], int]:
    """The failing kinds (sorted) of the findings in file ``source``, and how many others."""
    columns = finding_columns(report)
    if columns is None:
        found = [f for f in report.findings if f.source == source]
        failing = sorted({f.kind.value for f in found if f.failing})
        return failing, sum(1 for f in found if not f.failing)

    mask = columns.source_is(source)
    errors = columns.severity_is(Severity.ERROR)
    kinds = np.unique(columns.kinds[mask & errors]).tolist()
    return sorted({KINDS[k].value for k in kinds}), int((mask & ~errors).sum())


def flagged_tensors(
    report: Report, limit: int | None = None
) -> tuple[list[tuple[TensorStats, list[Finding]]], int]:
    """Tensors with a failing or warning finding, each with those findings (ignored ones
    left out): failing first, then warnings, in file order; the first ``limit`` of them
    (all for ``None``), and how many there are in all.

    With the findings as columns, the flagged tensors are picked on the columns and
    only the ``limit`` shown are built: a million flagged tensors (an all-zero dump)
    cost no object each.
    """
    columns = finding_columns(report)
    if columns is None:
        failing, warning = [], []
        for stats, all_found in tensor_findings(report):
            found = [f for f in all_found if not f.ignored]
            if any(f.failing for f in found):
                failing.append((stats, found))
            elif found:
                warning.append((stats, found))
        flagged = failing + warning
        return flagged[:limit], len(flagged)

    bits = columns.severity_bits()
    error = 1 << SEVERITIES.index(Severity.ERROR)
    warn = 1 << SEVERITIES.index(Severity.WARNING)
    failing = (bits & error) != 0
    order = np.concatenate(
        [np.flatnonzero(failing), np.flatnonzero(((bits & warn) != 0) & ~failing)]
    )
    chosen = order[:limit]
    wanted = np.isin(columns.rows, chosen) & ~columns.severity_is(Severity.IGNORED)
    by_row: dict[int, list[Finding]] = {}
    for row, finding in zip(columns.rows[wanted].tolist(), columns.select(wanted), strict=True):
        by_row.setdefault(row, []).append(finding)
    tensors = report.tensors
    return [(tensors[row], by_row[row]) for row in chosen.tolist()], len(order)


def some_findings(
    report: Report,
    severities: Collection[Severity],
    *,
    kind: FindingKind | None = None,
    in_file: bool = False,
    source: str | None = None,
    limit: int | None = None,
) -> tuple[list[Finding], int]:
    """The findings of these severities (of ``kind``; in file ``source`` when ``in_file``),
    in report order: the first ``limit`` of them (all for ``None``), and how many there are.

    What the per-finding formats list (GitHub annotations, JUnit cases): with a million
    findings as columns, only the ``limit`` listed are built.
    """
    columns = finding_columns(report)
    if columns is None:
        found = [
            f
            for f in report.findings
            if f.severity in severities
            and (kind is None or f.kind is kind)
            and (not in_file or f.source == source)
        ]
        return found[:limit], len(found)

    mask = np.zeros(len(columns), dtype=bool)
    for severity in severities:
        mask |= columns.severity_is(severity)
    if kind is not None:
        mask &= columns.kind_is(kind)
    if in_file:
        mask &= columns.source_is(source)
    positions = np.flatnonzero(mask)
    if limit is not None and len(positions) > limit:
        mask = np.zeros(len(columns), dtype=bool)
        mask[positions[:limit]] = True
    return list(columns.select(mask)), len(positions)


def kinds_in_file(report: Report, source: str | None) -> list[FindingKind]:
    """The kinds of the findings in file ``source``, in order of first appearance."""
    columns = finding_columns(report)
    if columns is None:
        return list(dict.fromkeys(f.kind for f in report.findings if f.source == source))

    codes = columns.kinds[columns.source_is(source)]
    unique, first = np.unique(codes, return_index=True)
    return [KINDS[int(code)] for code in unique[np.argsort(first)].tolist()]


def several_files(report: Report) -> bool:
    """Whether the audited tensors come from more than one file (a file column is shown)."""
    tensors = report.tensors
    if isinstance(tensors, StatsTable):  # a million tensors: read on the columns
        return len(set(tensors.source_codes.tolist())) > 1
    return len({t.source for t in tensors}) > 1


def unaudited(report: Report) -> list[Finding]:
    """The ``skipped`` findings that are not ignored: data the audit could not read."""
    columns = finding_columns(report)
    if columns is not None:
        mask = columns.kind_is(FindingKind.SKIPPED) & ~columns.severity_is(Severity.IGNORED)
        return list(columns.select(mask))
    return [f for f in report.findings if f.kind is FindingKind.SKIPPED and not f.ignored]


def history_lines(report: Report) -> list[tuple[str, Severity | None]]:
    """Each judged training log (``trainer_state.json``): what was logged, then its findings.

    ``(line, severity)``; the severity is ``None`` for the line that says what was read.
    Every human format shows these: a diverged run's verdict rests on them.
    """
    lines: list[tuple[str, Severity | None]] = []
    for history in report.histories:
        lines.append((f"Logged history of {printable(history.file)}: {history.note}", None))
        lines += [
            (f"{f.kind.value} {f.tensor}: {printable(f.message)}", f.severity)
            for f in history_findings(report, history)
        ]
    return lines


def history_findings(report: Report, history: LoggedHistory) -> list[Finding]:
    """The findings on one judged log (``log_history.loss``, then ``.grad_norm``)."""
    keys = {(history.file, f"{HISTORY_NAME}.{key}") for key in HISTORY_KEYS}
    found = findings_by_tensor(report, only=keys)
    return [f for key in sorted(found) for f in found[key]]


def failing_kinds(report: Report) -> list[str]:
    """The kinds that fail the run, sorted: tensor finding kinds and exceeded limits."""
    columns = finding_columns(report)
    if columns is not None:
        errors = np.unique(columns.kinds[columns.severity_is(Severity.ERROR)]).tolist()
        kinds = {KINDS[k].value for k in errors}
    else:
        kinds = {f.kind.value for f in report.findings if f.failing}
    kinds.update(f.kind.value for f in report.limit_findings)
    return sorted(kinds)


def any_finite(report: Report) -> bool:
    """Whether any audited element is finite (the global norm is over finite elements)."""
    tensors = report.tensors
    if isinstance(tensors, StatsTable):  # a million tensors: read on the columns
        return bool((tensors.finite > 0).any())
    return any(t.finite for t in tensors)


def audited_line(report: Report) -> str:
    """``Audited 35 tensors (21,248 elements) in 1 file, skipped 1 · global norm 2.8e+05``."""
    s = report.summary
    files = len(report.files)
    where = f" in {plural(files, 'file')}" if files else ""
    excluded = f", excluded {count(s.excluded)} by --include/--exclude" if s.excluded else ""
    # No tensor, no norm: "global norm 0" would claim gradients that were all zero; with
    # no finite element at all (every tensor NaN/Inf) the norm is nan, not 0.
    norm = ""
    if s.tensors:
        norm = f" · global norm {number(s.global_norm if any_finite(report) else math.nan)}"
    return (
        f"Audited {plural(s.tensors, 'tensor')} ({count(s.elements)} elements){where}, "
        f"skipped {s.skipped}{excluded}{norm}"
    )


def nothing_to_audit(report: Report) -> str:
    """Why a run audited no tensor, for the summary and the CLI's stderr line."""
    if report.summary.excluded:
        return (
            "nothing to audit: --include/--exclude left no floating-point tensor "
            f"({count(report.summary.excluded)} excluded)"
        )
    return "nothing to audit: no floating-point tensor found"


def skipped_lines(report: Report, limit: int = 10) -> list[tuple[str, bool]]:
    """``(line, unaudited)`` per skipped tensor or file (at most ``limit``), like ones grouped.

    Unread floating-point data comes first (it is a finding of kind ``skipped``).
    Tensors skipped for the same reason share one line once there are
    :data:`GROUP_SKIPPED` of them: a training checkpoint holds one optimizer step
    counter per parameter, and a line for each buries what matters. The
    ``config.json``, ``tokenizer.json`` … of a Hugging Face model directory are
    counted in one line too.
    """
    companions = [s for s in report.skipped if s.reason == COMPANION_REASON]
    by_reason: dict[tuple[bool, str], list[Skipped]] = {}
    for skipped in sorted(report.skipped, key=lambda s: not s.unaudited):
        if skipped.reason != COMPANION_REASON:
            by_reason.setdefault((skipped.unaudited, skipped.reason), []).append(skipped)
    several = len(report.files) > 1
    lines: list[tuple[str, bool]] = []
    for (unaudited, reason), group in by_reason.items():
        if len(group) >= GROUP_SKIPPED:
            first = printable(group[0].name)
            shown = printable(reason)
            lines.append((f"skipped {len(group)} tensors ({first}, …): {shown}", unaudited))
            continue
        for skipped in group:
            where = ""
            if several and skipped.source and not skipped.name.startswith(skipped.source):
                where = f" in {printable(skipped.source)}"
            lines.append(
                (f"skipped {printable(skipped.name)}{where}: {printable(reason)}", unaudited)
            )
    if len(lines) > limit:
        hidden = len(lines) - limit
        lines = [*lines[:limit], (f"… and {hidden} more skipped lines", False)]
    if companions:
        names = sorted({os.path.basename(s.name) for s in companions})
        shown = ", ".join(printable(n) for n in names[:4]) + (", …" if len(names) > 4 else "")
        lines.append(
            (
                f"skipped {plural(len(companions), 'model companion file')} ({shown}): not weights",
                False,
            )
        )
    return lines


def flagged_line(report: Report) -> str:
    """Counts of flagged tensors per kind, the ignored findings, and the thresholds."""
    s = report.summary
    t = report.thresholds
    ignored = f" · ignored findings {s.ignored_findings}" if s.ignored_findings else ""
    outliers = f" · outlier {s.outlier_tensors}" if s.outlier_tensors else ""
    return (
        f"Flagged tensors: NaN {s.nan_tensors} · Inf {s.inf_tensors} · "
        f"exploding {s.exploding_tensors} · vanishing {s.vanishing_tensors}{outliers}{ignored}"
        f" · health {s.gradient_health:.3f}"
        f"   (thresholds: vanishing < {number(t.vanishing)}, exploding > {number(t.exploding)})"
    )


def thin_readings(report: Report) -> dict[str, str]:
    """Per input read on thin evidence, the line that says how and how to say otherwise.

    Every format carries it (issue 26): CI that shows a bare "exploding" error on a file
    of published weights read as gradients gives no way to see why, or what to pass.
    """
    return {
        result.path: _reading_line(result)
        for result in report.files
        if result.tensors and result.evidence_thin
    }


def _reading_line(result: FileResult) -> str:
    """``Read PATH as weights (thin evidence): why``."""
    thin = " (thin evidence)" if result.evidence_thin else ""
    return (
        f"Read {printable(result.path)} as {result.read_as}{thin}: "
        f"{printable(result.read_as_evidence)}"
    )


def reading_lines(report: Report) -> list[str]:
    """What each file was read as and why, when that is not plainly a gradient dump.

    A file read as gradients on firm evidence (gradaudit's own dump metadata, or
    ``--kind gradients``) needs no line; any other reading, and every thin one, gets one,
    so a user sees how the verdict was reached and how to change it. The outlier
    references follow: the median RMS each role was compared against.
    """
    lines = []
    for result in report.files:
        if not result.tensors:
            continue
        plain = result.read_as == "gradients" and not result.evidence_thin
        if plain:
            continue
        lines.append(_reading_line(result))
    several = len(report.files) > 1
    for ref in report.outlier_references:
        where = f" in {printable(ref.source)}" if several and ref.source else ""
        lines.append(
            f"Outlier reference{where}: {ref.role.value}"
            f"{'' if ref.shapes == 'all' else f' {ref.shapes}'} median RMS {10**ref.median:.3g}, "
            f"spread {ref.spread:.2f} decades, limit {ref.limit:.1f} decades "
            f"({ref.tensors} tensors)"
        )
    return lines


def verdict_line(report: Report) -> str:
    """``OK: …`` / ``FAIL: …`` / ``INCOMPLETE: …``, matching :func:`exit_code`."""
    s = report.summary
    code = exit_code(report)
    if code in (ExitCode.INPUT_ERROR, ExitCode.INTERNAL_ERROR):
        what = (
            plural(len(report.errors), "input") + " could not be audited"
            if report.errors
            else nothing_to_audit(report)
        )
        return f"INCOMPLETE: {what}{internal_note(report.errors)}"
    if code is ExitCode.FINDINGS:
        return (
            f"FAIL: {plural(s.failing_findings, 'failing finding')} "
            f"({', '.join(failing_kinds(report))})"
        )
    notes = []
    if s.warnings:
        notes.append(plural(s.warnings, "warning"))
    unread = unaudited(report)
    if unread:
        notes.append(f"{plural(len(unread), 'tensor')} not audited")
    if s.ignored_findings:
        notes.append(f"{s.ignored_findings:,} ignored")
    note = f" ({', '.join(notes)})" if notes else ""
    return f"OK: no failing findings{note}"
