"""``scan --precision`` in the Markdown, GitHub and JUnit formats: the one ``Report.headroom``
rendered in each, golden files, and what each shows of a passing and a failing cast."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradaudit import Report, Thresholds
from gradaudit.precision.formats import Precision
from gradaudit.precision.judging import IN_MEMORY
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.scan.judge import with_headroom
from gradaudit.scan.pending import PendingStats
from tests.samples import LONG_NAME, headroom_files_report, headroom_memory_report

Golden = Callable[[str, str], None]
PEOPLE = [OutputFormat.MARKDOWN, OutputFormat.GITHUB, OutputFormat.JUNIT]
SUFFIX = {OutputFormat.MARKDOWN: "md", OutputFormat.GITHUB: "txt", OutputFormat.JUNIT: "xml"}
IGNORE_BIAS = Thresholds(ignore=("*.bias",))


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Report:
    monkeypatch.chdir(tmp_path)
    return headroom_files_report(tmp_path, IGNORE_BIAS)


def healthy() -> Report:
    """Every value survives fp16: the headroom passes."""
    pending = PendingStats(histograms=True)
    pending.add_all({"w": torch.tensor([0.25, 1.0, -3.0])})
    return with_headroom(pending.materialize(), Precision.FP16)


def render(report: Report, fmt: OutputFormat, **options: object) -> str:
    return render_text(report, fmt, RenderOptions(width=80, **options))  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", PEOPLE)
def test_memory_golden(fmt: OutputFormat, golden: Golden) -> None:
    golden(f"headroom_memory.{SUFFIX[fmt]}", render(headroom_memory_report(), fmt))


@pytest.mark.parametrize("fmt", PEOPLE)
def test_two_files_golden(fmt: OutputFormat, files: Report, golden: Golden) -> None:
    golden(f"headroom_two_files.{SUFFIX[fmt]}", render(files, fmt))


def test_markdown_lists_the_table_rows_marked_and_the_whole_run_last() -> None:
    report = headroom_memory_report()
    text = render(report, OutputFormat.MARKDOWN)
    assert "**Headroom in fp16**: normal from 6.1e-05" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "2^" in line]
    # The flagged tensor, marked failing and never shortened; the whole run last.
    assert rows[0].startswith(f"| ❌ `{LONG_NAME}` | 3 | 33.3% | 0 | 33.3% | -30..16 |")
    assert rows[-1].startswith("| **(all tensors)** | 4 |")
    assert f"- ❌ `{LONG_NAME}`: underflow: 33.3% of 3 non-zero values flush" in text
    assert f"- ❌ `{LONG_NAME}`: overflow: 1 value overflows fp16 (Inf)" in text


def test_markdown_top_and_all_choose_the_rows_as_the_table_format_does() -> None:
    pending = PendingStats(histograms=True)
    pending.add_all({f"layer.{i}.weight": torch.full((4,), 2.0**-i) for i in range(0, 30, 2)})
    report = with_headroom(pending.materialize(), Precision.FP16)
    assert report.headroom is not None
    assert len(report.headroom.findings) == 2

    def listed(**options: object) -> list[str]:
        section = render(report, OutputFormat.MARKDOWN, **options).split("**Headroom in")[1]
        rows = [line for line in section.splitlines() if line.startswith("| ")]
        return [line.split("`")[1] for line in rows if "`layer." in line]

    # The 3 with the largest flushed, then subnormal, fraction (the first of equals), in
    # model order: the table format's choice.
    assert listed(top=3) == ["layer.16.weight", "layer.26.weight", "layer.28.weight"]
    assert "… and 12 more tensors (--all lists every one)" in render(
        report, OutputFormat.MARKDOWN, top=3
    )
    assert len(listed(show_all=True)) == 15
    assert "more tensors" not in render(report, OutputFormat.MARKDOWN, show_all=True)


def test_markdown_ignored_headroom_finding_has_no_failing_mark(files: Report) -> None:
    text = render(files, OutputFormat.MARKDOWN)
    assert "| `step2.safetensors` | `model.0.bias` | 4 | 100.0% |" in text  # ignored: no ❌
    assert "- `model.0.bias` in `step2.safetensors`: underflow: 100.0% of 4" in text


@pytest.mark.parametrize("fmt", [OutputFormat.MARKDOWN, OutputFormat.GITHUB])
def test_quiet_healthy_headroom_prints_nothing(fmt: OutputFormat) -> None:
    assert render(healthy(), fmt, quiet=True) == ""
    assert "fp16" in render(healthy(), fmt)


def test_markdown_quiet_keeps_the_flagged_rows_and_findings_only() -> None:
    text = render(headroom_memory_report(), OutputFormat.MARKDOWN, quiet=True)
    assert f"| ❌ `{LONG_NAME}` |" in text
    assert "(all tensors)" not in text
    assert "`c`" not in text
    assert "overflow: 1 value overflows fp16" in text


def test_markdown_passing_headroom_says_so() -> None:
    text = render(healthy(), OutputFormat.MARKDOWN)
    assert "✅ No tensor loses more than 0.01 of its values to underflow in fp16" in text


def test_github_one_annotation_per_finding_on_its_file_and_a_summary_notice(
    files: Report,
) -> None:
    lines = render(files, OutputFormat.GITHUB).splitlines()
    cast = [line for line in lines if "fp16 headroom" in line]
    # The bias is ignored: not annotated. Nothing else flushes: no annotation at all.
    assert cast == []
    report = headroom_memory_report()
    lines = render(report, OutputFormat.GITHUB).splitlines()
    errors = [line for line in lines if line.startswith("::error") and "headroom" in line]
    assert [line.split("::")[2].split(": fp16 headroom: ")[0] for line in errors] == [
        LONG_NAME,
        LONG_NAME,
    ]
    assert "flush to zero in fp16" in errors[0]
    assert "1 value overflows fp16 (Inf)" in errors[1]
    notice = [line for line in lines if line.startswith("::notice title=gradaudit%3A headroom")]
    assert notice == [
        "::notice title=gradaudit%3A headroom in fp16::(all tensors): 4 non-zero values: "
        "25.0%25 flush to zero, 0 subnormal, 25.0%25 overflow; log2|x| -30..16; scale 2^-1 · "
        "1 tensor would not survive the cast (--max-underflow 0.01, any overflow fails)"
    ]
    assert lines[-1].startswith("gradaudit: FAIL")
    quiet = render(report, OutputFormat.GITHUB, quiet=True)
    assert "headroom in fp16::" not in quiet
    assert quiet.count("fp16 headroom") == 2


def test_github_notice_of_a_passing_headroom() -> None:
    text = render(healthy(), OutputFormat.GITHUB)
    assert "every tensor survives the cast" in text
    assert "::error" not in text


def _cases(text: str, check: str) -> dict[str, ET.Element]:
    root = ET.fromstring(text.split("\n", 1)[1])
    return {
        suite.get("name", ""): case
        for suite in root.iter("testsuite")
        for case in suite.iter("testcase")
        if case.get("name") == check
    }


def test_junit_cast_case_is_in_every_suite_with_the_files_headroom(files: Report) -> None:
    cases = _cases(render(files, OutputFormat.JUNIT), "cast")
    assert set(cases) == {"step1.safetensors", "step2.safetensors"}  # broken: a read error
    for case in cases.values():
        assert case.find("failure") is None  # step2's bias is ignored
    step1 = cases["step1.safetensors"].findtext("system-out") or ""
    assert step1.startswith("fp16 headroom of this file: 19 non-zero values: 0 flush to zero")
    step2 = cases["step2.safetensors"].findtext("system-out") or ""
    # 4 of 24: the ignored bias is counted all the same (ignoring judges, it does not hide).
    assert step2.startswith("fp16 headroom of this file: 24 non-zero values: 16.7% flush")
    assert "ignored (*.bias): model.0.bias: fp16 headroom: 100.0%" in step2


def test_junit_failures_are_the_tensors_that_would_not_survive() -> None:
    text = render(headroom_memory_report(), OutputFormat.JUNIT)
    case = _cases(text, "cast")["gradaudit"]
    failure = case.find("failure")
    assert failure is not None
    assert failure.get("message") == "cast: 2 failing findings"
    assert (failure.text or "").splitlines()[0].startswith(f"{LONG_NAME}: fp16 headroom: ")
    assert case.findtext("system-out") == (
        "fp16 headroom of this file: 4 non-zero values: 25.0% flush to zero, 0 subnormal, "
        "25.0% overflow; log2|x| -30..16; scale 2^-1"
    )


def test_junit_passing_headroom_is_a_passing_case() -> None:
    case = _cases(render(healthy(), OutputFormat.JUNIT), "cast")["gradaudit"]
    assert case.find("failure") is None
    assert "0 flush to zero, 0 subnormal, 0 overflow" in (case.findtext("system-out") or "")


def test_per_file_rows_add_up_to_the_whole_run(files: Report) -> None:
    headroom = files.headroom
    assert headroom is not None
    assert [row.name for row in headroom.files] == ["step1.safetensors", "step2.safetensors"]
    for field in ("nonzero", "flushed", "subnormal", "overflowed"):
        assert sum(getattr(row, field) for row in headroom.files) == getattr(headroom.total, field)
    assert min(r.scale_log2 for r in headroom.files if r.scale_log2 is not None) == (
        headroom.total.scale_log2
    )
    memory = headroom_memory_report().headroom
    assert memory is not None
    assert [row.name for row in memory.files] == [IN_MEMORY]


def test_renderers_do_not_recompute_the_headroom(files: Report) -> None:
    """Every format reads ``Report.headroom``: a changed result shows in each of them."""
    assert files.headroom is not None
    total = dataclasses.replace(files.headroom.total, nonzero=123_456)
    changed = dataclasses.replace(files, headroom=dataclasses.replace(files.headroom, total=total))
    for fmt in (OutputFormat.MARKDOWN, OutputFormat.GITHUB):
        assert "123,456" in render(changed, fmt)
