"""The comparison JSON document against its schema (gradaudit/schema/comparison.schema.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ComparePolicy, Comparison, Thresholds, compare
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.formats.json import COMPARISON_SCHEMA_VERSION, json_schema
from tests.report.test_schema import _declared
from tests.samples import gated_comparison, incomplete_comparison, sample_comparison

SCHEMA_FILE = (
    Path(__file__).resolve().parents[2] / "gradaudit" / "schema" / "comparison.schema.json"
)


def comparisons(directory: Path) -> list[Comparison]:
    """Every shape the document takes: failing, gated, incomplete, degenerate ratios."""
    huge = torch.tensor([1.7e308, 1.7e308], dtype=torch.float64)  # norm overflows float64
    return [
        sample_comparison(),
        gated_comparison(directory),
        gated_comparison(directory, Thresholds(max_vanishing_fraction=0.1), ComparePolicy()),
        incomplete_comparison(directory),
        compare({"w": torch.zeros(3)}, {"w": torch.ones(3)}),  # infinite ratios
        compare({"w": torch.ones(3)}, {"w": torch.zeros(3)}),  # zero ratios
        compare({"w": torch.zeros(3)}, {"w": torch.zeros(3)}),  # undefined ratios
        compare({"h": huge, "x": torch.full((2,), math.inf)}, {"s": torch.ones(2)}),
    ]


@pytest.fixture
def documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    monkeypatch.chdir(tmp_path)
    return [
        json.loads(render_text(c, OutputFormat.JSON, RenderOptions()))
        for c in comparisons(tmp_path)
    ]


def test_schema_file_is_the_one_the_package_ships() -> None:
    schema = json_schema("comparison")
    assert schema == json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert schema["properties"]["schema_version"]["const"] == COMPARISON_SCHEMA_VERSION
    assert schema["properties"]["kind"] == {
        "const": "comparison",
        "description": "Tells a comparison from a scan report.",
    }


def test_shared_parts_match_the_report_schema() -> None:
    # The same policy object and number encodings as a scan report, written out in each file
    # so that each schema stands alone; they must not drift apart.
    report, comparison = json_schema(), json_schema("comparison")
    assert comparison["properties"]["thresholds"] == {
        **report["properties"]["thresholds"],
        "description": comparison["properties"]["thresholds"]["description"],
    }
    for name in ("count", "float", "nullable_float", "finding_kind"):
        assert comparison["$defs"][name] == report["$defs"][name]


def test_documents_validate_against_the_schema(documents: list[Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
    validator_class = jsonschema.Draft202012Validator
    validator_class.check_schema(json_schema("comparison"))
    validator = validator_class(json_schema("comparison"))
    for document in documents:
        errors = sorted(validator.iter_errors(document), key=str)
        assert not errors, errors[0]


def test_the_documents_cover_every_branch(documents: list[Any]) -> None:
    ratios = {json.dumps(d["dual"]["normalized_ratio"]) for d in documents}
    assert {"null", '"Infinity"', "0.0"} <= ratios
    assert any(d["limits"] for d in documents)
    assert any(d["errors"] for d in documents)
    assert any(d["parameters"] is None for d in documents)
    assert any(d["parameters"] and d["parameters"]["mismatches"] for d in documents)
    assert any(s["side"] is None for d in documents for s in d["skipped"])
    severities = {f["severity"] for d in documents for f in d["tensor_findings"]}
    assert severities == {"error", "warning", "ignored"}
    assert {d["exit_code"] for d in documents} == {0, 1, 3}


def test_schema_rejects_what_it_should(documents: list[Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
    validator = jsonschema.Draft202012Validator(json_schema("comparison"))
    document = documents[0]
    bad_ratio = json.loads(json.dumps(document))
    bad_ratio["dual"]["normalized_ratio"] = "NaN"  # a ratio is a number, Infinity or null
    bad_side = json.loads(json.dumps(document))
    bad_side["tensor_findings"][0]["side"] = "both"
    bad_change = json.loads(json.dumps(document))
    bad_change["parameters"]["changes"][0]["surprise"] = 1
    report_kind = dict(document, kind="report")
    undocumented = dict(document, surprise=1)
    assert validator.is_valid(document)
    for bad in (bad_ratio, bad_side, bad_change, report_kind, undocumented):
        assert not validator.is_valid(bad)


def test_every_field_is_documented_in_the_schema(documents: list[Any]) -> None:
    # Runs without jsonschema too: a field added to the JSON must be added to the schema.
    schema = json_schema("comparison")
    for document in documents:
        _declared(schema, schema, document, "$")
