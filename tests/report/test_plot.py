"""``--plot``: valid PNG/SVG files of the fixed size, byte-for-byte deterministic; and the
clear usage error when matplotlib is missing (that test runs everywhere)."""

from __future__ import annotations

import importlib
import struct
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode, Thresholds, scan_paths
from gradaudit.cli import app
from gradaudit.grouping import GroupBy
from gradaudit.report.chart import report_layers
from tests.conftest import FIXTURES, WriteDump, runner

DEMO = FIXTURES / "demo_grads.safetensors"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.endswith(b"IEND\xaeB`\x82")
    return width, height


def svg_size(data: bytes) -> tuple[str, str, str]:
    root = ET.fromstring(data)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root.attrib["width"], root.attrib["height"], root.attrib["viewBox"]


@pytest.fixture
def matplotlib() -> Any:
    return pytest.importorskip("matplotlib")


def scan(*args: str) -> Any:
    return runner.invoke(app, ["scan", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def test_flow_plot_png_and_svg_have_the_fixed_size_and_are_deterministic(matplotlib: Any) -> None:
    from gradaudit.report.plot import PlotFormat, flow_plot

    report = scan_paths([DEMO])
    _spec, layers = report_layers(report, GroupBy())
    png = flow_plot(layers, report.thresholds, PlotFormat.PNG, title="t")
    assert png_size(png) == (1200, 600)
    assert png == flow_plot(layers, report.thresholds, PlotFormat.PNG, title="t")
    svg = flow_plot(layers, report.thresholds, PlotFormat.SVG, title="t")
    assert svg_size(svg) == ("864pt", "432pt", "0 0 864 432")
    assert svg == flow_plot(layers, report.thresholds, PlotFormat.SVG, title="t")
    assert b"<dc:date>" not in svg
    other = flow_plot(layers, Thresholds(exploding=1e6), PlotFormat.PNG, title="t")
    assert other != png  # the picture depends on what it shows


def test_user_style_does_not_leak_in_or_out(matplotlib: Any) -> None:
    from gradaudit.report.plot import PlotFormat, flow_plot

    report = scan_paths([DEMO])
    _, layers = report_layers(report, GroupBy())
    before = flow_plot(layers, report.thresholds, PlotFormat.SVG, title="t")
    with matplotlib.rc_context({"lines.linewidth": 7.0, "font.size": 20}):
        assert flow_plot(layers, report.thresholds, PlotFormat.SVG, title="t") == before
        assert matplotlib.rcParams["font.size"] == 20


def test_cli_writes_the_plot_and_still_prints_the_report(matplotlib: Any, tmp_path: Path) -> None:
    target = tmp_path / "flow.png"
    result = scan(str(DEMO), "--plot", str(target))
    assert result.exit_code == ExitCode.FINDINGS
    assert result.stderr == ""
    assert "FAIL" in result.stdout
    assert png_size(target.read_bytes()) == (1200, 600)
    svg = tmp_path / "flow.svg"
    json_run = scan(str(DEMO), "--plot", str(svg), "--format", "json", "--group-by", "none")
    assert json_run.exit_code == ExitCode.FINDINGS
    assert json_run.stdout.startswith("{")
    assert svg_size(svg.read_bytes())[:2] == ("864pt", "432pt")


def test_trend_plot(matplotlib: Any, tmp_path: Path) -> None:
    from fixtures.make_series import write_series

    write_series(tmp_path / "dumps", (0, 10, 20, 30, 40))
    target = tmp_path / "trend.svg"
    result = runner.invoke(app, ["trend", str(tmp_path / "dumps"), "--plot", str(target)])
    assert result.exit_code == ExitCode.OK, result.stdout
    first = target.read_bytes()
    assert svg_size(first)[:2] == ("864pt", "432pt")
    runner.invoke(app, ["trend", str(tmp_path / "dumps"), "--plot", str(target)])
    assert target.read_bytes() == first
    png = tmp_path / "trend.png"
    runner.invoke(app, ["trend", str(tmp_path / "dumps"), "--plot", str(png), "-f", "json"])
    assert png_size(png.read_bytes()) == (1200, 600)


def test_missing_matplotlib_is_a_usage_error_before_any_work(
    write_dump: WriteDump, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    called: list[object] = []
    core = importlib.import_module("gradaudit.scan.paths")
    monkeypatch.setattr(core, "scan_paths", lambda *a, **k: called.append(a))
    free = importlib.import_module("gradaudit.scan.torch_free")
    monkeypatch.setattr(free, "scan_torch_free", lambda *a, **k: called.append(a))
    target = tmp_path / "flow.png"
    result = scan(str(write_dump({"w": torch.ones(2)})), "--plot", str(target))
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert result.stderr == (
        "gradaudit: error: --plot needs matplotlib, which is not installed: "
        "pip install 'gradaudit[plot]'\n"
    )
    assert called == []
    assert not target.exists()


@pytest.mark.parametrize(
    ("plot", "message"),
    [
        ("flow.pdf", "must end in .png or .svg"),
        ("missing/flow.png", "does not exist"),
        ("grads.safetensors.png", "is an input"),
        ("a_dir.png", "not a regular file"),
    ],
)
def test_bad_plot_targets_are_usage_errors(
    matplotlib: Any, tmp_path: Path, plot: str, message: str
) -> None:
    source = tmp_path / "grads.safetensors.png"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(source))
    (tmp_path / "a_dir.png").mkdir()
    before = source.read_bytes()
    result = scan(str(source), "--plot", str(tmp_path / plot))
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert message in result.stderr
    assert source.read_bytes() == before
