"""``trend --precision``: the headroom of every step, against a per-step scan."""

from __future__ import annotations

from pathlib import Path

from fixtures.make_series import STEPS
from gradaudit import ExitCode, scan_paths
from gradaudit.cli import app
from gradaudit.precision.formats import Precision
from gradaudit.precision.judging import precision_report
from gradaudit.trend.builder import trend_paths
from tests.conftest import runner


def test_each_step_matches_its_own_scan(series: Path) -> None:
    report = trend_paths([series], precision=Precision.FP8_E5M2)
    assert [step for step, _ in report.headroom] == list(STEPS)
    for step, row in report.headroom[:3]:
        dump = series / f"step_{step}.safetensors"
        alone = precision_report(scan_paths([dump], histograms=True), Precision.FP8_E5M2)
        assert row == alone.total
    assert trend_paths([series]).headroom == ()


def test_cli_prints_one_line_per_step(series: Path) -> None:
    env = {"COLUMNS": "80", "NO_COLOR": "1"}
    result = runner.invoke(app, ["trend", str(series), "--precision", "fp16"], env=env)
    assert f"Headroom in fp16 over {len(STEPS)} steps" in result.stdout
    lines = result.stdout.split("Headroom in fp16 over")[1].splitlines()[2:]
    assert [line.split()[0] for line in lines] == [str(s) for s in STEPS]
    bad = runner.invoke(app, ["trend", str(series), "--precision", "fp16", "-f", "json"], env=env)
    assert bad.exit_code == ExitCode.USAGE_ERROR
    assert "--format table" in bad.stderr
