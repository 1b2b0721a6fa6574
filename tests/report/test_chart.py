"""The terminal gradient-flow chart: rows, bar lengths and marks at a fixed width, and the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from gradaudit import ExitCode, Thresholds, audit
from gradaudit.cli import app
from gradaudit.grouping import GroupBy, GroupMode, Layer
from gradaudit.report import RenderOptions
from gradaudit.report.chart import LogAxis, chart_lines, render_chart
from tests.conftest import FIXTURES, WriteDump, runner


def layer(name: str, norm: float) -> Layer:
    return Layer(name, None, 1, 4, norm, norm, 0, 0, 0)


def bar_area(line: str) -> str:
    """The cells between the row's two axis borders."""
    start = line.index("│") + 1
    return line[start : line.index("│", start)]


# Thresholds 1e-6 and 1e2 are whole decades, so the axis is [1e-7, 1e3]: 10 decades.
# Labels of 6 cells, no status column: 78 columns leave 78 - 6 - 3 - 9 = 60 cells, 6 per decade.
THRESHOLDS = Thresholds(vanishing=1e-6, exploding=1e2)
ROWS = [
    ("zero00", 0.0, 0),
    ("milli0", 1e-3, 24),  # (-3 + 7) * 6
    ("one000", 1.0, 42),
    ("two000", 2.0, 44),  # (log10(2) + 7) * 6 = 43.8
    ("ten000", 10.0, 48),
    ("infini", math.inf, 60),
]


def test_chart_rows_and_bar_lengths_at_a_fixed_width() -> None:
    lines = [t.plain for t in chart_lines([layer(n, v) for n, v, _ in ROWS], THRESHOLDS, 78)]
    rows = [line for line in lines if line[:6] in {n for n, _, _ in ROWS}]
    assert [row[:6] for row in rows] == [n for n, _, _ in ROWS]  # one row per layer, in order
    for row, (_, _, cells) in zip(rows, ROWS, strict=True):
        assert len(row) <= 78
        area = bar_area(row)
        assert len(area) == 60
        assert area.count("█") == cells
        assert area[:cells] == "█" * cells  # bars start at the left edge


def test_thresholds_are_marked_where_the_bar_does_not_reach() -> None:
    lines = [t.plain for t in chart_lines([layer(n, v) for n, v, _ in ROWS], THRESHOLDS, 78)]
    area = {line[:6]: bar_area(line) for line in lines if "│" in line}
    vanishing_cell, exploding_cell = 6, 54  # (-6 + 7) * 6 and (2 + 7) * 6
    assert [i for i, c in enumerate(area["zero00"]) if c == "┊"] == [vanishing_cell, exploding_cell]
    assert [i for i, c in enumerate(area["milli0"]) if c == "┊"] == [exploding_cell]
    assert "┊" not in area["infini"]
    header = "\n".join(lines[:3])
    assert "vanishing < 1e-06" in header
    assert "exploding > 100" in header
    # 6 cells a decade: a label every 2 decades; each starts at its tick (cell + 1 for the border).
    rule, labels = lines[-2], lines[-1]
    assert labels.split() == ["1e-06", "0.0001", "0.01", "1", "100"]
    offset = 6 + 1
    for text, cell in [("1e-06", 6), ("0.0001", 18), ("0.01", 30), ("1", 42), ("100", 54)]:
        start = offset + cell + 1
        assert labels[start - 1 : start + len(text)] == " " + text
        assert rule[offset + cell + 1] == "┴"


def test_axis_geometry() -> None:
    axis = LogAxis.covering([3e-5, 250.0, 0.0, math.inf], 40)
    assert (axis.lo, axis.hi) == (-5, 3)
    axis = LogAxis.covering([1e-7, 100.0], 40)  # powers of ten get a decade of margin
    assert (axis.lo, axis.hi) == (-8, 3)
    assert axis.bar(1e-30) == 1  # positive norms always show
    assert axis.bar(0.0) == 0
    assert axis.bar(1e30) == 40
    assert LogAxis.covering([0.0], 10) == LogAxis(-1, 1, 10)


def test_group_rows_are_coloured_by_status_and_named_with_counts() -> None:
    report = audit(
        {
            "enc.0.w": torch.tensor([math.nan, 1.0]),
            "enc.0.b": torch.full((3,), 1e-9),
            "enc.1.w": torch.full((3,), 1e-9),
            "enc.1.b": torch.full((3,), 1e-9),
            "dec.w": torch.full((4,), 1e3),
        }
    )
    text = render_chart(report, RenderOptions(width=100), GroupBy(GroupMode.MODULE))
    rows = {line.split()[0]: line for line in text.splitlines() if "│" in line}
    assert list(rows) == ["enc.0", "enc.1", "dec"]
    assert rows["enc.0"].endswith("1 of 2 nan, 1 of 2 vanishing")  # which share of the group
    assert rows["enc.1"].endswith("2 of 2 vanishing")
    assert rows["dec"].endswith("exploding")
    assert "group-by module · 3 rows" in text
    assert "\x1b" not in text
    colored = render_chart(report, RenderOptions(width=100, color=True), GroupBy(GroupMode.MODULE))
    assert "\x1b[31m" in colored
    assert "\x1b[33m" in colored


def test_long_and_hostile_names_are_escaped_and_cut_from_the_left() -> None:
    report = audit({"x" * 80 + ".end\x1b[2J.weight": torch.ones(2), "b.weight": torch.ones(2)})
    text = render_chart(report, RenderOptions(width=80), GroupBy(GroupMode.NONE))
    assert "\x1b" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" in text
    assert "\\x1b[2J.weight" in text


def test_narrow_output_keeps_a_minimum_bar() -> None:
    lines = chart_lines([layer("a" * 40, 1.0)], Thresholds(), 30)
    assert len(bar_area(next(t.plain for t in lines if "│" in t.plain))) == 10


def scan(*args: str) -> object:
    return runner.invoke(app, ["scan", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def test_cli_chart_is_opt_in_when_stdout_is_not_a_terminal() -> None:
    demo = str(FIXTURES / "demo_grads.safetensors")
    plain = runner.invoke(app, ["scan", demo], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert "Gradient flow" not in plain.stdout
    charted = runner.invoke(
        app, ["scan", demo, "--chart", "--group-by", "depth 2"], env={"COLUMNS": "120"}
    )
    assert charted.exit_code == ExitCode.FINDINGS
    assert charted.stderr == ""
    out = charted.stdout
    assert out.index("Gradient flow") < out.index("┏")  # chart first, then table and verdict
    assert "group-by depth 2 · 4 rows" in out
    assert [line.split()[0] for line in out.splitlines() if " │█" in line] == [
        "embed",
        "head",
        "layers.0",
        "layers.1",
    ]
    assert out.rstrip().endswith("FAIL: 2 failing findings (exploding, nan)")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chart", "--format", "json"], "--chart goes with --format table"),
        (["--group-by", "depth zero"], "--group-by"),
    ],
)
def test_cli_chart_usage_errors(write_dump: WriteDump, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["scan", str(write_dump({"w": torch.ones(2)})), *args])
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert message in result.stderr


def test_no_chart_wins(write_dump: WriteDump) -> None:
    result = runner.invoke(app, ["scan", str(write_dump({"w": torch.ones(2)})), "--no-chart"])
    assert result.exit_code == ExitCode.OK
    assert "Gradient flow" not in result.stdout


@pytest.mark.parametrize(
    ("kind", "title"), [("gradients", "Gradient flow:"), ("weights", "Weights:")]
)
def test_chart_title_names_what_the_bars_are(write_dump: WriteDump, kind: str, title: str) -> None:
    path = str(write_dump({"enc.weight": torch.ones(4), "dec.weight": torch.full((4,), 0.5)}))
    result = runner.invoke(app, ["scan", path, "--chart", "--kind", kind], env={"COLUMNS": "100"})
    assert result.exit_code == ExitCode.OK, result.output
    titles = [line for line in result.stdout.splitlines() if "L2 norm per layer" in line]
    assert len(titles) == 1
    assert titles[0].startswith(title)
