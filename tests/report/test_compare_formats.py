"""Comparison output for CI: Markdown, GitHub and JUnit goldens, quiet, escaping, structure."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradaudit import ComparePolicy, Comparison, compare
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.base import MAX_FLAGGED_ROWS
from gradaudit.report.formats.junit import CHECKS, check_name
from gradaudit.results.comparison import CompareFindingKind
from tests.samples import gated_comparison, incomplete_comparison, sample_comparison

Golden = Callable[[str, str], None]
CI_FORMATS = [OutputFormat.MARKDOWN, OutputFormat.GITHUB, OutputFormat.JUNIT]
PEOPLE_FORMATS = [OutputFormat.TABLE, OutputFormat.MARKDOWN, OutputFormat.GITHUB]
SUFFIX = {
    OutputFormat.TABLE: "txt",
    OutputFormat.JSON: "json",
    OutputFormat.MARKDOWN: "md",
    OutputFormat.GITHUB: "txt",
    OutputFormat.JUNIT: "xml",
}


def render(fmt: OutputFormat, comparison: Comparison, **options: object) -> str:
    return render_text(comparison, fmt, RenderOptions(width=140, **options))  # type: ignore[arg-type]


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Comparison:
    monkeypatch.chdir(tmp_path)
    return gated_comparison(tmp_path)


@pytest.fixture
def incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Comparison:
    monkeypatch.chdir(tmp_path)
    return incomplete_comparison(tmp_path)


# --- golden files ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", CI_FORMATS)
def test_sample_golden(fmt: OutputFormat, golden: Golden) -> None:
    golden(f"compare_{fmt.value}_sample.{SUFFIX[fmt]}", render(fmt, sample_comparison()))


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_gated_golden(fmt: OutputFormat, gated: Comparison, golden: Golden) -> None:
    # Ratio above --max-ratio, a side over --max-global-norm, a change under
    # --fail-on-change, ignored vanishing biases, tensors outside both prefixes.
    golden(f"compare_{fmt.value}_gated.{SUFFIX[fmt]}", render(fmt, gated))


@pytest.mark.parametrize("fmt", CI_FORMATS)
def test_incomplete_golden(fmt: OutputFormat, incomplete: Comparison, golden: Golden) -> None:
    golden(f"compare_{fmt.value}_incomplete.{SUFFIX[fmt]}", render(fmt, incomplete))


@pytest.mark.parametrize("fmt", PEOPLE_FORMATS)
def test_quiet_golden(fmt: OutputFormat, gated: Comparison, golden: Golden) -> None:
    golden(f"compare_{fmt.value}_quiet.{SUFFIX[fmt]}", render(fmt, gated, quiet=True))


# --- quiet ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_quiet_healthy_prints_nothing_for_people_formats(fmt: OutputFormat) -> None:
    healthy = compare({"w": torch.ones(3)}, {"w": torch.full((3,), 2.0)})
    text = render(fmt, healthy, quiet=True)
    if fmt in (OutputFormat.JSON, OutputFormat.JUNIT):
        assert text.strip()  # data formats are always complete documents
    else:
        assert text == ""


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_quiet_keeps_every_failing_finding(fmt: OutputFormat, gated: Comparison) -> None:
    text = render(fmt, gated, quiet=True)
    for needle in ("max-global-norm", "--max-ratio 3", "changed by more than 4", "mlp.weight"):
        assert needle in text
    if fmt in PEOPLE_FORMATS:
        assert "Compared" not in text  # no summary
        assert "embed.weight" not in text  # nor what is fine
        assert "k.bias (" not in text  # nor ignored findings


# --- structure ------------------------------------------------------------------------


def test_every_comparison_finding_has_a_junit_test_case() -> None:
    assert {check_name(kind) for kind in CompareFindingKind} == set(CHECKS)


def test_junit_counts_match_the_verdict(gated: Comparison) -> None:
    root = ET.fromstring(render_text(gated, OutputFormat.JUNIT, RenderOptions()))
    assert root.get("failures") == "3"
    assert root.get("tests") == "13"
    failed = {
        (suite.get("name"), case.get("name"))
        for suite in root
        for case in suite
        if case.find("failure") is not None
    }
    assert failed == {
        ("comparison", "normalized-ratio"),
        ("comparison", "parameter-change"),
        ("seed: grafted.safetensors [seed.*]", "global-norm"),
    }
    ratio = root.find("testsuite/testcase[@name='normalized-ratio']/system-out")
    assert ratio is not None
    assert ratio.text is not None
    assert ratio.text.startswith("normalized ratio 5.93: seed gradients are 5.93× as intense")


def test_junit_skips_per_parameter_checks_without_shared_names() -> None:
    c = compare({"h": torch.ones(4)}, {"s": torch.ones(2)})
    root = ET.fromstring(render_text(c, OutputFormat.JUNIT, RenderOptions()))
    suite = root.find("testsuite[@name='comparison']")
    assert suite is not None
    assert suite.get("skipped") == "2"
    skipped = [case.get("name") for case in suite if case.find("skipped") is not None]
    assert skipped == ["parameter-change", "shapes-and-dtypes"]
    assert root.get("failures") == "0"


def test_github_annotations_point_at_each_sides_file(incomplete: Comparison) -> None:
    lines = render(OutputFormat.GITHUB, incomplete).splitlines()
    assert lines[0].startswith("::error file=missing.safetensors,")
    assert lines[2].startswith("::warning file=host.safetensors,title=gradaudit%3A vanishing in b")
    assert lines[-1].startswith("gradaudit compare: INCOMPLETE")


def test_github_orders_errors_before_warnings() -> None:
    a = {"w": torch.ones(4), "dead": torch.zeros(4), "x": torch.tensor([math.nan])}
    b = {"w": torch.full((4,), 50.0), "dead": torch.zeros(4), "x": torch.ones(1)}
    lines = render(OutputFormat.GITHUB, compare(a, b), quiet=True).splitlines()
    kinds = [line.split(" ", 1)[0] for line in lines]
    assert kinds == sorted(kinds, key=lambda k: k != "::error")
    assert "::error" in kinds
    assert "::warning" in kinds


def test_markdown_cuts_long_lists_unless_all() -> None:
    count = MAX_FLAGGED_ROWS + 5
    a = {f"p{i:03d}": torch.ones(2) for i in range(count)}
    b = {f"p{i:03d}": torch.full((2,), 100.0) for i in range(count)}
    c = compare(a, b)
    cut = render_text(c, OutputFormat.MARKDOWN, RenderOptions())
    assert cut.count("⚠️ changed") == MAX_FLAGGED_ROWS
    assert "… and 5 more flagged tensors (--all)" in cut
    everything = render_text(c, OutputFormat.MARKDOWN, RenderOptions(show_all=True))
    assert everything.count("⚠️ changed") == count


def test_junit_lists_at_most_the_cap_of_changed_tensors_with_the_count() -> None:
    """As a scan's cases do: the first MAX_FLAGGED_ROWS tensors, then how many more."""
    count = MAX_FLAGGED_ROWS + 7
    a = {f"p{i:03d}": torch.ones(2) for i in range(count)}
    b = {f"p{i:03d}": torch.full((2,), 100.0) for i in range(count)}
    c = compare(a, b, policy=ComparePolicy(fail_on_change=True))
    root = ET.fromstring(render_text(c, OutputFormat.JUNIT, RenderOptions()))
    case = next(e for e in root.iter("testcase") if e.get("name") == "parameter-change")
    listed = [e for e in case if e.tag in ("failure", "system-out")]
    lines = (listed[0].text or "").splitlines()
    assert sum(1 for line in lines if line.startswith("p0")) == MAX_FLAGGED_ROWS
    assert lines[-1].startswith("… 7 more tensors not shown")


HOSTILE = ["a|b", "back`tick", "new\nline", "::error::x", "100%", "<b>]]>", "esc\x1b[31m"]


@pytest.fixture
def hostile() -> Comparison:
    a = {name: torch.ones(2) for name in HOSTILE}
    b = {name: torch.full((2,), 50.0) for name in HOSTILE}
    b[HOSTILE[0]] = torch.tensor([math.nan, 1.0])
    return compare(a, b, policy=ComparePolicy(fail_on_change=True))


def test_hostile_names_cannot_break_markdown(hostile: Comparison) -> None:
    text = render(OutputFormat.MARKDOWN, hostile, show_all=True)
    assert "\x1b" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(HOSTILE)  # one per shared tensor, none split over two lines
    for row in rows:
        assert re.sub(r"\\\|", "", row).count("|") == 8, row  # 7 cells: no cell split
    assert "| `a\\|b` |" in text
    assert "| ``back`tick`` |" in text
    assert "| `new\\x0aline` |" in text


def test_hostile_names_cannot_forge_github_commands(hostile: Comparison) -> None:
    lines = render(OutputFormat.GITHUB, hostile).splitlines()
    # large_change, nan on the seed, ratio not computed: one command each, then the summary.
    assert [line.split(" ", 1)[0] for line in lines] == [
        "::error",
        "::error",
        "::warning",
        "gradaudit",
    ]
    assert "title=gradaudit%3A nan in a|b::a|b (B): 1 NaN" in lines[1]  # two dumps: A and B
    assert "100%25: B/A 50" in lines[0]  # % escaped as GitHub decodes it
    assert "\x1b" not in "".join(lines)


def test_hostile_names_stay_well_formed_xml(hostile: Comparison) -> None:
    text = render(OutputFormat.JUNIT, hostile)
    root = ET.fromstring(text.split("\n", 1)[1])
    assert root.get("failures") == "2"
    assert "\x1b" not in text
