"""Comparison renderers: the format map is exhaustive, JSON is strict, the table is golden."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradaudit import Thresholds, compare
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.compare_text import interpretation
from tests.samples import sample_comparison


def strict(text: str) -> Any:
    return json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard {token}"))


def test_every_output_format_has_a_comparison_formatter() -> None:
    comparison = sample_comparison()
    for fmt in OutputFormat:
        text = render_text(comparison, fmt, RenderOptions())
        assert text.endswith("\n")
        assert "decoder.bias" in text


def test_comparison_table_golden(golden: Callable[[str, str], None]) -> None:
    text = render_text(
        sample_comparison(), OutputFormat.TABLE, RenderOptions(width=120, color=False)
    )
    golden("compare_table_120.txt", text)


def test_comparison_table_colour_only_when_asked() -> None:
    comparison = sample_comparison()
    assert "\x1b" not in render_text(comparison, OutputFormat.TABLE, RenderOptions(color=False))
    assert "\x1b[" in render_text(comparison, OutputFormat.TABLE, RenderOptions(color=True))


def test_top_and_all_choose_the_unflagged_rows() -> None:
    a = {f"p{i:02d}": torch.ones(4) for i in range(30)}
    b = {f"p{i:02d}": torch.full((4,), 1.0 + i / 100) for i in range(30)}
    c = compare(a, b)
    top = render_text(c, OutputFormat.TABLE, RenderOptions(top=3))
    rows = "\n".join(line for line in top.splitlines() if line.startswith("│"))
    assert [f"p{i:02d}" for i in range(30) if f"p{i:02d} " in rows] == ["p27", "p28", "p29"]
    assert "first differing tensor: p01 (29 of 30 shared tensors differ)" in top
    assert "27 more shared tensors not shown" in top
    everything = render_text(c, OutputFormat.TABLE, RenderOptions(show_all=True))
    assert all(f"p{i:02d} " in everything for i in range(30))


def test_json_document() -> None:
    doc = strict(render_text(sample_comparison(), OutputFormat.JSON, RenderOptions()))
    assert doc["kind"] == "comparison"
    assert doc["schema_version"] == 1
    assert set(doc["dual"]) >= {
        "host_norm",
        "seed_norm",
        "host_params",
        "seed_params",
        "raw_ratio",
        "normalized_ratio",
    }
    assert doc["dual"]["normalized_ratio"] is None  # NaN on the host side
    assert "NaN/Inf on the host side" in doc["dual"]["ratio_note"]
    assert doc["interpretation"].startswith("ratio not computed")
    params = doc["parameters"]
    assert params["only_in_a"] == ["old.adapter"]
    assert params["only_in_b"] == ["new.adapter"]
    assert [m["differs"] for m in params["mismatches"]] == [["dtype"], ["shape"]]
    changes = {c["name"]: c for c in params["changes"]}
    assert changes["encoder.layer.0.output.dense.weight"]["ratio"] == 40.0
    assert changes["encoder.layer.0.output.dense.weight"]["flagged"] is True
    assert changes["encoder.layer.1.output.dense.weight"]["note"] == "NaN/Inf in A"
    assert "pooler.weight" not in changes
    assert {f["kind"] for f in doc["findings"]} == {
        "ratio_not_computed",
        "large_change",
        "mismatch",
    }
    assert doc["tensor_findings"] == [
        {
            "side": "host",
            "tensor": "encoder.layer.1.output.dense.weight",
            "kind": "nan",
            "severity": "error",
            "message": "1 NaN of 3 elements",
        }
    ]
    assert doc["skipped"][0] == {
        "side": "host",
        "name": "step",
        "reason": "dtype int64 is not floating-point; not audited",
    }
    assert doc["policy"]["max_ratio"] == 100.0
    assert doc["exit_code"] == 1


def test_json_writes_an_infinite_ratio_as_a_string() -> None:
    c = compare({"h": torch.zeros(3)}, {"s": torch.ones(3)}, thresholds=Thresholds())
    doc = strict(render_text(c, OutputFormat.JSON, RenderOptions()))
    assert doc["dual"]["raw_ratio"] == "Infinity"
    assert doc["dual"]["normalized_ratio"] == "Infinity"
    assert doc["findings"][0]["kind"] == "zero_host_norm"
    assert doc["exit_code"] == 0


@pytest.mark.parametrize(
    ("host", "seed", "sentence"),
    [
        (torch.ones(4), torch.full((4,), 5.2), "seed gradients are 5.2× as intense per parameter"),
        (torch.ones(4), torch.full((4,), 0.25), "0.25× as intense per parameter as the host's (4×"),
        (torch.zeros(4), torch.ones(4), "host gradients are zero"),
        (torch.ones(4), torch.zeros(4), "seed gradients are zero: the seed receives no gradient"),
        (torch.zeros(4), torch.zeros(4), "ratio not computed: both gradient norms are 0"),
    ],
)
def test_interpretation(host: torch.Tensor, seed: torch.Tensor, sentence: str) -> None:
    assert sentence in interpretation(compare({"h": host}, {"s": seed}).dual)
