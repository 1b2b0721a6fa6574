"""Markdown, GitHub and JUnit output: golden files, escaping of hostile names, structure."""

from __future__ import annotations

import dataclasses
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradaudit import Report, Thresholds, audit
from gradaudit.policy import parse_fail_on
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.base import MAX_FLAGGED_ROWS
from gradaudit.report.formats.github import command, escape_data, escape_property
from gradaudit.report.formats.markdown import code, escape
from tests.conftest import runner
from tests.samples import sample_report, two_file_report

Golden = Callable[[str, str], None]
LIMITS = Thresholds(max_global_norm=100.0, max_vanishing_fraction=0.3, ignore=("*.bias",))
SUFFIX = {
    OutputFormat.TABLE: "txt",
    OutputFormat.JSON: "json",
    OutputFormat.MARKDOWN: "md",
    OutputFormat.GITHUB: "txt",
    OutputFormat.JUNIT: "xml",
}


@pytest.fixture
def two_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Report:
    monkeypatch.chdir(tmp_path)
    return two_file_report(tmp_path, LIMITS)


@pytest.mark.parametrize("fmt", [f for f in OutputFormat if f is not OutputFormat.TABLE])
def test_sample_golden(fmt: OutputFormat, golden: Golden) -> None:
    text = render_text(sample_report(), fmt, RenderOptions(width=120))
    golden(f"{fmt.value}_sample.{SUFFIX[fmt]}", text)


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_two_files_with_limits_ignores_and_a_broken_input_golden(
    fmt: OutputFormat, two_files: Report, golden: Golden
) -> None:
    text = render_text(two_files, fmt, RenderOptions(width=160))
    golden(f"{fmt.value}_two_files.{SUFFIX[fmt]}", text)


@pytest.mark.parametrize("fmt", [OutputFormat.TABLE, OutputFormat.MARKDOWN, OutputFormat.GITHUB])
def test_quiet_golden(fmt: OutputFormat, golden: Golden) -> None:
    text = render_text(sample_report(), fmt, RenderOptions(width=120, quiet=True))
    golden(f"{fmt.value}_quiet.{SUFFIX[fmt]}", text)


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_quiet_healthy_prints_nothing_for_people_formats(fmt: OutputFormat) -> None:
    report = audit({"w": torch.ones(3)})
    text = render_text(report, fmt, RenderOptions(quiet=True))
    if fmt in (OutputFormat.JSON, OutputFormat.JUNIT):
        assert text.strip()  # data formats are always complete documents
    else:
        assert text == ""


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_quiet_keeps_every_finding(fmt: OutputFormat) -> None:
    text = render_text(sample_report(), fmt, RenderOptions(width=200, quiet=True))
    for name in (
        "encoder.layer.0.output.dense.weight",
        "encoder.layer.1.output.dense.weight",
        "encoder.layer.0.attention.self.key.bias",
    ):
        assert name in text
    if fmt is not OutputFormat.JSON:
        assert "decoder.bias" not in text  # healthy tensors are not findings


# --- markdown -------------------------------------------------------------------------


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of every GFM table row, split the way GitHub splits them (on unescaped |)."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            rows.append([cell.strip() for cell in cells])
    return rows


def test_markdown_names_cannot_break_the_table() -> None:
    names = ["a|b", "back`tick", "``fence", "<script>x</script>", "new\nline", "**bold**"]
    report = audit({name: torch.tensor([math.nan]) for name in names})
    text = render_text(report, OutputFormat.MARKDOWN, RenderOptions())
    rows = table_rows(text)
    assert len(rows) == 2 + len(names)
    assert {len(row) for row in rows} == {7}
    assert "\n" not in "".join(row[0] for row in rows)
    assert "`a\\|b`" in text
    assert "``back`tick``" in text
    assert "``` ``fence ```" in text
    assert "`new\\x0aline`" in text


def test_markdown_code_and_escape_helpers() -> None:
    assert code("plain.name") == "`plain.name`"
    assert code("`x`") == "`` `x` ``"
    assert escape("a_b *c* <d> [e](f) | g") == "a\\_b \\*c\\* \\<d> \\[e\\](f) \\| g"


def test_markdown_caps_flagged_rows_unless_all() -> None:
    grads = {f"p{i:03d}": torch.tensor([math.nan]) for i in range(MAX_FLAGGED_ROWS + 7)}
    report = audit(grads)
    capped = render_text(report, OutputFormat.MARKDOWN, RenderOptions())
    assert len(table_rows(capped)) == 2 + MAX_FLAGGED_ROWS
    assert "… 7 more flagged tensors not shown (--all or --format json lists every one)" in capped
    everything = render_text(report, OutputFormat.MARKDOWN, RenderOptions(show_all=True))
    assert len(table_rows(everything)) == 2 + MAX_FLAGGED_ROWS + 7


def test_markdown_verdicts() -> None:
    ok = render_text(audit({"w": torch.ones(2)}), OutputFormat.MARKDOWN, RenderOptions())
    assert ok.startswith("### ✅ gradaudit: OK: no failing findings\n")
    warn = render_text(audit({"w": torch.zeros(2)}), OutputFormat.MARKDOWN, RenderOptions())
    assert warn.startswith("### ✅ gradaudit: OK: no failing findings (1 warning)\n")
    assert "⚠️ vanishing" in warn
    empty = render_text(audit({}), OutputFormat.MARKDOWN, RenderOptions())
    assert empty.startswith("### ❌ gradaudit: INCOMPLETE: nothing to audit")


# --- github ---------------------------------------------------------------------------


def test_github_escaping_follows_the_actions_toolkit() -> None:
    assert escape_data("50% done\r\nnext") == "50%25 done%0D%0Anext"
    assert escape_data("a:b,c") == "a:b,c"
    assert escape_property("50%,x:y\r\nz") == "50%25%2Cx%3Ay%0D%0Az"
    assert escape_property("%3A") == "%253A"  # % first, so an escape is never doubled-decoded
    assert command("warning", "m", file="f,1", title="t:2") == "::warning file=f%2C1,title=t%3A2::m"
    assert command("error", "only a message") == "::error::only a message"


def test_github_hostile_names_cannot_inject_commands() -> None:
    names = [
        "x\n::set-env name=PATH::/evil",
        "y\r\n::add-mask::secret",
        "z::error::fake",
        "pct%0Aencoded",
        "comma,colon:name",
    ]
    report = audit({name: torch.tensor([math.nan]) for name in names})
    lines = render_text(report, OutputFormat.GITHUB, RenderOptions()).splitlines()
    assert len(lines) == len(names) + 1
    commands = [line for line in lines if line.startswith("::")]
    assert len(commands) == len(names)
    assert all(line.startswith("::error title=") for line in commands)
    assert not any("::set-env" in line.split("::", 2)[1] for line in commands)
    joined = "\n".join(lines)
    assert "pct%250Aencoded" in joined  # a literal %0A in a name stays literal
    assert "comma%2Ccolon%3Aname" in joined  # in the title property
    assert "comma,colon:name: 1 NaN" in joined  # in the message, only % CR LF are escaped


def test_github_orders_errors_before_warnings_and_skips_ignored() -> None:
    grads = {"a.bias": torch.zeros(2), "b.weight": torch.tensor([math.nan]), "c": torch.zeros(2)}
    report = audit(grads, thresholds=Thresholds(ignore=("c",)))
    lines = render_text(report, OutputFormat.GITHUB, RenderOptions()).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("::error title=gradaudit%3A nan in b.weight::")
    assert lines[1].startswith("::warning title=gradaudit%3A vanishing in a.bias::")
    assert lines[2].startswith("gradaudit: FAIL: 1 failing finding (nan) · Audited 3 tensors")


def test_github_nothing_to_audit_is_an_error_annotation() -> None:
    lines = render_text(
        audit({"step": torch.tensor(1)}), OutputFormat.GITHUB, RenderOptions(quiet=True)
    )
    assert lines == (
        "::error title=gradaudit%3A nothing to audit::"
        "nothing to audit: no floating-point tensor found\n"
    )


# --- junit ----------------------------------------------------------------------------


def test_junit_has_a_case_per_file_and_check(two_files: Report) -> None:
    root = ET.fromstring(render_text(two_files, OutputFormat.JUNIT, RenderOptions()))
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert list(suites) == ["step1.safetensors", "step2.safetensors", "broken.safetensors"]
    checks = ["nan", "inf", "exploding", "vanishing", "global-norm", "vanishing-fraction"]
    for name in ("step1.safetensors", "step2.safetensors"):
        assert [c.get("name") for c in suites[name].iter("testcase")] == checks
    failed = {
        (c.get("classname"), c.get("name"))
        for c in root.iter("testcase")
        if c.find("failure") is not None
    }
    assert failed == {
        ("step1.safetensors", "nan"),
        ("step2.safetensors", "exploding"),
        ("step2.safetensors", "global-norm"),
    }
    (broken,) = suites["broken.safetensors"].iter("testcase")
    error = broken.find("error")
    assert error is not None
    assert "header length" in (error.get("message") or "")
    assert root.get("tests") == "13"
    assert root.get("failures") == "3"
    assert root.get("errors") == "1"


def test_junit_without_limits_has_four_checks_and_warnings_pass() -> None:
    report = audit({"w": torch.zeros(3)})
    root = ET.fromstring(render_text(report, OutputFormat.JUNIT, RenderOptions()))
    cases = list(root.iter("testcase"))
    assert [c.get("name") for c in cases] == ["nan", "inf", "exploding", "vanishing"]
    vanishing = cases[3]
    assert vanishing.find("failure") is None
    out = vanishing.find("system-out")
    assert out is not None
    assert (out.text or "").startswith("warning: w: norm 0")
    strict = audit({"w": torch.zeros(3)}, thresholds=Thresholds(fail_on=parse_fail_on("all")))
    strict_root = ET.fromstring(render_text(strict, OutputFormat.JUNIT, RenderOptions()))
    assert strict_root.get("failures") == "1"


def test_junit_nothing_to_audit_is_an_error() -> None:
    root = ET.fromstring(
        render_text(audit({"step": torch.tensor(3)}), OutputFormat.JUNIT, RenderOptions())
    )
    assert root.get("errors") == "1"
    (case,) = root.iter("testcase")
    assert case.get("name") == "audit"


def test_junit_is_well_formed_whatever_the_names() -> None:
    names = ["amp&<lt>\"quote'", "esc\x1b[31m", "nul\x00byte", "bidi\u202eexe", "ffff\uffff"]
    report = audit({name: torch.tensor([math.nan]) for name in names})
    text = render_text(report, OutputFormat.JUNIT, RenderOptions())
    root = ET.fromstring(text)  # raises on invalid XML (control characters included)
    failure = next(root.iter("failure"))
    body = failure.text or ""
    assert "amp&<lt>\"quote'" in body
    assert "esc\\x1b[31m" in body
    assert "nul\\x00byte" in body
    assert "bidi\\u202eexe" in body


# --- every format ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_format_reports_input_errors_and_limits(fmt: OutputFormat, two_files: Report) -> None:
    text = render_text(two_files, fmt, RenderOptions(width=200))
    assert "broken.safetensors" in text
    assert "global" in text
    assert "step2.safetensors" in text


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_format_is_deterministic(fmt: OutputFormat) -> None:
    first = render_text(sample_report(), fmt, RenderOptions())
    second = render_text(dataclasses.replace(sample_report()), fmt, RenderOptions())
    assert first == second


def test_table_marks_ignored_tensors() -> None:
    report = sample_report(Thresholds(ignore=("*.key.bias",)))
    text = render_text(report, OutputFormat.TABLE, RenderOptions(width=200))
    row = next(line for line in text.splitlines() if "key.bias" in line)
    assert "vanishing (ignored)" in row
    assert "ignored findings 1" in text


def test_every_format_says_when_a_file_was_read_on_thin_evidence(tmp_path: Path) -> None:
    """The table printed "read as gradients (thin evidence) … --kind weights"; github,
    markdown and junit dropped it, so CI showed bare "exploding" errors (issue 26)."""
    from safetensors.torch import save_file

    from gradaudit.cli import app

    path = tmp_path / "flat.safetensors"
    save_file({"w": torch.full((4, 4), 500.0)}, str(path))
    for fmt in ("table", "markdown", "github", "junit"):
        result = runner.invoke(
            app, ["scan", str(path), "--format", fmt, "--no-config"], env={"COLUMNS": "200"}
        )
        assert "(thin evidence)" in result.stdout, fmt
        assert "--kind weights" in result.stdout, fmt
    github = runner.invoke(app, ["scan", str(path), "--format", "github", "--no-config"])
    assert github.stdout.startswith("::notice file=")
