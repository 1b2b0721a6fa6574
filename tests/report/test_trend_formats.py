"""``gradaudit trend`` as first-class as scan and compare: every format, ``--output``,
``--quiet``, the JSON Schema (gradaudit/schema/trend.schema.json)."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fixtures.make_series import (
    COLLAPSE_LAYER,
    FIRST_NAN_STEP,
    SPIKE_LAYER,
    SPIKE_STEP,
)
from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.formats.json import TREND_SCHEMA_VERSION, json_schema
from gradaudit.results.trend import TrendPolicy, TrendReport
from gradaudit.trend.builder import trend_paths
from tests.conftest import runner
from tests.report.test_schema import _declared

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "gradaudit" / "schema" / "trend.schema.json"


def trend(*args: str) -> Any:
    return runner.invoke(
        app, ["trend", *args, "--no-config"], env={"COLUMNS": "100", "NO_COLOR": "1"}
    )


def reports(series: Path, tmp_path: Path) -> list[TrendReport]:
    """Every shape the document takes: findings of each kind, input errors, nothing audited,
    and values JSON cannot carry as numbers."""
    odd = tmp_path / "odd"
    odd.mkdir()
    for step in range(3):
        save_file(
            {"w": torch.tensor([math.inf, 1.0]) if step else torch.ones(2)},
            str(odd / f"s_{step}.safetensors"),
        )
    empty = tmp_path / "empty_1.safetensors"
    save_file({"step": torch.tensor(1)}, str(empty))
    return [
        trend_paths([series]),
        trend_paths([series], policy=TrendPolicy(fail_on=frozenset())),
        trend_paths([series, tmp_path / "missing_7.safetensors"]),
        trend_paths([odd]),
        trend_paths([empty]),
    ]


@pytest.fixture
def documents(series: Path, tmp_path: Path) -> list[Any]:
    return [
        json.loads(render_text(r, OutputFormat.JSON, RenderOptions()))
        for r in reports(series, tmp_path)
    ]


def test_schema_file_is_the_one_the_package_ships() -> None:
    schema = json_schema("trend")
    assert schema == json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert schema["properties"]["schema_version"]["const"] == TREND_SCHEMA_VERSION
    report = json_schema("report")
    for name in ("count", "float", "nullable_float"):
        assert schema["$defs"][name] == report["$defs"][name]


def test_documents_validate_against_the_schema(documents: list[Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
    jsonschema.Draft202012Validator.check_schema(json_schema("trend"))
    validator = jsonschema.Draft202012Validator(json_schema("trend"))
    for document in documents:
        errors = sorted(validator.iter_errors(document), key=str)
        assert not errors, errors[0]
    undocumented = dict(documents[0], surprise=1)
    wrong_kind = json.loads(json.dumps(documents[0]))
    wrong_kind["findings"][0]["kind"] = "nan"
    assert not validator.is_valid(undocumented)
    assert not validator.is_valid(wrong_kind)


def test_the_documents_cover_every_branch(documents: list[Any]) -> None:
    assert {d["exit_code"] for d in documents} == {0, 1, 3}
    assert {f["kind"] for d in documents for f in d["findings"]} == {
        "nonfinite",
        "spike",
        "collapse",
    }
    assert {f["severity"] for d in documents for f in d["findings"]} == {"error", "warning"}
    assert any(d["errors"] for d in documents)
    assert any(not d["steps"] or not any(s["tensors"] for s in d["steps"]) for d in documents)
    assert any(s["global_norm"] is None for d in documents for s in d["steps"])
    assert {d["group_by"]["mode"] for d in documents} == {"module", "auto"}


def test_every_field_is_documented_in_the_schema(documents: list[Any]) -> None:
    # Runs without jsonschema too: a field added to the JSON must be added to the schema.
    schema = json_schema("trend")
    for document in documents:
        _declared(schema, schema, document, "$")


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_format_through_the_cli(series: Path, fmt: OutputFormat) -> None:
    result = trend(str(series), "--format", fmt.value)
    assert result.exit_code == ExitCode.FINDINGS, result.output
    assert result.stdout.endswith("\n")
    assert SPIKE_LAYER in result.stdout
    assert COLLAPSE_LAYER in result.stdout


def test_markdown_github_junit_say_what_failed(series: Path) -> None:
    report = trend_paths([series])
    markdown = render_text(report, OutputFormat.MARKDOWN)
    assert markdown.startswith(
        "### ❌ gradaudit trend: FAIL: 2 failing findings (nonfinite, spike)"
    )
    assert f"- ❌ **spike** in `{SPIKE_LAYER}`:" in markdown
    assert f"- ⚠️ **collapse** in `{COLLAPSE_LAYER}`:" in markdown
    github = render_text(report, OutputFormat.GITHUB).splitlines()
    spike = next(line for line in github if "spike in" in line)
    assert spike.startswith(f"::error file={series / f'step_{SPIKE_STEP}.safetensors'},")
    assert any(line.startswith("::warning ") and "collapse" in line for line in github)
    assert github[-1].startswith("gradaudit trend: FAIL")
    root = ET.fromstring(render_text(report, OutputFormat.JUNIT))
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("3", "2", "0")
    cases = {case.get("name"): case for case in root.iter("testcase")}
    assert cases["nonfinite"].find("failure") is not None
    assert f"step {FIRST_NAN_STEP}" in (cases["nonfinite"].find("failure").text or "")
    assert cases["collapse"].find("failure") is None
    assert "warning" in (cases["collapse"].findtext("system-out") or "")


def test_an_unreadable_dump_is_an_error_in_every_format(series: Path, tmp_path: Path) -> None:
    missing = tmp_path / "step_5000.safetensors"
    report = trend_paths([series, missing])
    assert f"- ❌ `{missing}`" in render_text(report, OutputFormat.MARKDOWN)
    assert f"::error file={missing}," in render_text(report, OutputFormat.GITHUB)
    root = ET.fromstring(render_text(report, OutputFormat.JUNIT))
    (suite,) = [s for s in root.iter("testsuite") if s.get("name") == str(missing)]
    assert suite.find("testcase/error") is not None


def test_quiet_shows_only_findings(series: Path) -> None:
    result = trend(str(series), "--quiet")
    assert result.exit_code == ExitCode.FINDINGS
    kinds = [line.split(" in ")[0] for line in result.stdout.splitlines() if " in " in line]
    assert kinds == ["nonfinite", "spike", "collapse"]
    assert "Trend over" not in result.stdout


def test_quiet_is_empty_when_healthy(tmp_path: Path) -> None:
    for step in range(4):
        save_file({"w": torch.ones(3)}, str(tmp_path / f"s_{step}.safetensors"))
    for fmt in ("table", "markdown", "github"):
        result = trend(str(tmp_path), "--quiet", "-f", fmt)
        assert result.exit_code == ExitCode.OK, result.output
        assert result.stdout == "", fmt


def test_output_writes_the_file_and_says_so(series: Path, tmp_path: Path) -> None:
    target = tmp_path / "trend.json"
    result = trend(str(series), "-f", "json", "-o", str(target))
    assert result.exit_code == ExitCode.FINDINGS
    assert result.stdout == ""
    assert f"wrote json trend to {target}" in result.stderr
    assert json.loads(target.read_text(encoding="utf-8"))["command"] == "trend"


def test_output_refuses_a_dump(series: Path) -> None:
    dump = series / f"step_{SPIKE_STEP}.safetensors"
    before = dump.read_bytes()
    result = trend(str(series), "-o", str(dump))
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "gradaudit never writes to inputs" in result.stderr
    assert dump.read_bytes() == before


# -- inputs are found as scan finds them (gradaudit.io.discover) ----------------------------


def _dump(path: Path, scale: float = 1.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.full((3,), scale)}, str(path))


def test_a_dump_reached_twice_is_read_once(tmp_path: Path) -> None:
    for step in range(3):
        _dump(tmp_path / "d" / f"step_{step}.safetensors")
    link = tmp_path / "step_2.safetensors"
    link.symlink_to(tmp_path / "d" / "step_2.safetensors")
    report = trend_paths([tmp_path / "d", tmp_path / "d" / "step_0.safetensors", link])
    assert [s.step for s in report.steps] == [0, 1, 2]
    assert report.errors == ()  # not "step 2 is already taken"


def test_hidden_directories_are_never_searched_and_subdirectories_only_recursively(
    tmp_path: Path,
) -> None:
    _dump(tmp_path / "step_0.safetensors")
    _dump(tmp_path / "step_1.safetensors")
    _dump(tmp_path / ".cache" / "step_5.safetensors")
    _dump(tmp_path / "later" / "step_2.safetensors")
    assert [s.step for s in trend_paths([tmp_path]).steps] == [0, 1]
    assert [s.step for s in trend_paths([tmp_path], recursive=True).steps] == [0, 1, 2]
    result = trend(str(tmp_path), "--recursive", "-f", "json")
    assert result.exit_code == ExitCode.OK, result.output
    assert [s["step"] for s in json.loads(result.stdout)["steps"]] == [0, 1, 2]


def test_companion_files_are_passed_over(tmp_path: Path) -> None:
    for step in range(3):
        _dump(tmp_path / f"step_{step}.safetensors")
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    report = trend_paths([tmp_path])
    assert [s.step for s in report.steps] == [0, 1, 2]
    assert report.errors == ()
