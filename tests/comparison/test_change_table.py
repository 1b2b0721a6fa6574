"""The per-parameter comparison as columns gives what one ParameterChange per name gave.

A :class:`ChangeTable` decides every ratio, note and flag on the columns; the
renderers pick their rows on them (:func:`ordered_changes`) and group the
per-tensor findings on columns (:func:`merged_tensor_findings`). Each is held
against the plain per-object rule it replaced, written out here as the oracle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaudit.results.change_table as change_table
from gradaudit import compare, compare_paths
from gradaudit.comparison.checks import compare_tensors
from gradaudit.errors import InputError
from gradaudit.policy import Severity, Thresholds
from gradaudit.report.base import MAX_FLAGGED_ROWS, RenderOptions
from gradaudit.report.compare_text import (
    ALL,
    FLAGGED,
    NOTABLE,
    REST,
    merged_tensor_findings,
    ordered_changes,
    side_name,
)
from gradaudit.report.formats import json as json_format
from gradaudit.report.formats import table as table_format
from gradaudit.results import Finding, TensorStats
from gradaudit.results.change_table import ChangeTable
from gradaudit.results.comparison import (
    HOST,
    SEED,
    Comparison,
    Mismatch,
    ParameterChange,
    ParameterComparison,
    scaled_ratio,
)
from gradaudit.results.stats_table import StatsTable

#: Norms at the edges: zero, subnormal, float64's extremes (the ratio's overflow and
#: underflow), the default band [1/10, 10] and its bounds.
NORMS = [0.0, 5e-324, 1e-300, 1e-3, 0.1, 1.0, 1.0000001, 10.0, 10.5, 1e300, 1.7e308]


@st.composite
def sides(draw: st.DrawFn) -> list[TensorStats]:
    out = []
    for side in (HOST, SEED):
        names = draw(st.lists(st.sampled_from([f"w{i}" for i in range(5)]), unique=True))
        for name in names:
            shape = draw(st.sampled_from([(3,), (3,), (), (0,), (2, 3), (3, 2)]))
            numel = math.prod(shape)
            nan = min(numel, draw(st.sampled_from([0, 0, 0, 1])))
            inf = min(numel - nan, draw(st.sampled_from([0, 0, 0, 1])))
            out.append(
                TensorStats(
                    name,
                    shape,
                    draw(st.sampled_from(["float32", "float32", "bfloat16"])),
                    numel,
                    nan,
                    inf,
                    0,
                    0,
                    1.0,
                    draw(st.sampled_from(NORMS)),
                    None,
                    side,
                )
            )
    return out


def reference(stats: list[TensorStats], max_change: float) -> ParameterComparison | None:
    """The per-object comparison this replaced: a dict of TensorStats per side."""
    a = {t.name: t for t in stats if t.source == HOST}
    b = {t.name: t for t in stats if t.source == SEED}
    shared = [key for key in a if key in b]
    if not shared:
        return None
    changes, mismatches = [], []
    for key in shared:
        ta, tb = a[key], b[key]
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            mismatches.append(Mismatch(key, ta.shape, tb.shape, ta.dtype, tb.dtype))
        if ta.shape != tb.shape:
            continue
        ratio: float | None = None
        note: str | None = None
        bad = [label for label, t in (("A", ta), ("B", tb)) if t.nonfinite]
        if bad:
            note = f"NaN/Inf in {' and '.join(bad)}"
        elif ta.numel == 0:
            note = "no elements"
        elif ta.norm == 0.0 and tb.norm == 0.0:
            note = "both norms are 0"
        elif ta.norm == 0.0:
            ratio = math.inf
        elif tb.norm == 0.0:
            ratio = 0.0
        else:
            ratio = scaled_ratio(tb.norm, ta.norm)
        flagged = ratio is not None and (ratio > max_change or ratio < 1.0 / max_change)
        changes.append(
            ParameterChange(
                key, ta.shape, ta.dtype, tb.dtype, ta.norm, tb.norm, ratio, flagged, note
            )
        )
    differing = [key for key in shared if _digest(a[key]) != _digest(b[key])]
    return ParameterComparison(
        max_change,
        tuple(changes),
        tuple(key for key in a if key not in b),
        tuple(key for key in b if key not in a),
        tuple(mismatches),
        differing[0] if differing else None,
        len(differing),
    )


def _digest(t: TensorStats) -> tuple[object, ...]:
    """What two ranks' dumps must share, bit for bit (struct packs -0.0 apart from 0.0)."""
    counts = (t.nan, t.pos_inf, t.neg_inf, t.zeros)
    return (*counts, struct.pack("<dd", t.max_abs, t.norm), t.shape, t.dtype)


def reference_order(change: ParameterChange) -> tuple[int, float]:
    """The sort key the renderers used: flagged, not comparable, the rest; |log B/A|."""
    if change.ratio is None:
        return (1, 0.0)
    distance = math.inf if change.ratio in (0.0, math.inf) else abs(math.log(change.ratio))
    return (0 if change.flagged else 2, -distance)


def columnar(stats: list[TensorStats], max_change: float) -> ParameterComparison | None:
    table = StatsTable.from_stats(stats)
    keyed = []
    for side in (HOST, SEED):
        rows = table.source_indices(side)
        keyed.append(([table.names[i] for i in rows.tolist()], rows))
    return compare_tensors(table, keyed[0], keyed[1], max_change)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(sides(), st.sampled_from([1.0, 10.0, 10.5, 1e300]))
def test_columns_equal_the_per_object_comparison(
    stats: list[TensorStats], max_change: float
) -> None:
    expected = reference(stats, max_change)
    got = columnar(stats, max_change)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert isinstance(got.changes, ChangeTable)
    assert got == expected
    assert got.flagged == tuple(c for c in expected.changes if c.flagged)
    ordered = sorted(expected.changes, key=reference_order)
    wanted = {
        ALL: ordered,
        FLAGGED: [c for c in ordered if c.flagged],
        NOTABLE: [c for c in ordered if c.flagged or c.note is not None],
        REST: [c for c in ordered if not (c.flagged or c.note is not None)],
    }
    for rows, changes in wanted.items():
        for limit in (None, 0, 2):
            assert ordered_changes(got, rows, limit) == (changes[:limit], len(changes))
            # The same order from changes made elsewhere (a library user's tuple).
            assert ordered_changes(expected, rows, limit) == (changes[:limit], len(changes))
    streamed, count = ordered_changes(got, ALL, None, stream=True)
    assert (list(streamed), count) == (ordered, len(ordered))
    assert ChangeTable.from_changes(expected.changes) == expected.changes


def test_a_name_twice_on_one_side_is_refused() -> None:
    tensors = [("w", torch.ones(2)), ("w", torch.ones(2))]
    with pytest.raises(InputError, match="names 'w' twice"):
        compare(tensors, [("w", torch.ones(2))], device="cpu")


def reference_merged(comparison: Comparison) -> list[tuple[Finding, str]]:
    """The grouping this replaced: sorted by severity, grouped in a dict of lists."""
    rank = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.IGNORED: 2}
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for finding in sorted(comparison.tensor_findings, key=lambda f: rank[f.severity]):
        groups.setdefault((finding.tensor, finding.kind.value, finding.severity.value), []).append(
            finding
        )
    return [
        (found[0], " and ".join(side_name(comparison, f.source) for f in found))
        for found in groups.values()
    ]


VALUES = [0.0, 1e-9, 1.0, 1e5, math.nan, math.inf]


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.sampled_from(VALUES)), max_size=12),
    st.lists(st.tuples(st.integers(0, 6), st.sampled_from(VALUES)), max_size=12),
    st.sampled_from([Thresholds(), Thresholds(ignore=("w1", "w4"))]),
)
def test_merged_findings_on_columns_equal_the_per_object_grouping(
    a: list[tuple[int, float]], b: list[tuple[int, float]], thresholds: Thresholds
) -> None:
    def named(side: list[tuple[int, float]]) -> list[tuple[str, torch.Tensor]]:
        unique = dict(side)  # one tensor per name
        return [(f"w{i}", torch.full((3,), value)) for i, value in unique.items()]

    a_tensors, b_tensors = named(a), named(b)
    if not a_tensors or not b_tensors:
        return
    try:
        comparison = compare(a_tensors, b_tensors, thresholds=thresholds, device="cpu")
    except InputError:  # a side with no element to compare: not what this tests
        return
    plain = dataclasses.replace(
        comparison,
        report=dataclasses.replace(comparison.report, findings=tuple(comparison.tensor_findings)),
    )
    expected = reference_merged(comparison)
    for severities in (tuple(Severity), (Severity.ERROR,), (Severity.WARNING, Severity.ERROR)):
        wanted = [(f, s) for f, s in expected if f.severity in severities]
        for limit in (None, 1, 3):
            for each in (comparison, plain):
                got = merged_tensor_findings(each, severities, limit)
                assert got == (wanted[:limit], len(wanted))


def many(count: int, value: float) -> Iterator[tuple[str, torch.Tensor]]:
    return ((f"layer.{i}.weight", torch.full((2,), value)) for i in range(count))


def test_a_table_of_many_shared_tensors_builds_only_the_rows_it_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every shared tensor flagged (B all zeros): the table builds the rows it shows."""
    count = 5_000
    comparison = compare(list(many(count, 1.0)), list(many(count, 0.0)), device="cpu")
    built = 0
    original = ParameterChange

    def counted(*args: object, **kwargs: object) -> ParameterChange:
        nonlocal built
        built += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(change_table, "ParameterChange", counted)
    options = RenderOptions(width=100)
    text = "".join(table_format.render_compare(comparison, options))
    assert f"{count:,} shared tensors, {count} outside" in text
    # The flagged rows shown, the subjects of the large_change finding nowhere else.
    assert 0 < built <= MAX_FLAGGED_ROWS + options.top
    assert len(comparison.report.findings) == count  # B's every tensor vanishing


def test_streamed_json_is_the_document_json_dumps_writes() -> None:
    comparison = compare(list(many(300, 1.0)), list(many(300, 0.0)), device="cpu")
    streamed = "".join(json_format.render_compare(comparison, RenderOptions()))
    document = json_format.to_comparison_document(comparison)
    assert streamed == json.dumps(document, indent=2, allow_nan=False) + "\n"
    assert len(document["parameters"]["changes"]) == 300
    assert len(document["tensor_findings"]) == 300


def test_columns_hold_no_object_per_shared_tensor() -> None:
    """A million shared names: numbers in numpy columns, names and shapes shared."""
    count = 100_000
    one = StatsTable.from_stats(
        [
            TensorStats("t", (4,), "float32", 4, 0, 0, 0, 0, 1.0, 2.0, 1.0, HOST),
            TensorStats("t", (4,), "float32", 4, 0, 0, 0, 4, 0.0, 0.0, None, SEED),
        ]
    )
    table = one.subset(np.repeat([0, 1], count))
    keys = [f"t{i}" for i in range(count)]
    rows = np.arange(2 * count)
    result = compare_tensors(table, (keys, rows[:count]), (keys, rows[count:]), 10.0)
    assert result is not None
    changes = result.changes
    assert isinstance(changes, ChangeTable)
    assert len(changes) == len(result.flagged) == count
    assert changes.dims.nbytes + changes.ratio.nbytes + changes.norm_a.nbytes <= 24 * count
    assert changes[-1] == ParameterChange(
        f"t{count - 1}", (4,), "float32", "float32", 2.0, 0.0, 0.0, True
    )


@pytest.mark.parametrize(
    ("host", "seed"), [("h.", "s."), ("h.l.1", "s."), ("", "s."), ("h.l.1", "s.l.2")]
)
def test_one_file_routed_as_runs_equals_tensor_by_tensor(
    tmp_path: Path, host: str, seed: str
) -> None:
    """The one-file form reads a safetensors file as runs split by prefix; a ``.pt`` file
    of the same tensors is read tensor by tensor: the two comparisons agree."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"{side}l.{i}.w{j}": torch.randn(3, generator=generator) * (0.0 if j == 2 else 1.0)
        for side in ("h.", "s.", "x.")
        for i in range(4)
        for j in range(3)
    }
    runs, plain = tmp_path / "a.safetensors", tmp_path / "a.pt"
    save_file(tensors, str(runs))
    torch.save(tensors, plain)
    got, want = (
        compare_paths(path, host_prefix=host, seed_prefix=seed, device="cpu")
        for path in (runs, plain)
    )
    assert got.report.tensors == want.report.tensors
    assert got.report.skipped == want.report.skipped
    assert got.report.findings == want.report.findings
    assert got.parameters == want.parameters
    assert len(got.report.skipped) == sum(
        1 for name in tensors if not name.startswith(host) and not name.startswith(seed)
    )
