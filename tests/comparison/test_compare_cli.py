"""``gradaudit compare`` end to end on dumps of a real backward pass, through CliRunner."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import ExitCode, compare
from gradaudit.cli import app
from tests.conftest import WriteDump, runner
from tests.grafted import grads, grafted_model


def run(*args: str) -> Any:
    return runner.invoke(app, ["compare", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})


def strict_json(text: str) -> Any:
    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """host / seed / both-in-one dumps of one step, and the whole model after 3 steps."""
    root = tmp_path_factory.mktemp("dumps")
    model, later = grafted_model(steps=1), grafted_model(steps=3)
    files = {
        "host": grads(model.host),
        "seed": grads(model.seed),
        "both": {**grads(model.host, "host."), **grads(model.seed, "seed.")},
        "step_1": grads(model),
        "step_3": grads(later),
    }
    paths = {}
    for name, tensors in files.items():
        paths[name] = root / f"{name}.safetensors"
        save_file(tensors, str(paths[name]))
    return paths


def test_host_vs_seed_files(dumps: dict[str, Path]) -> None:
    result = run(str(dumps["host"]), str(dumps["seed"]))
    assert result.exit_code == ExitCode.OK, result.output
    assert result.stderr == ""
    model = grafted_model(steps=1)
    expected = compare(model.host, model.seed).dual
    assert f"normalized ratio {expected.normalized_ratio:.3g}" in result.stdout
    assert f"seed gradients are {expected.normalized_ratio:.3g}× as intense per parameter" in (
        result.stdout
    )
    assert "No tensor names shared" in result.stdout
    assert "OK: no failing findings" in result.stdout


def test_one_dump_split_by_prefixes_equals_two_dumps(dumps: dict[str, Path]) -> None:
    two = strict_json(run(str(dumps["host"]), str(dumps["seed"]), "-f", "json").stdout)
    one = run(str(dumps["both"]), "--host-prefix", "host.", "--seed-prefix", "seed.", "-f", "json")
    assert one.exit_code == ExitCode.OK
    doc = strict_json(one.stdout)
    assert doc["dual"] == two["dual"]
    assert doc["host"]["prefix"] == "host."
    assert doc["parameters"] is None
    assert doc["skipped"] == []


def test_longest_prefix_wins_so_an_empty_host_prefix_means_everything_else(
    dumps: dict[str, Path],
) -> None:
    args = ("--host-prefix", "", "--seed-prefix", "seed.", "-f", "json")
    split = strict_json(run(str(dumps["step_1"]), *args).stdout)
    two = strict_json(run(str(dumps["host"]), str(dumps["seed"]), "-f", "json").stdout)
    assert split["dual"] == two["dual"]


def test_tensors_outside_both_prefixes_are_listed_as_skipped(dumps: dict[str, Path]) -> None:
    result = run(str(dumps["step_1"]), "--host-prefix", "host.layers.", "--seed-prefix", "seed.")
    assert result.exit_code == ExitCode.OK
    assert "skipped host.embed.weight: name matches neither --host-prefix 'host.layers.'" in (
        result.stdout
    )


def test_same_model_two_dumps(dumps: dict[str, Path]) -> None:
    result = run(str(dumps["step_1"]), str(dumps["step_3"]), "--all")
    assert result.exit_code == ExitCode.OK
    assert "Per-parameter comparison, A → B: 39 shared tensors" in result.stdout
    for name in ("host.embed.weight", "seed.up.weight", "host.layers.1.fc2.bias"):
        assert name in result.stdout
    doc = strict_json(run(str(dumps["step_1"]), str(dumps["step_3"]), "-f", "json").stdout)
    assert doc["parameters"]["shared"] == 39
    assert doc["parameters"]["only_in_a"] == []
    change = doc["parameters"]["changes"][0]
    assert change["ratio"] == pytest.approx(change["norm_b"] / change["norm_a"])
    assert change["relative_change"] == pytest.approx(change["ratio"] - 1)


def test_a_planted_change_is_flagged_and_can_fail(dumps: dict[str, Path], tmp_path: Path) -> None:
    tensors = grads(grafted_model(steps=1))
    tensors["seed.up.weight"] *= 50.0
    tensors.pop("host.head.bias")
    tensors["host.layers.0.fc1.weight"] = tensors["host.layers.0.fc1.weight"].t().contiguous()
    planted = tmp_path / "planted.safetensors"
    save_file(tensors, str(planted))
    result = run(str(dumps["step_1"]), str(planted))
    assert result.exit_code == ExitCode.OK  # changes and mismatches warn by default
    assert "changed" in result.stdout
    assert "only in A (1): host.head.bias" in result.stdout
    assert "mismatch host.layers.0.fc1.weight: shape 64×32 vs 32×64 (not compared)" in (
        result.stdout
    )
    doc = strict_json(run(str(dumps["step_1"]), str(planted), "-f", "json").stdout)
    (flagged,) = [c for c in doc["parameters"]["changes"] if c["flagged"]]
    assert flagged["name"] == "seed.up.weight"
    assert flagged["ratio"] == pytest.approx(50.0, rel=1e-6)
    failing = run(str(dumps["step_1"]), str(planted), "--fail-on-change")
    assert failing.exit_code == ExitCode.FINDINGS
    assert "FAIL: 1 failing finding (large_change)" in failing.stdout
    wide = run(str(dumps["step_1"]), str(planted), "--fail-on-change", "--max-change", "100")
    assert wide.exit_code == ExitCode.OK


def test_gate_on_the_normalized_ratio(dumps: dict[str, Path]) -> None:
    ratio = compare(*(lambda m: (m.host, m.seed))(grafted_model(steps=1))).dual.normalized_ratio
    assert ratio is not None
    host, seed = str(dumps["host"]), str(dumps["seed"])
    inside = run(host, seed, "--min-ratio", "0.1", "--max-ratio", "10", "--format", "json")
    assert inside.exit_code == ExitCode.OK
    doc = strict_json(inside.stdout)
    assert doc["exit_code"] == 0
    assert doc["dual"]["normalized_ratio"] == pytest.approx(ratio, rel=1e-12)
    below = run(host, seed, "--min-ratio", f"{ratio * 2}", "--format", "json")
    assert below.exit_code == ExitCode.FINDINGS
    assert strict_json(below.stdout)["findings"][0]["kind"] == "ratio_below_min"
    above = run(host, seed, "--max-ratio", f"{ratio / 2}")
    assert above.exit_code == ExitCode.FINDINGS
    assert "FAIL: 1 failing finding (ratio_above_max)" in above.stdout
    assert above.stderr == ""


def test_nan_in_the_seed_is_named_and_stops_the_ratio(
    dumps: dict[str, Path], write_dump: WriteDump
) -> None:
    tensors = grads(grafted_model(steps=1).seed)
    tensors["down.weight"][1, 2] = math.nan
    seed = write_dump(tensors, "seed_nan.safetensors")
    result = run(str(dumps["host"]), str(seed))
    assert result.exit_code == ExitCode.FINDINGS
    assert "error: down.weight (seed): nan: 1 NaN of 128 elements" in result.stdout
    assert "ratio not computed: NaN/Inf on the seed side" in result.stdout
    doc = strict_json(run(str(dumps["host"]), str(seed), "-f", "json").stdout)
    assert doc["dual"]["normalized_ratio"] is None
    assert doc["dual"]["raw_ratio"] is None
    assert doc["seed"]["nan"] == 1
    assert doc["seed"]["nan_tensors"] == 1
    assert [f["kind"] for f in doc["findings"]] == ["ratio_not_computed"]


def test_zero_host_norm_is_infinite_with_a_warning(write_dump: WriteDump) -> None:
    host = write_dump({"w": torch.zeros(8)}, "host.safetensors")
    seed = write_dump({"w": torch.ones(2)}, "seed.safetensors")
    result = run(str(host), str(seed), "-f", "json")
    assert result.exit_code == ExitCode.OK
    doc = strict_json(result.stdout)
    assert doc["dual"]["normalized_ratio"] == "Infinity"
    assert doc["findings"][0] == {
        "kind": "zero_host_norm",
        "severity": "warning",
        "message": "the host gradient norm is 0: the ratio is infinite",
    }
    assert run(str(host), str(seed), "--max-ratio", "1e6").exit_code == ExitCode.FINDINGS


@pytest.mark.parametrize(
    "args",
    [
        ["a.safetensors", "b.safetensors", "c.safetensors"],
        ["a.safetensors"],
        ["a.safetensors", "--host-prefix", "x."],
        ["a.safetensors", "--host-prefix", "x.", "--seed-prefix", "x."],
        ["a.safetensors", "b.safetensors", "--min-ratio", "2", "--max-ratio", "1"],
        ["a.safetensors", "b.safetensors", "--min-ratio", "nan"],
        ["a.safetensors", "b.safetensors", "--max-ratio", "0"],
        ["a.safetensors", "b.safetensors", "--max-change", "0.5"],
        ["a.safetensors", "b.safetensors", "--fail-on", "bogus"],
        ["a.safetensors", "b.safetensors", "--format", "xml"],
        ["a.safetensors", "b.safetensors", "--device", "meta"],
        [],
    ],
)
def test_usage_errors_exit_2(args: list[str], tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.ones(2)}, str(a))
    save_file({"w": torch.ones(2)}, str(b))
    args = [str(tmp_path / arg) if arg.endswith(".safetensors") else arg for arg in args]
    result = run(*args)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert result.stderr.strip()
    assert "Traceback" not in result.stderr


def test_missing_seed_exits_3_and_still_reports_the_host(
    dumps: dict[str, Path], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.safetensors"
    result = run(str(dumps["host"]), str(missing), "-f", "json")
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr == f"gradaudit: error: {missing}: no such file\n"
    doc = strict_json(result.stdout)
    assert doc["host"]["tensors"] == 35
    assert doc["seed"]["tensors"] == 0
    assert doc["dual"]["normalized_ratio"] is None
    assert doc["errors"] == [{"file": str(missing), "message": "no such file"}]
    assert doc["exit_code"] == 3
    table = run(str(dumps["host"]), str(missing))
    assert "INCOMPLETE" in table.stdout


def test_a_prefix_that_matches_nothing_is_an_input_error(dumps: dict[str, Path]) -> None:
    result = run(str(dumps["both"]), "--host-prefix", "host.", "--seed-prefix", "sed.")
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr == (
        f"gradaudit: error: {dumps['both']}: no floating-point tensor starting with "
        "--seed-prefix 'sed.' for the seed side; nothing to compare\n"
    )


def test_a_corrupt_file_and_an_integer_only_file_exit_3(
    write_dump: WriteDump, tmp_path: Path
) -> None:
    good = write_dump({"w": torch.ones(4)})
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(good.read_bytes()[:-3])
    result = run(str(good), str(corrupt))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert len(result.stderr.strip().splitlines()) == 1
    assert str(corrupt) in result.stderr
    ints = write_dump({"step": torch.tensor(3)}, "ints.safetensors")
    result = run(str(good), str(ints))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "no floating-point tensor for the seed side" in result.stderr


def test_hostile_names_are_printed_literally(write_dump: WriteDump) -> None:
    names = ["[red]x[/red]", "esc\x1b[31mred", "bidi\u202egnp"]
    a = write_dump({name: torch.ones(2) for name in names}, "a.safetensors")
    b = write_dump({name: torch.full((2,), 100.0) for name in names}, "b.safetensors")
    result = run(str(a), str(b))
    assert "[red]x[/red]" in result.stdout
    assert "esc\\x1b[31mred" in result.stdout
    assert "\x1b" not in result.stdout
    assert "\u202e" not in result.stdout


def test_inputs_are_never_modified(dumps: dict[str, Path]) -> None:
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in dumps.values()}
    run(str(dumps["host"]), str(dumps["seed"]))
    run(str(dumps["both"]), "--host-prefix", "host.", "--seed-prefix", "seed.")
    assert before == {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in dumps.values()}


def test_help_explains_the_normalisation_and_exit_codes() -> None:
    result = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "sqrt(host_params / seed_params)" in text
    assert "3 an input" in text


def test_with_two_files_a_prefix_selects_and_strips_that_files_side(
    dumps: dict[str, Path],
) -> None:
    # The seed inside the whole-model dump (A) against the seed-only dump (B): same tensors.
    result = run(str(dumps["step_1"]), str(dumps["seed"]), "--host-prefix", "seed.", "-f", "json")
    assert result.exit_code == ExitCode.OK
    doc = strict_json(result.stdout)
    assert doc["parameters"]["shared"] == 4
    assert {c["ratio"] for c in doc["parameters"]["changes"]} == {1.0}
    assert doc["dual"]["normalized_ratio"] == 1.0
    assert len(doc["skipped"]) == 35
    assert doc["skipped"][0]["side"] == "host"
    assert doc["skipped"][0]["reason"] == (
        "name does not start with --host-prefix 'seed.'; not compared"
    )
