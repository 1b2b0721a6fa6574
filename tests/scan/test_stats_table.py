"""Per-tensor results as columns give what one object per tensor gave.

The StatsTable is a view: each TensorStats it makes must equal the one the old loop
made from the same host row, and every judgement made on the columns (roles,
findings, outliers, health) must equal the per-tensor reference written out here.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.policy import FindingKind, InputKind, Role, Severity, Thresholds
from gradaudit.results import TensorStats
from gradaudit.results.roles import FileEvidence, TensorHint
from gradaudit.results.row import MAX_ABS, NAN, NEG_INF, POS_INF, SCALE, SSQ, ZEROS
from gradaudit.results.stats_table import ROLES, StatsTable, coded, shapes_of
from gradaudit.roles import (
    NAME_WORDS,
    decide,
    name_templates,
    name_word_mask,
    role_from_name,
    stats_evidence,
)
from gradaudit.scan import outliers
from gradaudit.scan.judge import evaluate_all, gradient_health, in_tensor_order, with_roles
from gradaudit.scan.outliers import OUTLIER_MIN_TENSORS, find_outliers
from gradaudit.scan.rules import evaluate

SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)
COUNTS = st.integers(0, 3)


def reference_stats(
    name: str, shape: tuple[int, ...], dtype: str, source: str | None, row: list[float]
) -> TensorStats:
    """What materialize built per tensor before the columns (HostRow's derivations)."""
    numel = math.prod(shape)
    nan, pos_inf, neg_inf = int(row[NAN]), int(row[POS_INF]), int(row[NEG_INF])
    norm = row[SCALE] * math.sqrt(row[SSQ])
    finite = numel - nan - pos_inf - neg_inf
    return TensorStats(
        name,
        shape,
        dtype,
        numel,
        nan,
        pos_inf,
        neg_inf,
        int(row[ZEROS]),
        row[MAX_ABS],
        norm,
        norm / math.sqrt(finite) if finite else None,
        source,
    )


def table_of(
    shapes: list[tuple[int, ...]],
    rows: list[list[float]],
    sources: list[str | None],
    dtypes: list[str],
) -> StatsTable:
    count = len(shapes)
    starts = np.zeros(count + 1, dtype=np.int64)
    np.cumsum([len(s) for s in shapes], out=starts[1:])
    dims = np.array([d for s in shapes for d in s], dtype=np.int64)
    source_names = tuple(dict.fromkeys(sources))
    dtype_names = tuple(dict.fromkeys(dtypes))
    return StatsTable.from_rows(
        [f"t{i}" for i in range(count)],
        dims,
        starts,
        np.array([dtype_names.index(d) for d in dtypes], dtype=np.int16),
        dtype_names,
        np.array([source_names.index(s) for s in sources], dtype=np.int32),
        source_names,
        np.array(rows, dtype=np.float64).reshape(count, 7),
    )


@st.composite
def tensors(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[list[float]]]:
    count = draw(st.integers(0, 30))
    shapes, rows = [], []
    for _ in range(count):
        shape = draw(SHAPES)
        numel = math.prod(shape)
        nan = draw(st.integers(0, numel))
        pos = draw(st.integers(0, numel - nan))
        neg = draw(st.integers(0, numel - nan - pos))
        zeros = draw(st.integers(0, numel - nan - pos - neg))
        scale = draw(st.sampled_from([1.0, 2.0**-900, 2.0**600]))
        ssq = draw(st.floats(0, 1e6)) if numel - nan - pos - neg - zeros else 0.0
        peak = draw(st.floats(0, 1e4))
        shapes.append(shape)
        rows.append([nan, pos, neg, zeros, peak, scale, ssq])
    return shapes, rows


@settings(derandomize=True, max_examples=200, deadline=None)
@given(tensors(), st.lists(st.sampled_from(["a.safetensors", "b.pt", None]), min_size=30))
def test_each_tensorstats_is_the_one_the_host_row_gives(
    case: tuple[list[tuple[int, ...]], list[list[float]]], sources: list[str | None]
) -> None:
    shapes, rows = case
    sources = sources[: len(shapes)]
    dtypes = ["float32" if i % 3 else "bfloat16" for i in range(len(shapes))]
    table = table_of(shapes, rows, sources, dtypes)
    expected = [
        reference_stats(f"t{i}", shapes[i], dtypes[i], sources[i], rows[i])
        for i in range(len(shapes))
    ]
    assert list(table) == expected
    assert table == expected
    assert len(table) == len(expected)
    if expected:
        assert table[-1] == expected[-1]
        assert table[1:4] == tuple(expected[1:4])
        assert table[::2] == tuple(expected[::2])
        assert table.take([len(expected) - 1, 0]) == [expected[-1], expected[0]]
        picked = [i for i in range(len(expected)) if i % 2]
        assert list(table.subset(picked)) == [expected[i] for i in picked]
    assert list(StatsTable.from_stats(expected)) == expected


def test_equal_shapes_share_one_tuple() -> None:
    dims = np.array([4, 4, 2, 2, 4], dtype=np.int64)
    starts = np.array([0, 1, 2, 4, 5], dtype=np.int64)
    shapes = shapes_of(dims, starts, 0, 4)
    assert shapes == [(4,), (4,), (2, 2), (4,)]
    assert shapes[0] is shapes[1]
    assert shapes[0] is shapes[3]


def test_an_index_past_the_end_is_an_index_error() -> None:
    table = table_of([(2,)], [[0, 0, 0, 0, 1.0, 1.0, 2.0]], ["f"], ["float32"])
    with pytest.raises(IndexError):
        table[1]
    assert table[-1].rms == pytest.approx(1.0)


# -- judging on the columns equals judging each tensor ----------------------------------


@st.composite
def judged(draw: st.DrawFn) -> list[TensorStats]:
    out = []
    for i in range(draw(st.integers(0, 40))):
        shape = draw(st.sampled_from([(), (3,), (20,), (4, 5)]))
        numel = math.prod(shape)
        nan = draw(st.sampled_from([0, 0, 0, 1]))
        zeros = draw(st.sampled_from([0, 0, numel - nan]))
        finite = numel - nan
        rms = draw(st.sampled_from([1e-9, 1e-3, 0.01, 0.02, 1.0, 50.0, 1e5]))
        norm = 0.0 if zeros == finite else rms * math.sqrt(finite)
        out.append(
            TensorStats(
                f"layer.{i % 7}.w{i}",
                shape,
                "float32",
                numel,
                nan,
                0,
                0,
                zeros,
                draw(st.floats(0, 2e5)),
                norm,
                (norm / math.sqrt(finite)) if finite else None,
                draw(st.sampled_from(["a", "b"])),
                draw(st.sampled_from(list(Role))),
                "",
            )
        )
    return out


POLICIES = st.sampled_from(
    [
        Thresholds(),
        Thresholds(cast_check="fp16"),
        Thresholds(ignore=("layer.3.*",)),
        Thresholds(vanishing=1e-2, exploding=10.0),
    ]
)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(judged(), POLICIES)
def test_findings_on_columns_are_each_tensors_findings(
    stats: list[TensorStats], policy: Thresholds
) -> None:
    expected = tuple(f for s in stats for f in evaluate(s, policy))
    assert evaluate_all(StatsTable.from_stats(stats), policy) == expected
    assert evaluate_all(stats, policy) == expected


def reference_outliers(
    tensors: list[TensorStats], thresholds: Thresholds, already: set[tuple[str | None, str]]
) -> list[tuple[str, str]]:
    """The loop over tensors the columns replaced: (name, message) of each outlier."""
    groups: dict[tuple[str | None, Role, str], list[TensorStats]] = {}
    for t in tensors:
        if t.role in (Role.GRADIENT, Role.WEIGHT) and t.rms is not None and t.rms > 0:
            shapes = (
                "all" if t.role is not Role.GRADIENT else ("1-D" if len(t.shape) <= 1 else "2-D+")
            )
            groups.setdefault((t.source, t.role, shapes), []).append(t)
    out = []
    for (source, role, shapes), members in groups.items():
        if len(members) < OUTLIER_MIN_TENSORS:
            continue
        logs = [math.log10(t.rms) for t in members if t.rms is not None]
        median = statistics.median(logs)
        limit = thresholds.outlier_limit(role)
        for t, x in zip(members, logs, strict=True):
            distance = x - median
            if abs(distance) <= limit or (source, t.name) in already:
                continue
            direction = "above" if distance > 0 else "below"
            out.append(
                (
                    t.name,
                    f"RMS {t.rms:.3g} is {abs(distance):.1f} decades {direction} the median "
                    f"{10**median:.3g} of {len(members)} {role.value} tensors"
                    f"{'' if shapes == 'all' else f' ({shapes})'} (limit {limit:.1f})",
                )
            )
    return out


@pytest.mark.slow
@settings(derandomize=True, max_examples=300, deadline=None)
@given(judged(), POLICIES)
def test_outliers_on_columns_are_the_loops_outliers(
    stats: list[TensorStats], policy: Thresholds
) -> None:
    findings = evaluate_all(stats, policy)
    magnitude = (FindingKind.EXPLODING, FindingKind.VANISHING, FindingKind.ALL_ZERO)
    already = {(f.source, f.tensor) for f in findings if f.kind in magnitude}
    found, references = find_outliers(stats, policy, findings)
    expected = reference_outliers(stats, policy, already)
    assert sorted((f.tensor, f.message) for f in found) == sorted(expected)
    for reference in references:
        members = [
            t
            for t in stats
            if t.source == reference.source and t.role is reference.role and t.rms and t.rms > 0
        ]
        logs = [math.log10(t.rms) for t in members if t.rms is not None]
        if reference.shapes != "all":
            logs = [
                math.log10(t.rms)
                for t in members
                if t.rms is not None and (len(t.shape) <= 1) == (reference.shapes == "1-D")
            ]
        median = statistics.median(logs)
        assert reference.median == median
        assert reference.spread == 1.4826 * statistics.median(abs(x - median) for x in logs)


@pytest.mark.slow
@settings(derandomize=True, max_examples=200, deadline=None)
@given(judged())
def test_health_and_order_on_columns_are_the_loops(stats: list[TensorStats]) -> None:
    findings = evaluate_all(stats, Thresholds())
    shuffled = tuple(reversed(findings))
    order = {(t.source, t.name): i for i, t in enumerate(stats)}
    expected = tuple(sorted(shuffled, key=lambda f: order.get((f.source, f.tensor), len(order))))
    assert in_tensor_order(StatsTable.from_stats(stats), shuffled) == expected
    total = sum(t.numel for t in stats)
    flagged = {(f.source, f.tensor) for f in findings if f.severity is not Severity.IGNORED}
    clean = sum(t.numel for t in stats if (t.source, t.name) not in flagged)
    nonfinite = sum(t.nonfinite for t in stats)
    score = (
        (clean / total) * ((total - nonfinite) / total) * (0.5 if nonfinite else 1.0)
        if total
        else 0.0
    )
    assert gradient_health(stats, findings) == min(1.0, max(0.0, score))


# -- roles -------------------------------------------------------------------------------

NAMES = st.sampled_from(
    [
        "encoder.layer.0.weight",
        "bn.running_mean",
        "bn.RUNNING_VAR",
        "model.grads.fc",
        "fc.weight.grad",
        "fc.gradient_scale",
        "rope.inv_freq",
        "attn.masKed_bias",  # a Kelvin sign, whose lower case is "k"
        "x/grad/y",
        "plain",
        # Read once per template (digits written 0): a digit never makes a role word.
        "layers.3.grad",
        "layers.17.grad",
        "grads.12.fc",
        "bn2.running_mean",
        "fc.grad0",
        "running_mean1",
    ]
)
HINTS = st.sampled_from(
    [
        None,
        None,
        TensorHint(Role.OPTIMIZER_MOMENT, "torch.optim state key 'exp_avg'"),
        TensorHint(Role.WEIGHT, "under 'model'"),
        TensorHint(None, ""),
    ]
)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(NAMES, HINTS, st.sampled_from(["a", "b", None])), max_size=20),
    st.sampled_from(list(InputKind)),
)
def test_roles_on_columns_are_each_tensors_decision(
    entries: list[tuple[str, TensorHint | None, str | None]], kind: InputKind
) -> None:
    stats = [
        TensorStats(
            f"{name}.{i}" if i % 2 else name, (4,), "float32", 4, 0, 0, 0, 0, 1.0, 2.0, 1.0, source
        )
        for i, (name, _, source) in enumerate(entries)
    ]
    hints = [hint for _, hint, _ in entries]
    table = StatsTable.from_stats(stats)
    evidence = {"a": FileEvidence(Role.WEIGHT, "metadata format: pt")}
    readings = with_roles(table, hints, Thresholds(kind=kind), evidence)
    for t, hint, got in zip(stats, hints, table, strict=True):
        if t.source is None:
            file_role = FileEvidence(Role.GRADIENT, "tensors from memory: gradients")
        else:
            # A file without metadata is read from its names and values (a module buffer
            # among them says "a model state dict"): the file-level call, per file.
            file_role = evidence.get(t.source) or stats_evidence(
                [s for s in stats if s.source == t.source]
            )
        assert (got.role, got.role_evidence) == decide(t.name, hint, kind, file_role)
    assert set(readings) == {t.source for t in stats}


def test_every_character_whose_lower_case_is_ascii_is_matched_by_the_name_words() -> None:
    """The prefilter is a superset of role_from_name for any spelling of its words."""
    spellings: dict[str, list[str]] = {}
    for point in range(0x110000):
        char = chr(point)
        lower = char.lower()
        if len(lower) == 1 and lower.isascii() and lower.isalpha():
            spellings.setdefault(lower, []).append(char)
    for word in ["running_mean", "grad", "masked_bias", "inv_freq", "token_type_ids"]:
        for index, letter in enumerate(word):
            for variant in spellings.get(letter, []):
                name = f"m.{word[:index]}{variant}{word[index + 1 :]}"
                if role_from_name(name) is not None:
                    assert name_word_mask([name])[0], name


def test_the_name_word_mask_maps_each_hit_to_its_own_name() -> None:
    """Names whose lower case is longer (İ), hold newlines or several words: each hit is
    attributed to the name it lies in, and the mask equals a per-name search."""
    names = [
        "İİİİ.weight",
        "bn.Running_Mean",
        "a\nb",
        "\ngrads.x",
        "İ.GRAD",
        "plain",
        "",
        "token_type_ids.position_ids.grad",
        "ΣΑΣ.sin_cached",
    ]
    expected = [any(w in n.lower() for w in NAME_WORDS) for n in names]
    assert expected == [False, True, False, True, True, False, False, True, True]
    # Among many plain names, so each hit is placed (not every name taken as a candidate).
    plain = [f"layer.{i}.weight" for i in range(100)]
    assert name_word_mask(names + plain).tolist() == expected + [False] * len(plain)
    assert name_word_mask(["grad", *plain, "x.GRAD"]).tolist() == [True] + [False] * 100 + [True]
    # Where most names hold a word, all are candidates: still a superset.
    assert name_word_mask(names).tolist() == [True] * len(names)
    assert name_word_mask([]).tolist() == []


@given(
    st.lists(
        st.lists(
            st.sampled_from(
                [*NAME_WORDS, "0", "12", "grad3", "Running_Mean", "x9y", "(", " (", "\n"]
            ),
            max_size=5,
        ).map(lambda parts: ".".join(parts)),
        max_size=6,
    )
)
def test_a_name_template_is_read_as_its_name(names: list[str]) -> None:
    templates = name_templates(names)
    assert len(templates) == len(names)
    for name, template in zip(names, templates, strict=True):
        assert role_from_name(template) == role_from_name(name), (name, template)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(NAMES, max_size=12), st.integers(0, 3))
def test_a_file_holding_a_module_buffer_is_found_by_reading_each_name(
    names: list[str], gradients: int
) -> None:
    """stats_evidence's buffer search equals reading every name with role_from_name, also
    where most names hold ``grad`` (each name a candidate for the other roles' words)."""
    names = [f"params.{i}.grad" for i in range(gradients * len(names))] + names
    stats = [TensorStats(n, (4,), "float32", 4, 0, 0, 0, 0, 1.0, 2.0, 1.0, "f") for n in names]
    buffers = [n for n in names if (found := role_from_name(n)) and found[0] is Role.BUFFER]
    evidence = stats_evidence(stats)
    if buffers:
        assert (evidence.role, evidence.thin) == (Role.WEIGHT, False)
        assert f"holds module buffers ({buffers[0]})" in evidence.evidence
    else:
        assert "module buffers" not in evidence.evidence


def test_names_differing_in_their_numbers_share_a_template() -> None:
    assert name_templates(["params.7.grad", "params.8.grad", "p.18", "a\n1"]) == [
        "params.0.grad",
        "params.0.grad",
        "p.00",
        "a\n0",
    ]


def test_a_role_the_name_gives_is_found_among_many_plain_names() -> None:
    names = [f"layer.{i}.weight" for i in range(1000)] + ["bn.running_mean"]
    stats = [TensorStats(n, (4,), "float32", 4, 0, 0, 0, 0, 1.0, 2.0, 1.0, "f") for n in names]
    table = StatsTable.from_stats(stats)
    with_roles(table, [None] * len(names), Thresholds(), {})
    assert table[-1].role is Role.BUFFER
    # A module buffer says the file is a model's state dict: the rest are weights.
    assert {t.role for t in table[:-1]} == {Role.WEIGHT}
    assert ROLES[int(table.role_codes[0])] is Role.WEIGHT


def test_coded_values_keep_their_first_appearance_order() -> None:
    distinct, codes = coded(["b", None, "b", "a"], np.int32)
    assert distinct == ("b", None, "a")
    assert codes.dtype == np.int32
    assert codes.tolist() == [0, 1, 0, 2]
    distinct, codes = coded([None] * 3, np.int16)
    assert (distinct, codes.tolist()) == ((None,), [0, 0, 0])
    distinct, codes = coded([], np.int16)
    assert (distinct, codes.tolist()) == ((), [])


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([1e-300, 1e-9, 1e-3, 0.02, 0.03, 1.0, 7.5, 1e5, 1e300, math.inf]),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([0.5, 1.0, 2.0]),
)
def test_small_outlier_groups_on_lists_match_the_arrays(rms: list[float], limit: float) -> None:
    """A small group judged on Python floats gives the bits the array path gives."""
    values = np.array(rms, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: a group with a non-finite log
        on_lists = outliers._far_from_median(values, limit)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(outliers, "_LIST_LIMIT", 0)
            on_arrays = outliers._far_from_median(values, limit)
    assert repr(on_lists) == repr(on_arrays)  # repr: NaN equals NaN, -0.0 is not 0.0
