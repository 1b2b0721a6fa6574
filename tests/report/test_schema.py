"""The JSON document against its published JSON Schema (gradaudit/schema/report.schema.json)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import Report, Thresholds, audit
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.formats.json import SCHEMA_VERSION, json_schema
from tests.samples import headroom_memory_report, sample_report, two_file_report

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "gradaudit" / "schema" / "report.schema.json"


def reports(tmp_path: Path) -> list[Report]:
    files = two_file_report(tmp_path, Thresholds(max_global_norm=100.0, ignore=("*.bias",)))
    assert len(files.tensors) == 6  # the caller chdir'ed into tmp_path
    huge = torch.tensor([1.7e308, 1.7e308], dtype=torch.float64)  # norm overflows float64
    return [
        sample_report(),
        sample_report(Thresholds(max_global_norm=1.0, max_vanishing_fraction=0.0, ignore=("*",))),
        files,
        audit({}),
        audit({"huge": huge, "all_nan": torch.full((3,), math.nan)}),
        # A tensor that cannot be read is a skipped entry with its finding.
        audit({"w": torch.ones(2), "sparse": torch.ones(2).to_sparse(), "step": torch.tensor(1)}),
        headroom_report(),
    ]


def headroom_report() -> Report:
    """``scan --precision fp16``'s report: an underflow, an overflow, an all-zero tensor."""
    report = headroom_memory_report()
    assert report.headroom is not None
    assert {f.kind for f in report.headroom.findings} == {"underflow", "overflow"}
    return report


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def documents(tmp_path: Path) -> list[Any]:
    return [
        json.loads(render_text(r, OutputFormat.JSON, RenderOptions())) for r in reports(tmp_path)
    ]


def test_schema_file_is_the_one_the_package_ships() -> None:
    assert json_schema() == json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert json_schema()["properties"]["schema_version"] == {
        "const": SCHEMA_VERSION,
        "description": "Version of this document's layout.",
    }


def test_pyproject_ships_the_schema_as_package_data() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"schema/*.json"' in pyproject


def test_documents_validate_against_the_schema(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
    validator_class = jsonschema.Draft202012Validator
    validator_class.check_schema(json_schema())
    validator = validator_class(json_schema())
    for document in documents(tmp_path):
        errors = sorted(validator.iter_errors(document), key=str)
        assert not errors, errors[0]


def test_schema_rejects_what_it_should(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
    validator = jsonschema.Draft202012Validator(json_schema())
    document = documents(tmp_path)[0]
    bad_severity = json.loads(json.dumps(document))
    bad_severity["tensors"][0]["findings"] = [{"kind": "nan", "severity": "fatal", "message": ""}]
    undocumented = dict(document, surprise=1)
    nan_number = dict(document, elapsed_s="NaN")
    for bad in (bad_severity, undocumented, nan_number):
        assert not validator.is_valid(bad)


def _declared(schema: dict[str, Any], node: dict[str, Any], document: Any, where: str) -> None:
    """Every key of ``document`` is declared in ``node`` and every required key is present."""
    if "$ref" in node:
        name = node["$ref"].removeprefix("#/$defs/")
        node = schema["$defs"][name]
    if isinstance(document, dict) and "properties" in node:
        assert set(document) <= set(node["properties"]), f"undeclared keys at {where}"
        assert set(node.get("required", [])) <= set(document), f"missing keys at {where}"
        for key, value in document.items():
            _declared(schema, node["properties"][key], value, f"{where}.{key}")
    elif isinstance(document, list) and "items" in node:
        for index, item in enumerate(document):
            _declared(schema, node["items"], item, f"{where}[{index}]")


def test_every_field_is_documented_in_the_schema(tmp_path: Path) -> None:
    # Runs without jsonschema too: a field added to the JSON must be added to the schema.
    schema = json_schema()
    for document in documents(tmp_path):
        _declared(schema, schema, document, "$")


def test_ignored_tensors_stay_in_json_with_their_stats() -> None:
    report = sample_report(Thresholds(ignore=("*.key.bias",)))
    document = json.loads(
        render_text(dataclasses.replace(report), OutputFormat.JSON, RenderOptions())
    )
    (tensor,) = [t for t in document["tensors"] if t["name"].endswith("key.bias")]
    assert tensor["ignored_by"] == "*.key.bias"
    assert tensor["zeros"] == 8
    assert tensor["findings"] == [
        {"kind": "vanishing", "severity": "ignored", "message": tensor["findings"][0]["message"]}
    ]
    assert document["summary"]["ignored_findings"] == 1
    assert document["summary"]["vanishing_tensors"] == 0
    assert document["thresholds"]["ignore"] == ["*.key.bias"]
