"""What the human formats say: compare's A/B words, trend's spikes and empty steps, caps.

Each test pins one fault a new user met (issue 15, issue 13 §3.4 and §3.7).
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import audit
from gradaudit.cli import app
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.base import MAX_FLAGGED_ROWS
from gradaudit.report.formats.markdown import code
from gradaudit.report.text import layer_label, number
from tests.conftest import runner
from tests.torch_features import requires_torch_2_6

ENV = {"COLUMNS": "80", "NO_COLOR": "1"}


def grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {
        f"encoder.layer.{i}.{part}": torch.randn(8, 8) * 1e-2 * scale
        for i in range(3)
        for part in ("attention.self.query.weight", "output.dense.weight")
    }
    out.update({f"encoder.layer.{i}.attention.self.key.bias": torch.zeros(8) for i in range(3)})
    return out


# -- compare --------------------------------------------------------------------------------


@pytest.fixture
def two_dumps(tmp_path: Path) -> tuple[Path, Path, Path]:
    a, b, bf16 = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    base = grads()
    save_file(base, str(a))
    changed = dict(base)
    changed["encoder.layer.0.output.dense.weight"] = (
        base["encoder.layer.0.output.dense.weight"] * 1.6e21
    )
    save_file(changed, str(b))
    save_file({k: v.to(torch.bfloat16) for k, v in base.items()}, str(bf16))
    return a, b, bf16


def test_two_dumps_of_one_model_are_a_and_b(two_dumps: tuple[Path, Path, Path]) -> None:
    a, b, _ = two_dumps
    result = runner.invoke(app, ["compare", str(a), str(b)], env=ENV)
    assert result.exit_code == 1, result.output  # B's changed tensor explodes
    text = result.stdout
    assert "host" not in text
    assert "seed" not in text
    assert "B's gradients are" in text
    wide = runner.invoke(app, ["compare", str(a), str(b)], env={**ENV, "COLUMNS": "120"}).stdout
    row = next(line for line in wide.splitlines() if "layer.0.output" in line)
    assert "×1.6e+21" in row  # a large change is a factor, not 30 digits of percent
    assert "%" not in row


def test_equal_gradients_do_not_say_one_times_weaker(two_dumps: tuple[Path, Path, Path]) -> None:
    a, _, bf16 = two_dumps
    result = runner.invoke(app, ["compare", str(a), str(bf16)], env={**ENV, "COLUMNS": "200"})
    assert "1× weaker" not in result.stdout
    assert "as intense per parameter as A's (ratio 1)" in result.stdout


def test_a_dtype_difference_is_one_line_and_no_warning(two_dumps: tuple[Path, Path, Path]) -> None:
    a, _, bf16 = two_dumps
    result = runner.invoke(app, ["compare", str(a), str(bf16)], env={**ENV, "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if "bfloat16" in line and "│" not in line]
    assert lines == [
        "dtype differs for 9 shared tensors (float32 in A, bfloat16 in B): still compared, a norm "
        "does not depend on the storage dtype"
    ]
    assert "mismatch" not in result.stdout
    # the table shows each row's dtypes
    assert "float32→bfloat16" in result.stdout


def test_a_finding_on_both_sides_is_said_once(two_dumps: tuple[Path, Path, Path]) -> None:
    a, b, _ = two_dumps
    result = runner.invoke(app, ["compare", str(a), str(b)], env={**ENV, "COLUMNS": "200"})
    vanishing = [line for line in result.stdout.splitlines() if ": vanishing:" in line]
    assert len(vanishing) == 3
    assert all("(A and B)" in line for line in vanishing)
    markdown = runner.invoke(app, ["compare", str(a), str(b), "-f", "markdown"], env=ENV).stdout
    assert markdown.count(": vanishing:") == 3


def test_host_and_seed_keep_their_words(tmp_path: Path) -> None:
    path = tmp_path / "hs.safetensors"
    tensors = {f"host.{k}": v for k, v in grads().items()}
    tensors.update({f"seed.{k}": v * 4 for k, v in list(grads().items())[:2]})
    save_file(tensors, str(path))
    args = ["compare", str(path), "--host-prefix", "host.", "--seed-prefix", "seed."]
    text = runner.invoke(app, args, env={**ENV, "COLUMNS": "200"}).stdout
    assert "seed gradients are" in text
    assert "host (A)" in text


# -- trend ----------------------------------------------------------------------------------


def _series(directory: Path, tensors: dict[int, dict[str, torch.Tensor]]) -> Path:
    directory.mkdir()
    for step, named in tensors.items():
        save_file(named, str(directory / f"step_{step}.safetensors"), metadata={"step": str(step)})
    return directory


def test_spike_step_and_ratio_agree_in_table_footer_and_json(tmp_path: Path) -> None:
    """Steps 12 and 13 both spike, 13 harder: every output names step 12 with step 12's ratio."""
    series = {}
    for step in range(20):
        factor = {12: 1e4, 13: 1e6}.get(step, 1.0)
        series[step] = {
            "encoder.layer.0.intermediate.dense.weight": torch.ones(16)
            * (1 + 0.01 * step)
            * factor,
            "encoder.layer.0.output.dense.weight": torch.ones(16),
        }
    directory = _series(tmp_path / "s", series)
    table = runner.invoke(app, ["trend", str(directory)], env={**ENV, "COLUMNS": "200"}).stdout
    doc = json.loads(runner.invoke(app, ["trend", str(directory), "-f", "json"], env=ENV).stdout)
    layer = next(x for x in doc["layers"] if x["name"] == "encoder.layer.0.intermediate.dense")
    first = layer["spikes"][0]
    assert first["step"] == 12
    ratio = number(first["ratio"])
    finding = next(f for f in doc["findings"] if f["kind"] == "spike")
    assert finding["step"] == 12
    assert f"is {ratio}×" in finding["message"]
    row = next(line for line in table.splitlines() if "intermediate.dense" in line and "│" in line)
    assert f"spike@12 ×{ratio} (+1 more)" in row
    assert f"at step 12 is {ratio}×" in table
    expected = (1.12 * 1e4) / 1.06  # step 12's norm over the running median of steps 0 … 11
    assert math.isclose(first["ratio"], expected, rel_tol=0.05)


def test_a_step_with_no_finite_value_has_no_norm(tmp_path: Path) -> None:
    series = {
        step: {
            "0.weight": torch.full((4,), math.nan) if step >= 3 else torch.ones(4),
            "2.weight": torch.full((4,), math.nan) if step >= 3 else torch.ones(4) * 2,
        }
        for step in range(5)
    }
    directory = _series(tmp_path / "s", series)
    doc = json.loads(runner.invoke(app, ["trend", str(directory), "-f", "json"], env=ENV).stdout)
    assert [s["global_norm"] for s in doc["steps"]][3:] == [None, None]
    assert doc["layers"][0]["norms"][3:] == [None, None]
    text = runner.invoke(app, ["trend", str(directory)], env={**ENV, "COLUMNS": "120"}).stdout
    rows = [line for line in text.splitlines() if line.startswith("│    3 ") or "│    4 " in line]
    assert rows
    assert all(" 0 │" not in row.split("│")[4] for row in rows)  # global norm column: "-"
    assert all(row.split("│")[4].strip() == "-" for row in rows)
    # numeric layer names read as names, not counts
    assert "nonfinite in '0'" in text
    assert layer_label("0") == "'0'"
    assert layer_label("encoder.layer.0") == "encoder.layer.0"


# -- caps and escaping ----------------------------------------------------------------------


def test_every_human_format_caps_flagged_rows() -> None:
    """An all-zero dump of many tensors flags each: list 50, count the rest, say how to see all."""
    many = {f"model.layers.{i}.mlp.weight": torch.zeros(2) for i in range(MAX_FLAGGED_ROWS + 30)}
    report = audit(many)
    hint = "… 30 more flagged tensors not shown (--all or --format json lists every one)"
    table = render_text(report, OutputFormat.TABLE, RenderOptions(width=100))
    assert hint in table
    assert table.count("vanishing │") == MAX_FLAGGED_ROWS
    quiet = render_text(report, OutputFormat.TABLE, RenderOptions(width=100, quiet=True))
    assert quiet.count("vanishing │") == MAX_FLAGGED_ROWS
    everything = render_text(report, OutputFormat.TABLE, RenderOptions(width=100, show_all=True))
    assert everything.count("vanishing │") == MAX_FLAGGED_ROWS + 30
    markdown = render_text(report, OutputFormat.MARKDOWN, RenderOptions())
    assert hint in markdown
    github = render_text(report, OutputFormat.GITHUB, RenderOptions()).splitlines()
    assert sum(line.startswith("::warning") for line in github) == MAX_FLAGGED_ROWS
    assert any(line.startswith("::notice") and "30 more findings" in line for line in github)
    junit = render_text(report, OutputFormat.JUNIT, RenderOptions())
    root = ET.fromstring(junit.split("\n", 1)[1])
    out = next(
        case.find("system-out") for case in root.iter("testcase") if case.get("name") == "vanishing"
    )
    assert out is not None
    assert out.text is not None
    assert len(out.text.splitlines()) == MAX_FLAGGED_ROWS + 1
    assert "30 more findings" in out.text


def test_markdown_shows_a_pipe_and_backslash_in_a_name_as_they_are() -> None:
    # GFM turns \| into | inside a table cell, code span or not, and keeps other backslashes.
    assert code("pipe|esc") == "`pipe\\|esc`"
    assert code("pipe\\|esc") == "`pipe\\\\|esc`"
    assert code("a\x1bb") == "`a\\x1bb`"


# -- errors and help ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["scan", "x", "-f", "jsn"], "gradaudit: error: --format: 'jsn' is not one of"),
        (
            ["scan", "x", "--exploding-threshold", "abc"],
            "gradaudit: error: --exploding-threshold: 'abc' is not a number",
        ),
        (["scan", "x", "--top", "-1"], "gradaudit: error: --top: must be at least 0 (got '-1')"),
        (["trend", "x", "--spike-factor", "x"], "gradaudit: error: --spike-factor: 'x' is not a"),
        (["scan", "--nope", "x"], "gradaudit: error: no such option: --nope"),
        (["scan"], "gradaudit: error: missing PATH (see 'gradaudit scan --help')"),
        (["compare"], "gradaudit: error: missing HOST [SEED]"),
    ],
)
def test_usage_errors_are_one_gradaudit_line(args: list[str], line: str) -> None:
    result = runner.invoke(app, args, env=ENV)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith(line)
    assert result.stderr.count("\n") == 1
    for typer_words in ("Value error", "Input should", "Usage:", "Try '"):
        assert typer_words not in result.stderr


@pytest.mark.parametrize("command", ["scan", "compare", "trend"])
def test_help_names_values_not_python_types(command: str) -> None:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "{" not in result.stdout.splitlines()[0]  # usage: PATH..., not {PATH}...
    for python in ("<list[", "<str>", "<float>", "<int range>", "<int>", "<path>"):
        assert python not in result.stdout
    if command == "trend":
        assert "Rows of the chart:" not in result.stdout


def test_nothing_audited_prints_the_error_and_the_verdict_only(tmp_path: Path) -> None:
    result = runner.invoke(app, ["scan", str(tmp_path / "missing.safetensors")], env=ENV)
    assert result.exit_code == 3
    assert result.stdout == "INCOMPLETE: 1 input could not be audited\n"
    assert result.stderr.count("\n") == 1
    assert "no such file" in result.stderr
    doc = json.loads(
        runner.invoke(app, ["scan", str(tmp_path / "missing.safetensors"), "-f", "json"]).stdout
    )
    assert doc["files"][0]["global_norm"] is None
    assert doc["summary"]["global_norm"] is None  # no norm of nothing, never 0
    (tmp_path / "empty").mkdir()
    trend = runner.invoke(app, ["trend", str(tmp_path / "empty")], env=ENV)
    assert trend.exit_code == 3
    assert trend.stdout == "INCOMPLETE: 1 input could not be audited\n"
    assert "device none" not in trend.stdout


def test_model_directory_companion_files_are_one_line(tmp_path: Path) -> None:
    save_file(grads(), str(tmp_path / "model.safetensors"))
    companions = ["config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]
    companions += ["special_tokens_map.json", "generation_config.json", "README.md"]
    for name in [*companions, "notes.xyz"]:
        (tmp_path / name).write_text("{}")
    result = runner.invoke(app, ["scan", str(tmp_path)], env={**ENV, "COLUMNS": "200"})
    skipped = [line for line in result.stdout.splitlines() if line.startswith("skipped")]
    assert len(skipped) == 2
    assert "notes.xyz: not a checkpoint file" in skipped[0]
    assert skipped[1].startswith("skipped 7 model companion files (README.md, config.json, ")
    doc = json.loads(runner.invoke(app, ["scan", str(tmp_path), "-f", "json"]).stdout)
    assert len(doc["skipped"]) == 8  # the data keeps every one


def test_trend_says_why_a_torch_dump_has_no_step(tmp_path: Path) -> None:
    path = tmp_path / "training_ckpt.pt"
    torch.save({"step": 1, "w": torch.ones(3)}, path)
    result = runner.invoke(app, ["trend", str(path)], env=ENV)
    assert result.exit_code == 3
    assert "no 'step' in its metadata" not in result.stderr
    assert "torch.save file's name has none" in result.stderr


@requires_torch_2_6
def test_torch_unformatted_size_message_is_said_plainly(tmp_path: Path) -> None:
    """torch's legacy loader says "expected %ld got %ld6064": gradaudit says what it means."""
    import io
    import struct

    buffer = io.BytesIO()
    torch.save({"w": torch.ones(16)}, buffer, _use_new_zipfile_serialization=False)
    raw = bytearray(buffer.getvalue())
    at = len(raw) - 64 - 8  # the storage's element count, before its 64 bytes
    assert struct.unpack("<q", raw[at : at + 8]) == (16,)
    raw[at : at + 8] = struct.pack("<q", 15)
    path = tmp_path / "legacy.pt"
    path.write_bytes(bytes(raw[:-4]))
    result = runner.invoke(app, ["scan", str(path)], env=ENV)
    assert result.exit_code == 3
    assert "%ld" not in result.stderr
    assert "storage holds fewer or more bytes than declared" in result.stderr


def test_compare_github_caps_annotations(tmp_path: Path) -> None:
    zeros = {f"model.layers.{i}.mlp.weight": torch.zeros(2) for i in range(40)}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(zeros, str(a))
    save_file(zeros, str(b))
    out = runner.invoke(app, ["compare", str(a), str(b), "-f", "github"], env=ENV).stdout
    lines = out.splitlines()
    assert sum(line.startswith(("::warning", "::error")) for line in lines) == MAX_FLAGGED_ROWS
    assert any(line.startswith("::notice") and "more findings not shown" in line for line in lines)
    everything = runner.invoke(app, ["compare", str(a), str(b), "-f", "github", "--all"]).stdout
    warnings = [line for line in everything.splitlines() if line.startswith("::warning")]
    assert len(warnings) == 80 + 1  # every tensor on both sides, and "both norms are 0"


def test_tensors_skipped_for_one_reason_share_a_line() -> None:
    """A training checkpoint's per-parameter step counters are one line, not one each."""
    tensors = {f"optimizer.state.{i}.step": torch.tensor(3) for i in range(30)}
    tensors |= {"flag": torch.tensor(True), "head.weight": torch.randn(4, 4)}
    report = audit(tensors)
    assert len(report.skipped) == 31  # each still in the report (and in JSON)
    table = render_text(report, OutputFormat.TABLE, RenderOptions(width=120))
    skipped = [line for line in table.splitlines() if line.startswith("skipped")]
    assert skipped == [
        "skipped 30 tensors (optimizer.state.0.step, …): dtype int64 is not floating-point; "
        "not audited",
        "skipped flag: dtype bool is not floating-point; not audited",
    ]
