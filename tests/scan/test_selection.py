"""--include / --exclude glob semantics on tensor names."""

from __future__ import annotations

from gradaudit.selection import NameFilter


def test_no_pattern_keeps_everything() -> None:
    keep = NameFilter()
    assert not keep.active
    assert keep("anything")
    assert keep("")


def test_star_matches_across_dots_and_exclude_beats_include() -> None:
    select = NameFilter(include=("model.*",), exclude=("*.bias",))
    assert select.active
    assert select("model.encoder.layers.0.weight")
    assert not select("model.encoder.layers.0.bias")
    assert not select("optimizer.state.0.exp_avg")


def test_several_patterns_case_and_character_classes() -> None:
    select = NameFilter(include=("a.*", "b.weight"))
    assert select("a.x")
    assert select("b.weight")
    assert not select("b.bias")
    assert not NameFilter(include=("Model.*",))("model.w")  # case-sensitive
    assert NameFilter(include=("w[[]0]",))("w[0]")  # [[] is a literal bracket
    assert NameFilter(exclude=("*",))("x") is False
