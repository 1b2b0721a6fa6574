"""Host side, no torch: stats + policy -> roles, findings and the summary.

What :meth:`~gradaudit.scan.pending.PendingStats.materialize` does after the one
host read starts here: each tensor's role (:func:`with_roles`), the findings of
every tensor (:func:`evaluate_all`, by the rule in :mod:`gradaudit.scan.rules`),
of optimizer state, skipped tensors and limits, their order, the health score and
the summary. Outliers and the gradient estimates are :mod:`gradaudit.scan.outliers`
and :mod:`gradaudit.scan.estimates`; the exit code is :mod:`gradaudit.results.verdict`.
No files, no terminal: plain numbers and a policy in, results out.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gradaudit.policy import (
    FindingKind,
    InputKind,
    LimitKind,
    Role,
    Severity,
    Thresholds,
    fraction_exceeds,
)
from gradaudit.precision.formats import Precision
from gradaudit.precision.judging import DEFAULT_MAX_UNDERFLOW, as_findings, precision_report
from gradaudit.results import (
    FileResult,
    Finding,
    GradientEstimate,
    LimitFinding,
    Report,
    Skipped,
    Summary,
    TensorStats,
)
from gradaudit.results.roles import FileEvidence, TensorHint
from gradaudit.results.stats_table import ROLES, StatsTable, coded
from gradaudit.roles import (
    decide,
    describe_file,
    file_evidence_text,
    file_name_evidence,
    name_templates,
    name_word_mask,
    stats_evidence,
)
from gradaudit.scan.finding_table import SEVERITIES, FindingTable, column_findings, flagged_indices
from gradaudit.scan.rules import OPTIMIZER_STATE, table_of, tensor_indices


def evaluate_all(tensors: Iterable[TensorStats], thresholds: Thresholds) -> FindingTable:
    """:func:`evaluate` for every tensor, in tensor order, as a
    :class:`~gradaudit.scan.finding_table.FindingTable`.

    Which tensors have findings, and of which kinds, is decided on the columns at
    once (the same comparisons as :func:`evaluate`); each finding is built by
    :func:`evaluate` when it is asked for: a million flagged tiny tensors hold no
    object each.
    """
    return FindingTable.judge(table_of(tensors), thresholds)


def evaluate_optimizer_state(
    estimates: Sequence[GradientEstimate],
    negatives: Sequence[tuple[TensorStats, float]],
    thresholds: Thresholds,
) -> tuple[Finding, ...]:
    """Findings read from optimizer state: negative second moments, and gradient health.

    A second moment is a running sum or average of squares, so a negative value is
    corruption. A gradient's RMS norm estimated from a second moment is judged by the
    same vanishing/exploding thresholds as a gradient in a dump; the finding sits on
    the state tensor (whose name carries the parameter's) and its message names the
    parameter.
    """
    out: list[Finding] = []
    for stats, lowest in negatives:
        message = f"negative values (down to {lowest:.3g}) in a second moment (of squares)"
        kind = FindingKind.NEGATIVE
        out.append(
            Finding(kind, thresholds.severity(kind, stats.name), stats.name, message, stats.source)
        )
    for estimate in estimates:
        value = estimate.rms_norm
        if value is None or not math.isfinite(value):
            continue
        what = f"{estimate.parameter}: estimated gradient RMS norm {value:.3g} ({estimate.basis})"
        if value > thresholds.exploding:
            kind, message = FindingKind.EXPLODING, f"{what} > {thresholds.exploding:.3g}"
        elif value < thresholds.vanishing:
            kind, message = FindingKind.VANISHING, f"{what} < {thresholds.vanishing:.3g}"
        else:
            continue
        out.append(
            Finding(
                kind,
                thresholds.severity(kind, estimate.tensor),
                estimate.tensor,
                message,
                estimate.source,
            )
        )
    return tuple(out)


def gradient_health(tensors: Sequence[TensorStats], findings: Sequence[Finding]) -> float:
    """One number in [0, 1] for dashboards and gates: 1 is a clean audit.

    ``health = clean / N * finite / N * (1/2 if any element is NaN or Inf else 1)``,
    where ``N`` is the number of audited elements, ``clean`` the elements in tensors
    without a failing or warning finding (ignored findings do not count against it)
    and ``finite`` the finite elements. A single NaN halves the score however small
    its tensor, so a non-finite value is never lost in the rounding of a large model.
    Nothing audited scores 0: no evidence of health.
    """
    table = table_of(tensors)
    total = int(table.numel.sum())
    if total == 0:
        return 0.0
    flagged = flagged_indices(table, findings, ignored=False)
    clean = total - int(table.numel[flagged].sum())
    return _health(total, clean, int(table.nonfinite.sum()))


def _health(total: int, clean: int, nonfinite: int) -> float:
    """The score of :func:`gradient_health` from its counts (0 for nothing audited)."""
    if total == 0:
        return 0.0
    score = (clean / total) * ((total - nonfinite) / total) * (0.5 if nonfinite else 1.0)
    return min(1.0, max(0.0, score))


def evaluate_skipped(skipped: Iterable[Skipped], thresholds: Thresholds) -> tuple[Finding, ...]:
    """A ``skipped`` finding for each tensor whose values could hide a NaN but were not read.

    A warning by default and an error with ``--fail-on skipped``: either way an
    audit that could not see everything does not say a plain "OK".
    """
    kind = FindingKind.SKIPPED
    return tuple(
        Finding(
            kind,
            thresholds.severity(kind, s.name),
            s.name,
            s.reason,  # every such reason says "not audited"
            s.source,
        )
        for s in skipped
        if s.unaudited
    )


def evaluate_limits(
    tensors: Sequence[TensorStats],
    findings: Sequence[Finding],
    files: Sequence[FileResult],
    global_norm: float,
    thresholds: Thresholds,
) -> tuple[LimitFinding, ...]:
    """The run-level limits that were exceeded, per input file.

    A limit is judged per file because a file is one gradient dump (one step);
    tensors audited from memory (no file results) are judged as one whole.
    The global norm covers every tensor, ignored ones included: ``--ignore``
    silences findings on tensors, it does not edit the gradient. The vanishing
    fraction is over the tensors that are not ignored.
    """
    if thresholds.max_global_norm is None and thresholds.max_vanishing_fraction is None:
        return ()
    groups: list[tuple[str | None, float | None]] = (
        [(f.path, f.global_norm) for f in files if f.tensors]
        if files
        else ([(None, global_norm)] if tensors else [])
    )
    table = table_of(tensors)
    vanishing = flagged_indices(table, findings, (FindingKind.VANISHING,), ignored=False)
    dead_indices = set(vanishing.tolist())
    out: list[LimitFinding] = []
    for source, norm in groups:
        where = "" if source is None else f" in {source}"
        limit = thresholds.max_global_norm
        if limit is not None and norm is not None and not norm <= limit:
            out.append(
                LimitFinding(
                    LimitKind.GLOBAL_NORM,
                    norm,
                    limit,
                    f"global norm {norm:.3g}{where} > max-global-norm {limit:.3g}",
                    source,
                )
            )
        fraction = thresholds.max_vanishing_fraction
        if fraction is not None:
            judged: Sequence[int] = (
                table.source_indices(source).tolist() if files else range(len(table))
            )
            if thresholds.ignore:
                names = table.names
                judged = [i for i in judged if thresholds.ignored_by(names[i]) is None]
            dead = len(dead_indices.intersection(judged))
            count = len(judged)
            if fraction_exceeds(dead, count, fraction):
                out.append(
                    LimitFinding(
                        LimitKind.VANISHING_FRACTION,
                        dead / count,
                        fraction,
                        f"{dead} of {count} tensors vanish{where} "
                        f"({dead / count:.1%} > max-vanishing-fraction {fraction:g})",
                        source,
                    )
                )
    return tuple(out)


@dataclass(frozen=True)
class RoleDecision:
    """Every tensor's role and evidence as :func:`decide_roles` decided them, kept apart
    from the table so that a training loop's next report of the same tensors can take
    them again (:mod:`gradaudit.scan.layout`)."""

    #: Codes into :data:`~gradaudit.results.stats_table.ROLES` and :attr:`evidences`.
    role_codes: np.ndarray
    evidence_codes: np.ndarray
    evidences: tuple[str, ...]
    evidence_thin: tuple[bool, ...]
    #: Per source, ``(read as, evidence, thin)`` for the file's summary.
    readings: dict[str | None, tuple[str, str, bool]]
    #: Whether a file's role was guessed from the values (:func:`~gradaudit.roles.stats_evidence`):
    #: then the decision holds for these values only.
    from_values: bool

    def apply(self, table: StatsTable) -> dict[str | None, tuple[str, str, bool]]:
        """Set the roles on ``table``'s columns; the readings per source."""
        table.with_roles(self.role_codes, self.evidence_codes, self.evidences, self.evidence_thin)
        return self.readings


def with_roles(
    table: StatsTable,
    hints: Sequence[TensorHint | None],
    thresholds: Thresholds,
    file_evidence: Mapping[str, FileEvidence],
) -> dict[str | None, tuple[str, str, bool]]:
    """Each tensor's role decided (:func:`decide_roles`), set on ``table``'s columns.

    Returns, per source, ``(read as, evidence, thin)`` for the file's summary.
    """
    return decide_roles(table, hints, thresholds, file_evidence).apply(table)


def decide_roles(
    table: StatsTable,
    hints: Sequence[TensorHint | None],
    thresholds: Thresholds,
    file_evidence: Mapping[str, FileEvidence],
) -> RoleDecision:
    """Each tensor's role decided (:func:`gradaudit.roles.decide`), for ``table``'s columns.

    ``file_evidence`` is what each file's metadata says it holds (see
    :meth:`~gradaudit.scan.pending.PendingStats.read_hints`).

    The readings per source are ``(read as, evidence, thin)`` for the file's summary. Only
    tensors with a hint are decided one by one, and those with a name
    :func:`role_from_name` may read once per name template
    (:func:`~gradaudit.roles.name_templates`); every other tensor of a file takes the
    file's role (or ``--kind``), which is what :func:`decide` gives it, so a million
    plainly named tensors cost a few string searches
    (:func:`~gradaudit.roles.name_word_mask`).
    """
    kind = thresholds.kind
    names = table.names
    count = len(names)
    special = name_word_mask(names)
    hinted = np.zeros(count, dtype=bool)
    if hints.count(None) != len(hints):  # C speed: most collections hold no hint
        hinted = np.fromiter((hint is not None for hint in hints), dtype=bool, count=count)
    role_codes = np.zeros(count, dtype=np.int8)
    evidence_codes = np.zeros(count, dtype=np.int32)
    evidences: dict[str, int] = {"": 0}

    def code_of(evidence: str) -> int:
        return evidences.setdefault(evidence, len(evidences))

    optimizer = [ROLES.index(role) for role in OPTIMIZER_STATE]
    readings: dict[str | None, tuple[str, str, bool]] = {}
    from_values = False
    thin_evidences: list[FileEvidence] = []  # a default or guess is thin wherever it decided
    for source_code, source in enumerate(table.sources):
        indices = np.flatnonzero(table.source_codes == source_code)
        if not len(indices):
            continue
        if source is None:
            file_role = FileEvidence(Role.GRADIENT, "tensors from memory: gradients")
        else:
            given = file_evidence.get(source) or file_name_evidence(source)
            from_values = from_values or given is None
            file_role = given or stats_evidence(table, None if len(indices) == count else indices)
            thin_evidences.append(file_role)
        if kind is InputKind.GRADIENTS:
            default = Role.GRADIENT, "--kind gradients"
        elif kind is InputKind.WEIGHTS:
            default = Role.WEIGHT, "--kind weights"
        else:
            default = file_role.role, file_role.evidence
        role_codes[indices] = ROLES.index(default[0])
        evidence_codes[indices] = code_of(default[1])
        # Plainly named tensors keep the default; those a name may decide are decided
        # once per name template (``params.0.grad``), hinted ones one by one.
        by_name = indices[special[indices] & ~hinted[indices]]
        if len(by_name):
            # (All of them: the indices are sorted, so they are 0 … count - 1.)
            read = names if len(by_name) == count else [names[i] for i in by_name.tolist()]
            keys, which = coded(name_templates(read), np.int64)
            decided = [decide(template, None, kind, file_role) for template in keys]
            role_codes[by_name] = np.array([ROLES.index(role) for role, _ in decided], np.int8)[
                which
            ]
            evidence_codes[by_name] = np.array([code_of(e) for _, e in decided], np.int32)[which]
        for index in indices[hinted[indices]].tolist():
            role, evidence = decide(names[index], hints[index], kind, file_role)
            role_codes[index] = ROLES.index(role)
            evidence_codes[index] = code_of(evidence)
        roles, their_evidences = role_codes[indices], evidence_codes[indices]
        role_counts = Counter(
            {ROLES[c]: n for c, n in enumerate(np.bincount(roles, minlength=len(ROLES))) if n}
        )
        rest = their_evidences[~np.isin(roles, optimizer)]
        unique, first, counts = np.unique(rest, return_index=True, return_counts=True)
        by_text = list(evidences)
        rest_counts = Counter(
            {by_text[unique[k]]: int(counts[k]) for k in np.argsort(first, kind="stable")}
        )
        thin = file_role.thin and bool(
            (their_evidences == evidences.get(file_role.evidence, -1)).any()
        )
        readings[source] = (
            describe_file(role_counts, file_role),
            file_evidence_text(rest_counts, len(rest) < len(indices), file_role),
            thin,
        )
    thin_texts = {evidence.evidence for evidence in thin_evidences if evidence.thin}
    return RoleDecision(
        role_codes,
        evidence_codes,
        tuple(evidences),
        tuple(text in thin_texts for text in evidences),
        readings,
        from_values,
    )


def in_tensor_order(
    table: StatsTable, findings: Sequence[Finding]
) -> FindingTable | tuple[Finding, ...]:
    """Findings grouped tensor by tensor, in the tensors' order (each tensor's own order kept).

    Only the flagged tensors are looked up (:func:`tensor_indices`); a
    :class:`~gradaudit.scan.finding_table.FindingTable` is sorted on its columns.
    """
    columns = column_findings(table, findings)
    if columns is not None:
        return columns.in_tensor_order()
    keys = {(f.source, f.tensor) for f in findings}
    found = tensor_indices(table, keys).tolist()
    sources, codes, names = table.sources, table.source_codes, table.names
    order = {(sources[codes[i]], names[i]): i for i in found}
    return tuple(sorted(findings, key=lambda f: order.get((f.source, f.tensor), len(table))))


def with_findings(report: Report, extra: Sequence[Finding]) -> Report:
    """``report`` with ``extra`` findings judged after the scan (``--precision``'s headroom):
    in its findings and its summary, so the one verdict counts them."""
    if not extra:
        return report
    base = report.findings
    findings: Sequence[Finding] = (
        base.extended(extra) if isinstance(base, FindingTable) else (*base, *extra)
    )
    s = report.summary
    summary = summarize(
        table_of(report.tensors),
        findings,
        report.limit_findings,
        s.skipped,
        s.global_norm,
        s.excluded,
    )
    return dataclasses.replace(report, findings=findings, summary=summary)


def summarize(
    tensors: StatsTable,
    findings: Sequence[Finding],
    limit_findings: Sequence[LimitFinding],
    skipped: int,
    global_norm: float,
    excluded: int = 0,
) -> Summary:
    if not len(findings):  # a healthy step (a monitor's, every step): nothing to count
        return _summary_without_findings(
            tensors, len(limit_findings), skipped, global_norm, excluded
        )
    columns = column_findings(tensors, findings)
    severities: Counter[Severity] = Counter()
    if columns is not None:  # a million flagged tensors: counted on the columns
        counts = np.bincount(columns.severities, minlength=len(SEVERITIES)).tolist()
        severities.update(dict(zip(SEVERITIES, counts, strict=True)))

        def count(kind: FindingKind) -> int:
            if not len(columns):
                return 0
            on_table = len(flagged_indices(tensors, columns, (kind,), ignored=False))
            mask = columns.kind_is(kind) & ~columns.severity_is(Severity.IGNORED)
            elsewhere = {(f.source, f.tensor) for f in columns.select(mask & (columns.rows < 0))}
            return on_table + len(elsewhere)

    else:
        # One pass over the findings.
        flagged: dict[FindingKind, set[tuple[str | None, str]]] = {}
        for finding in findings:
            severities[finding.severity] += 1
            if finding.severity is not Severity.IGNORED:
                flagged.setdefault(finding.kind, set()).add((finding.source, finding.tensor))

        def count(kind: FindingKind) -> int:
            return len(flagged.get(kind, ()))

    return Summary(
        tensors=len(tensors),
        skipped=skipped,
        elements=int(tensors.numel.sum()),
        global_norm=global_norm,
        nan_tensors=count(FindingKind.NAN),
        inf_tensors=count(FindingKind.INF),
        vanishing_tensors=count(FindingKind.VANISHING),
        exploding_tensors=count(FindingKind.EXPLODING),
        outlier_tensors=count(FindingKind.OUTLIER),
        gradient_health=gradient_health(tensors, findings),
        failing_findings=severities[Severity.ERROR] + len(limit_findings),
        warnings=severities[Severity.WARNING],
        ignored_findings=severities[Severity.IGNORED],
        excluded=excluded,
    )


def _summary_without_findings(
    tensors: StatsTable, limit_findings: int, skipped: int, global_norm: float, excluded: int
) -> Summary:
    """:func:`summarize` with no finding: every count 0 and the health of
    :func:`gradient_health` with nothing flagged, read on the columns in a few numpy
    calls (a monitor summarizes every collected step; issue 28 item 9)."""
    total = int(tensors.numel.sum())
    return Summary(
        tensors=len(tensors),
        skipped=skipped,
        elements=total,
        global_norm=global_norm,
        nan_tensors=0,
        inf_tensors=0,
        vanishing_tensors=0,
        exploding_tensors=0,
        outlier_tensors=0,
        gradient_health=_health(total, total, int(tensors.nonfinite.sum())),
        failing_findings=limit_findings,
        warnings=0,
        ignored_findings=0,
        excluded=excluded,
    )


def with_headroom(
    report: Report,
    precision: Precision,
    max_underflow: float = DEFAULT_MAX_UNDERFLOW,
) -> Report:
    """``report`` (collected with histograms) judged for ``precision``: its headroom in
    :attr:`Report.headroom`, which every output format renders, and the headroom's
    findings among the report's as ``cast`` findings, so the one verdict counts them."""
    headroom = precision_report(report, precision, max_underflow)
    judged = with_findings(report, as_findings(headroom, report.thresholds))
    return dataclasses.replace(judged, headroom=headroom)
