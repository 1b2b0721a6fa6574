"""Grouping parameters into layers: keys, model order, auto resolution, combined norms."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit import Thresholds, audit
from gradaudit.grouping import (
    GroupBy,
    GroupMode,
    combine_norms,
    group_layers,
    model_order,
    parse_group_by,
    resolve,
)
from gradaudit.policy import FindingKind, Severity


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("auto", GroupBy(GroupMode.AUTO)),
        ("Module", GroupBy(GroupMode.MODULE)),
        ("none", GroupBy(GroupMode.NONE)),
        ("depth 2", GroupBy(GroupMode.DEPTH, 2)),
        ("depth=3", GroupBy(GroupMode.DEPTH, 3)),
        ("depth:1", GroupBy(GroupMode.DEPTH, 1)),
    ],
)
def test_parse_group_by(spec: str, expected: GroupBy) -> None:
    assert parse_group_by(spec) == expected


@pytest.mark.parametrize("spec", ["", "depth", "depth 0", "depth -1", "layers", "module 2"])
def test_parse_group_by_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match="--group-by"):
        parse_group_by(spec)


@pytest.mark.parametrize(
    ("spec", "name", "key"),
    [
        (GroupBy(GroupMode.MODULE), "layers.0.attn.q.weight", "layers.0.attn.q"),
        (GroupBy(GroupMode.MODULE), "bias", "bias"),
        (GroupBy(GroupMode.DEPTH, 2), "layers.0.attn.q.weight", "layers.0"),
        (GroupBy(GroupMode.DEPTH, 9), "layers.0.attn.q.weight", "layers.0.attn.q"),
        (GroupBy(GroupMode.DEPTH, 2), "head.weight", "head"),
        (GroupBy(GroupMode.NONE), "layers.0.attn.q.weight", "layers.0.attn.q.weight"),
    ],
)
def test_group_keys(spec: GroupBy, name: str, key: str) -> None:
    assert spec.key(name) == key


def test_auto_must_be_resolved_before_grouping() -> None:
    with pytest.raises(ValueError, match="resolve"):
        GroupBy().key("a.b")


def test_model_order_sorts_module_list_indices_by_number() -> None:
    # The order safetensors' save_file writes: alphabetical, so layers.10 before layers.2.
    names = [
        "embed.weight",
        "head.bias",
        "head.weight",
        "layers.0.q.weight",
        "layers.1.q.weight",
        "layers.10.q.weight",
        "layers.2.q.weight",
    ]
    assert model_order(names) == [
        "embed.weight",
        "head.bias",
        "head.weight",
        "layers.0.q.weight",
        "layers.1.q.weight",
        "layers.2.q.weight",
        "layers.10.q.weight",
    ]


def test_model_order_keeps_a_state_dict_order() -> None:
    names = ["embed.weight", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight"]
    names += ["norm.weight", "head.weight"]
    assert model_order(names) == names


@settings(derandomize=True, deadline=None, max_examples=200)
@given(
    st.lists(
        st.lists(
            st.sampled_from(["a", "b", "w", "0", "1", "2", "10", "11"]), min_size=1, max_size=4
        ),
        max_size=30,
    )
)
def test_model_order_is_a_stable_tree_order(parts: list[list[str]]) -> None:
    names = [".".join(p) for p in parts]
    ordered = model_order(names)
    assert sorted(ordered) == sorted(set(names))
    assert model_order(ordered) == ordered  # idempotent
    for index in ("0", "1", "2", "10", "11"):  # numbered siblings in numeric order
        for other in ("0", "1", "2", "10", "11"):
            a, b = f"a.{index}.w", f"a.{other}.w"
            if a in ordered and b in ordered and int(index) < int(other):
                assert ordered.index(a) < ordered.index(b)
    for name in ordered:  # a parent sorts before its children
        parent = name.rsplit(".", 1)[0]
        if parent != name and parent in ordered:
            assert ordered.index(parent) < ordered.index(name)


def test_auto_picks_module_or_the_deepest_depth_that_fits() -> None:
    small = [f"layers.{i}.{m}.weight" for i in range(3) for m in ("q", "k")]
    assert resolve(GroupBy(), small) == GroupBy(GroupMode.MODULE, chosen=True)
    big = [f"model.layers.{i}.{m}.{p}" for i in range(24) for m in "qkvo" for p in "wb"]
    chosen = resolve(GroupBy(), big)
    assert chosen == GroupBy(GroupMode.DEPTH, 3, chosen=True)  # model.layers.N: 24 rows
    assert str(chosen) == "depth 3 (auto)"
    assert resolve(GroupBy(GroupMode.NONE), big) == GroupBy(GroupMode.NONE)


def test_group_norm_matches_a_float64_reference() -> None:
    torch.manual_seed(0)
    tensors = {
        "a.q.weight": torch.randn(64, 32) * 1e18,  # squares overflow float32
        "a.q.bias": torch.randn(32),
        "a.k.weight": torch.randn(16, 16, dtype=torch.float64) * 1e-150,
        "b.weight": torch.randn(8, dtype=torch.bfloat16),
    }
    report = audit(tensors)
    layers = group_layers(report.tensors, report.findings, GroupBy(GroupMode.DEPTH, 1))
    by_name = {layer.name: layer for layer in layers}
    group_a = torch.cat([tensors[n].double().reshape(-1) for n in tensors if n.startswith("a.")])
    assert by_name["a"].norm == pytest.approx(float(group_a.norm()), rel=1e-12)
    assert by_name["a"].tensors == 3
    assert by_name["a"].max_abs == float(group_a.abs().max())
    assert by_name["b"].norm == pytest.approx(float(tensors["b.weight"].double().norm()), rel=1e-12)


def test_combine_norms_never_overflows() -> None:
    assert combine_norms([1e300, 1e300]) == pytest.approx(math.sqrt(2) * 1e300)
    assert combine_norms([3e-320, 4e-320]) == pytest.approx(5e-320, rel=1e-3)
    assert combine_norms([]) == 0.0


def test_layers_carry_their_members_findings() -> None:
    report = audit(
        {
            "a.x": torch.tensor([math.nan, 1.0]),
            "a.y": torch.full((4,), 1e-9),
            "a.z": torch.full((4,), 1e-9),
            "b.x": torch.ones(3),
        },
        thresholds=Thresholds(),
    )
    layers = group_layers(report.tensors, report.findings, GroupBy(GroupMode.MODULE))
    a, b = layers
    assert (a.name, a.tensors, a.nan, a.severity) == ("a", 3, 1, Severity.ERROR)
    assert a.kind_counts() == [(FindingKind.NAN, 1), (FindingKind.VANISHING, 2)]
    assert (b.name, b.severity, b.kind_counts()) == ("b", None, [])
