"""Findings as columns give what one Finding object per finding gave.

A FindingTable decides on the columns which tensors have findings and of which
kinds and severities; evaluate() builds each one. Every column must agree with
the findings it builds, and every count, set and grouping read from the columns
(summary, health, limits, outlier exclusions, tensor order, the renderers'
grouping) must equal the same computed from a plain tuple of the findings.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.policy import FindingKind, Role, Severity, Thresholds, parse_fail_on
from gradaudit.report.verdict import (
    failing_kinds,
    file_findings,
    findings_by_tensor,
    flagged_tensors,
    kinds_in_file,
    some_findings,
    tensor_findings,
    tensor_severities,
    unaudited,
)
from gradaudit.results import FileResult, Finding, Report, TensorStats
from gradaudit.results.stats_table import StatsTable
from gradaudit.results.verdict import exit_code
from gradaudit.scan.finding_table import KINDS, SEVERITIES, FindingTable
from gradaudit.scan.judge import (
    evaluate_all,
    evaluate_limits,
    gradient_health,
    in_tensor_order,
    summarize,
)
from gradaudit.scan.outliers import find_outliers
from gradaudit.scan.rules import cast_limits, evaluate

NORMS = [1e-9, 1e-7, 1e-3, 0.01, 1.0, 10.0, 50.0, 100.0, 1e5, 1e20]
#: Around the cast checks' limits (fp16 and fp8_e4m3fn), the limits included.
PEAKS = [0.0, 1e-9, 3.0, 1e5, 1e20] + [
    x for target in ("fp16", "fp8_e4m3fn") for x in cast_limits(target)
]


@st.composite
def tensors(draw: st.DrawFn) -> list[TensorStats]:
    out = []
    for i in range(draw(st.integers(0, 30))):
        shape = draw(st.sampled_from([(), (3,), (20,), (4, 5), (0,)]))
        numel = math.prod(shape)
        nan = min(numel, draw(st.sampled_from([0, 0, 0, 1])))
        pos_inf = min(numel - nan, draw(st.sampled_from([0, 0, 0, 1])))
        neg_inf = min(numel - nan - pos_inf, draw(st.sampled_from([0, 0, 0, 2])))
        finite = numel - nan - pos_inf - neg_inf
        zeros = draw(st.sampled_from([0, 0, finite]))
        # The policies' thresholds themselves among the norms: the comparisons' edges.
        norm = 0.0 if zeros == finite else draw(st.sampled_from(NORMS))
        # Some roles read on thin evidence (a default or a guess): their role-dependent
        # findings warn unless the other reading fails too; a norm scale's name counts there.
        thin = draw(st.booleans())
        name = draw(st.sampled_from([f"layer.{i % 5}.w{i}", f"layer.{i % 5}.norm{i}.weight"]))
        out.append(
            TensorStats(
                name,
                shape,
                "float32",
                numel,
                nan,
                pos_inf,
                neg_inf,
                zeros,
                draw(st.sampled_from(PEAKS)),
                norm,
                (norm / math.sqrt(finite)) if finite else None,
                draw(st.sampled_from(["a", "b"])),
                draw(st.sampled_from(list(Role))),
                "guessed" if thin else "",
                thin,
            )
        )
    return out


POLICIES = st.sampled_from(
    [
        Thresholds(),
        Thresholds(cast_check="fp16"),
        Thresholds(cast_check="fp8_e4m3fn", ignore=("layer.3.*",)),
        Thresholds(ignore=("layer.1.*", "*w2")),
        Thresholds(vanishing=1e-2, exploding=10.0, fail_on=parse_fail_on("all")),
        Thresholds(max_vanishing_fraction=0.2, max_global_norm=1.0, fail_on=parse_fail_on("none")),
    ]
)


def extras(stats: list[TensorStats], policy: Thresholds) -> tuple[Finding, ...]:
    """Findings kept as objects: on table tensors (as optimizer state's are) and on
    tensors that are not in the table (as skipped tensors' are)."""
    out = [
        Finding(
            FindingKind.NEGATIVE,
            policy.severity(FindingKind.NEGATIVE, t.name),
            t.name,
            "neg",
            t.source,
        )
        for t in stats[::4]
    ]
    out.append(
        Finding(
            FindingKind.SKIPPED,
            policy.severity(FindingKind.SKIPPED, "gone"),
            "gone",
            "not audited",
            "a",
        )
    )
    out.append(Finding(FindingKind.VANISHING, Severity.ERROR, "elsewhere", "estimate", "b"))
    return tuple(out)


@pytest.mark.slow
@settings(derandomize=True, max_examples=300, deadline=None)
@given(tensors(), POLICIES)
def test_columns_agree_with_the_findings_evaluate_builds(
    stats: list[TensorStats], policy: Thresholds
) -> None:
    table = StatsTable.from_stats(stats)
    found = evaluate_all(table, policy)
    assert isinstance(found, FindingTable)
    expected = [(i, f) for i, s in enumerate(stats) for f in evaluate(s, policy)]
    assert list(found) == [f for _, f in expected]
    assert found.rows.tolist() == [i for i, _ in expected]
    assert [KINDS[k] for k in found.kinds.tolist()] == [f.kind for _, f in expected]
    assert [SEVERITIES[k] for k in found.severities.tolist()] == [f.severity for _, f in expected]
    for position in range(-len(found), len(found)):
        assert found[position] == expected[position][1]
    assert found[1:3] == tuple(f for _, f in expected[1:3])


@pytest.mark.slow
@settings(derandomize=True, max_examples=200, deadline=None)
@given(tensors(), POLICIES)
def test_judging_on_columns_equals_judging_a_tuple(
    stats: list[TensorStats], policy: Thresholds
) -> None:
    table = StatsTable.from_stats(stats)
    columns = evaluate_all(table, policy) + extras(stats, policy)
    plain = tuple(columns)
    assert isinstance(columns, FindingTable)
    assert plain == tuple(f for s in stats for f in evaluate(s, policy)) + extras(stats, policy)
    outliers_columns = find_outliers(table, policy, columns)
    assert outliers_columns == find_outliers(table, policy, plain)
    ordered = in_tensor_order(table, columns + outliers_columns[0])
    ordered_plain = in_tensor_order(table, plain + outliers_columns[0])
    assert isinstance(ordered, FindingTable)
    assert ordered.ordered
    assert tuple(ordered) == ordered_plain
    assert gradient_health(table, ordered) == gradient_health(table, ordered_plain)
    assert summarize(table, ordered, (), 1, 2.0) == summarize(table, ordered_plain, (), 1, 2.0)
    files = tuple(
        FileResult(path, len(table.source_indices(path)), 0, 0, 1.5) for path in ("a", "b")
    )
    assert evaluate_limits(table, ordered, files, 2.0, policy) == evaluate_limits(
        table, ordered_plain, files, 2.0, policy
    )


@pytest.mark.slow
@settings(derandomize=True, max_examples=150, deadline=None)
@given(tensors(), POLICIES)
def test_renderers_group_columns_as_they_group_a_tuple(
    stats: list[TensorStats], policy: Thresholds
) -> None:
    table = StatsTable.from_stats(stats)
    findings = in_tensor_order(table, evaluate_all(table, policy) + extras(stats, policy))
    summary = summarize(table, findings, (), 0, 1.0)
    report = Report(table, findings, (), summary, "cpu", "eager", 0.0, thresholds=policy)
    plain = Report(table, tuple(findings), (), summary, "cpu", "eager", 0.0, thresholds=policy)
    assert list(tensor_findings(report)) == list(tensor_findings(plain))
    assert list(tensor_severities(report)) == list(tensor_severities(plain))
    for limit in (None, 0, 1, 3):
        assert flagged_tensors(report, limit) == flagged_tensors(plain, limit)
    assert findings_by_tensor(report) == findings_by_tensor(plain)
    skipped = (FindingKind.SKIPPED,)
    assert findings_by_tensor(report, kinds=skipped) == findings_by_tensor(plain, kinds=skipped)
    some = {(t.source, t.name) for t in stats[::3]} | {("a", "gone")}
    assert findings_by_tensor(report, only=some) == findings_by_tensor(plain, only=some)
    for source in ("a", "b", None):
        assert file_findings(report, source) == file_findings(plain, source)
        assert kinds_in_file(report, source) == kinds_in_file(plain, source)
        for kind in (None, FindingKind.VANISHING, FindingKind.NAN):
            for limit in (None, 0, 2):
                for severities in ([Severity.ERROR], [Severity.WARNING, Severity.IGNORED]):
                    assert some_findings(
                        report, severities, kind=kind, in_file=True, source=source, limit=limit
                    ) == some_findings(
                        plain, severities, kind=kind, in_file=True, source=source, limit=limit
                    )
    for limit in (None, 1):
        assert some_findings(report, [Severity.WARNING], limit=limit) == some_findings(
            plain, [Severity.WARNING], limit=limit
        )
    assert failing_kinds(report) == failing_kinds(plain)
    assert unaudited(report) == unaudited(plain)
    assert exit_code(report) == exit_code(plain)


def test_a_million_findings_are_columns_not_objects() -> None:
    """The all-zero dump: every tensor vanishing, no Finding held, counts from columns."""
    count = 200_000
    table = StatsTable.from_stats(
        [TensorStats("t", (4,), "float32", 4, 0, 0, 0, 4, 0.0, 0.0, 0.0, "f")]
    ).subset(np.zeros(count, dtype=np.int64))
    found = in_tensor_order(table, evaluate_all(table, Thresholds()))
    assert isinstance(found, FindingTable)
    assert not found.objects
    assert len(found) == count
    assert found.rows.nbytes + found.kinds.nbytes + found.slots.nbytes < 16 * count
    summary = summarize(table, found, (), 0, 0.0)
    assert summary.vanishing_tensors == count
    assert summary.warnings == count
    assert found[count - 1].kind is FindingKind.VANISHING


@settings(derandomize=True, max_examples=150, deadline=None)
@given(tensors())
def test_a_summary_without_findings_is_the_counted_one(stats: list[TensorStats]) -> None:
    """The shortcut for no finding (a monitor's healthy step) gives the summary the count
    over the findings gives: zero counts, and the health of the NaN/Inf left unjudged."""
    table = StatsTable.from_stats(stats)
    summary = summarize(table, (), ("limit",), 3, 2.5, 4)  # type: ignore[arg-type]
    assert summary.gradient_health == gradient_health(table, ())
    assert (summary.tensors, summary.skipped, summary.excluded) == (len(stats), 3, 4)
    assert summary.elements == sum(t.numel for t in stats)
    assert (summary.nan_tensors, summary.outlier_tensors, summary.warnings) == (0, 0, 0)
    assert summary.failing_findings == 1  # the limit finding
    empty = FindingTable.judge(table, Thresholds(vanishing=0.0, exploding=math.inf))
    if not len(empty):
        assert summarize(table, empty, (), 0, 1.0) == summarize(table, (), (), 0, 1.0)
