"""``gradaudit trend``: ordering, the streaming pass, spikes, first NaN step, collapse, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fixtures.make_series import (
    COLLAPSE_LAYER,
    COLLAPSE_STEP,
    FIRST_NAN_STEP,
    FIRST_NAN_TENSOR,
    SPIKE_LAYER,
    SPIKE_STEP,
    STEPS,
)
from gradaudit import ExitCode, audit
from gradaudit.cli import app
from gradaudit.grouping import GroupBy, GroupMode
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.trend_text import sparkline
from gradaudit.results.trend import TrendKind, TrendPolicy
from gradaudit.results.verdict import trend_exit_code
from gradaudit.trend.builder import TrendBuilder, trend_paths
from gradaudit.trend.dumps import order_dumps, step_from_name
from tests.conftest import runner


def strict_json(text: str) -> Any:
    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=reject)


def trend(*args: str) -> Any:
    return runner.invoke(app, ["trend", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


# -- the planted series --------------------------------------------------------------------


def test_trend_finds_the_planted_spike_first_nan_step_and_collapse(series: Path) -> None:
    report = trend_paths([series])
    assert [s.step for s in report.steps] == list(STEPS)  # numeric, not text, order
    by_kind = {f.kind: f for f in report.findings}
    assert set(by_kind) == set(TrendKind)

    nonfinite = by_kind[TrendKind.NONFINITE]
    assert nonfinite.step == FIRST_NAN_STEP
    assert [t.name for t in nonfinite.tensors] == [FIRST_NAN_TENSOR]
    assert nonfinite.tensors[0].nan == 1
    assert nonfinite.path == str(series / f"step_{FIRST_NAN_STEP}.safetensors")
    assert FIRST_NAN_TENSOR in nonfinite.message

    spike = by_kind[TrendKind.SPIKE]
    assert (spike.layer, spike.step) == (SPIKE_LAYER, SPIKE_STEP)
    spiking = next(layer for layer in report.layers if layer.name == SPIKE_LAYER)
    assert [s.step for s in spiking.spikes] == [SPIKE_STEP]
    assert spiking.spikes[0].ratio == pytest.approx(100, rel=0.2)
    # No other layer spiked: the NaN steps after 900 are left out of the analysis.
    assert [f.layer for f in report.findings if f.kind is TrendKind.SPIKE] == [SPIKE_LAYER]

    collapse = by_kind[TrendKind.COLLAPSE]
    assert (collapse.layer, collapse.step) == (COLLAPSE_LAYER, COLLAPSE_STEP)
    assert collapse.severity.value == "warning"
    assert trend_exit_code(report) is ExitCode.FINDINGS


def test_layer_norms_match_a_float64_reference(series: Path) -> None:
    from safetensors.torch import load_file

    report = trend_paths([series], group_by=GroupBy(GroupMode.MODULE))
    layer = next(x for x in report.layers if x.name == "layers.0.fc1")
    for index, step in enumerate(STEPS):
        grads = load_file(str(series / f"step_{step}.safetensors"))
        members = [
            g.double().reshape(-1) for n, g in grads.items() if n.startswith("layers.0.fc1.")
        ]
        expected = float(torch.cat(members).norm())
        assert layer.norms[index] == pytest.approx(expected, rel=1e-12)


def test_global_norm_per_step_is_the_scan_global_norm(series: Path) -> None:
    from gradaudit import scan_paths

    report = trend_paths([series])
    for step in report.steps[:3]:
        assert step.global_norm == scan_paths([step.path]).summary.global_norm


def test_one_streaming_pass_one_dump_at_a_time_in_step_order(
    series: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    # the scan core as trend_paths calls it (imported from here when it runs: torch)
    core = importlib.import_module("gradaudit.scan.paths")
    calls: list[list[str]] = []
    real = core.scan_paths

    def spy(paths: list[str], **kwargs: Any) -> Any:
        calls.append([str(p) for p in paths])
        return real(paths, **kwargs)

    monkeypatch.setattr(core, "scan_paths", spy)
    trend_paths([series])
    assert calls == [[str(series / f"step_{step}.safetensors")] for step in STEPS]


# -- ordering -------------------------------------------------------------------------------


def test_metadata_step_beats_the_file_name(tmp_path: Path) -> None:
    for name, step in [
        ("a_9.safetensors", "30"),
        ("b_1.safetensors", "10"),
        ("c.safetensors", "20"),
    ]:
        save_file({"w": torch.ones(2)}, str(tmp_path / name), metadata={"step": step})
    dumps, problems = order_dumps([tmp_path])
    assert problems == []
    assert [(d.step, Path(d.path).name) for d in dumps] == [
        (10, "b_1.safetensors"),
        (20, "c.safetensors"),
        (30, "a_9.safetensors"),
    ]


def test_file_names_order_by_their_last_number(tmp_path: Path) -> None:
    paths = []
    for step in (1000, 200, 30):
        paths.append(tmp_path / f"run2_step{step}.safetensors")
        save_file({"w": torch.ones(2)}, str(paths[-1]))
    dumps, _ = order_dumps(paths)
    assert [d.step for d in dumps] == [30, 200, 1000]
    assert step_from_name("ckpt-3-grads.safetensors") == 3
    assert step_from_name("grads.safetensors") is None


def test_unknown_duplicate_and_bad_steps_are_input_problems(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "grads.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "step_5.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "other_5.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "x_7.safetensors"), metadata={"step": "7.5"})
    dumps, problems = order_dumps([tmp_path])
    assert [d.step for d in dumps] == [5]
    messages = {Path(p.path).name: p.message for p in problems}
    assert "cannot tell the step" in messages["grads.safetensors"]
    assert "already taken" in messages["step_5.safetensors"]  # other_5 sorts first
    assert "not an integer" in messages["x_7.safetensors"]


# -- the rules, on hand-made series ---------------------------------------------------------


def run_series(norms: list[float], policy: TrendPolicy | None = None) -> Any:
    builder = TrendBuilder(policy, GroupBy(GroupMode.MODULE))
    for step, norm in enumerate(norms):
        value = torch.tensor([norm]) if math.isfinite(norm) else torch.tensor([norm, 1.0])
        builder.add(step, f"s{step}", audit({"a.w": value, "b.w": torch.ones(1)}))
    return builder.finish()


def test_spike_needs_history_and_a_live_median() -> None:
    assert run_series([1.0, 50.0, 1.0, 1.0]).layers[0].spikes == ()  # too early
    spikes = run_series([1.0, 1.2, 0.9, 1.1, 11.5, 1.0, 9.0]).layers[0].spikes
    assert [(s.step, s.median) for s in spikes] == [(4, pytest.approx(1.05))]
    assert run_series([0.0, 0.0, 0.0, 1e-3]).layers[0].spikes == ()  # dead layer waking up
    factor = TrendPolicy(spike_factor=5.0)
    assert [s.step for s in run_series([1.0, 1.0, 1.0, 6.0], factor).layers[0].spikes] == [3]


def test_collapse_needs_to_have_been_alive_and_to_stay_down() -> None:
    assert run_series([1.0, 1.0, 1e-9, 1e-9]).layers[0].collapse_step == 2
    assert run_series([1.0, 1.0, 1.0, 1e-9]).layers[0].collapse_step is None  # one step
    assert run_series([1.0, 1e-9, 1e-9, 1.0]).layers[0].collapse_step is None  # recovered
    assert run_series([1e-9, 1e-9, 1e-9]).layers[0].collapse_step is None  # never alive
    # A NaN step neither breaks nor extends the run.
    assert run_series([1.0, 1e-9, math.nan, 1e-9]).layers[0].collapse_step == 1


def test_first_nonfinite_names_the_tensors_in_model_order() -> None:
    builder = TrendBuilder()
    builder.add(0, "s0", audit({"b.w": torch.ones(2), "a.w": torch.ones(2)}))
    builder.add(5, "s5", audit({"b.w": torch.tensor([math.inf]), "a.w": torch.tensor([math.nan])}))
    builder.add(6, "s6", audit({"b.w": torch.tensor([math.nan]), "a.w": torch.ones(1)}))
    report = builder.finish()
    (finding,) = report.findings
    assert (finding.kind, finding.step) == (TrendKind.NONFINITE, 5)
    assert [(t.name, t.nan, t.pos_inf) for t in finding.tensors] == [("b.w", 0, 1), ("a.w", 1, 0)]
    with pytest.raises(ValueError, match="increase"):
        builder.add(6, "again", audit({"a.w": torch.ones(1)}))


def test_layers_that_come_and_go_are_aligned_with_steps() -> None:
    builder = TrendBuilder(group_by=GroupBy(GroupMode.MODULE))
    builder.add(0, "s0", audit({"a.w": torch.ones(4)}))
    builder.add(1, "s1", audit({"a.w": torch.ones(4), "b.w": torch.ones(1)}))
    builder.add(2, "s2", audit({"b.w": torch.ones(1)}))
    layers = {layer.name: layer for layer in builder.finish().layers}
    assert layers["a"].norms == (2.0, 2.0, None)
    assert layers["b"].norms == (None, 1.0, 1.0)


def test_sparkline() -> None:
    assert sparkline([1.0, 10.0, 100.0], [0, 0, 0]) == "▁▅█"
    assert sparkline([1.0, 1.1, 1.0], [0, 0, 0]) == "▁▁▁"  # at least a decade tall
    assert sparkline([1.0, None, 0.0, 5.0], [0, 0, 0, 1]) == "▁ ·!"
    assert sparkline([1.0, 1.0, 100.0, 1.0], [0, 0, 0, 0], width=2) == "▁█"


# -- renderers and CLI ---------------------------------------------------------------------


def test_table_shows_a_sparkline_per_layer_and_the_verdict(series: Path) -> None:
    text = render_text(trend_paths([series]), OutputFormat.TABLE, RenderOptions(width=120))
    lines = text.splitlines()
    row = next(line for line in lines if f"│ {SPIKE_LAYER} " in line)
    spark = row.split("│")[2].strip()
    assert len(spark) == len(STEPS)
    assert spark[STEPS.index(SPIKE_STEP)] == "█"
    assert f"spike@{SPIKE_STEP}" in row
    assert any(line.startswith("(global)") or "(global)" in line for line in lines)
    assert text.rstrip().endswith("FAIL: 2 failing findings (nonfinite, spike)")


def test_cli_json_is_strict_and_complete(series: Path) -> None:
    result = trend(str(series), "--format", "json")
    assert result.exit_code == ExitCode.FINDINGS
    assert result.stderr == ""
    doc = strict_json(result.stdout)
    assert doc["command"] == "trend"
    assert [s["step"] for s in doc["steps"]] == list(STEPS)
    assert doc["summary"]["first_nonfinite_step"] == FIRST_NAN_STEP
    assert doc["exit_code"] == 1
    kinds = {f["kind"]: f for f in doc["findings"]}
    assert kinds["nonfinite"]["tensors"][0]["name"] == FIRST_NAN_TENSOR
    layer = next(x for x in doc["layers"] if x["name"] == SPIKE_LAYER)
    assert len(layer["norms"]) == len(STEPS)
    assert [s["step"] for s in layer["spikes"]] == [SPIKE_STEP]


@pytest.mark.parametrize(
    ("fail_on", "code"),
    [("none", ExitCode.OK), ("collapse", ExitCode.FINDINGS), ("nonfinite", ExitCode.FINDINGS)],
)
def test_cli_fail_on(series: Path, fail_on: str, code: ExitCode) -> None:
    assert trend(str(series), "--fail-on", fail_on).exit_code == code


def test_cli_healthy_series_exits_0(tmp_path: Path) -> None:
    for step in range(5):
        save_file(
            {"a.w": torch.full((4,), 1.0 + step / 10)}, str(tmp_path / f"s{step}.safetensors")
        )
    result = trend(str(tmp_path))
    assert result.exit_code == ExitCode.OK, result.stdout
    assert "OK: no failing findings" in result.stdout


def test_cli_bad_dump_exits_3_and_the_rest_is_still_reported(series: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "step_5000.safetensors"
    corrupt.write_bytes((series / "step_0.safetensors").read_bytes()[:-3])
    result = trend(str(series), str(corrupt), "--format", "json")
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert len(result.stderr.strip().splitlines()) == 1
    assert str(corrupt) in result.stderr
    doc = strict_json(result.stdout)
    assert len(doc["steps"]) == len(STEPS)
    assert doc["errors"][0]["file"] == str(corrupt)


def test_cli_empty_directory_exits_3(tmp_path: Path) -> None:
    result = trend(str(tmp_path))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "no checkpoint file in this directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--spike-factor", "1"],
        ["--spike-factor", "nan"],
        ["--fail-on", "spike,bogus"],
        ["--group-by", "depth 0"],
        ["--format", "xml"],
        ["--plot", "out.pdf"],
        ["--device", "meta"],
    ],
)
def test_cli_usage_errors_exit_2(series: Path, args: list[str]) -> None:
    result = trend(str(series), *args)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert result.stderr.strip()
    assert "Traceback" not in result.stderr


def test_every_trend_format_has_a_formatter(series: Path) -> None:
    report = trend_paths([series])
    for fmt in OutputFormat:
        assert render_text(report, fmt, RenderOptions()).endswith("\n")


def test_trend_help_documents_exit_codes() -> None:
    result = runner.invoke(app, ["trend", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    for code in ("0 every dump audited", "1 failing findings", "2 usage error", "3 a dump"):
        assert code in text


@pytest.mark.parametrize("sync", [False, True])
def test_a_monitors_dumps_give_the_step_its_stats_went_nan(tmp_path: Path, sync: bool) -> None:
    """A NaN at step 20 of a real loop: without ``sync`` the monitor learns of it at step
    21 and dumps step 21's gradients (``nonfinite_step`` = 20 in the metadata); the trend
    still says 20, as with ``sync``."""
    import warnings

    from gradaudit import GradientMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradientMonitor(model, every=1, sync=sync, dump_dir=tmp_path, max_dumps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(25):
            x = torch.randn(16, 4)
            if step == 20:
                x[0, 0] = math.nan
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            monitor.step()
            optimizer.step()
        monitor.flush()
    first = sorted(p.name for p in tmp_path.glob("*.safetensors"))[0]
    assert first == ("step_00000020.safetensors" if sync else "step_00000021.safetensors")
    report = trend_paths([tmp_path])
    (nonfinite,) = [f for f in report.findings if f.kind is TrendKind.NONFINITE]
    assert nonfinite.step == 20
    assert nonfinite.message.startswith("first NaN/Inf at step 20")
