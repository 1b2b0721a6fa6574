"""Stats across ranks: two gloo processes on the CPU against single-process stats.

The two ranks run ``tests/distributed_worker.py`` as separate processes that
meet through a file in ``tmp_path`` (no port to race for), bounded by a
timeout. Their results are compared here with the engine on the whole tensors
in this process and with the independent float64 reference.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gradaudit import ExitCode, audit, scan_paths
from gradaudit.cli import app
from gradaudit.errors import UsageError
from gradaudit.io.safetensors_header import read_header
from gradaudit.report.formats.json import to_document
from gradaudit.scan.distributed import TorchrunEnv, assign_sources, torchrun_env
from tests.conftest import runner
from tests.distributed_worker import CUTS, dtensor_cases, whole_tensors
from tests.ranks import ROOT, TIMEOUT_S, WORLD, clean_env, run_ranks
from tests.reference import reference_stats

#: Slow (not in the quick loop): starts torchrun and gloo process groups.
pytestmark = pytest.mark.slow


@contextmanager
def one_thread() -> Iterator[None]:
    """CPU reductions sum in a thread-dependent order; compare bit for bit at equal threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def scan_inputs(directory: Path) -> list[str]:
    """Several dumps of different sizes, one with NaN/Inf/1e200, one corrupt, one missing."""
    directory.mkdir()
    gen = torch.Generator().manual_seed(3)
    paths = []
    for index in range(5):
        tensors = {
            f"f{index}.w{j}": torch.randn(60 * (index + 1), 37, generator=gen) * 10.0 ** (j - 2)
            for j in range(3)
        }
        tensors[f"f{index}.step"] = torch.tensor([index])
        if index == 2:
            tensors["f2.w0"][3, 3] = math.nan
            tensors["f2.w1"][0, 0] = -math.inf
        if index == 3:
            tensors["f3.huge"] = torch.full((10,), 1e200, dtype=torch.float64)
        path = directory / f"f{index}.safetensors"
        save_file(tensors, str(path))
        paths.append(str(path))
    corrupt = directory / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    paths.insert(2, str(corrupt))
    paths.append(str(directory / "missing.safetensors"))
    return paths


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("gloo")
    paths = scan_inputs(out / "scan")
    (out / "scan_paths.txt").write_text("\n".join(paths), encoding="utf-8")
    results = run_ranks("tests.distributed_worker", out, "gloo")
    return out, results


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in result["tensors"]}


def assert_whole(got: dict[str, Any], whole: torch.Tensor) -> None:
    """Sharded stats against the engine on the whole tensor and the float64 reference."""
    (single,) = audit({"t": whole}).tensors
    ref = reference_stats(whole)
    counts = (got["nan"], got["pos_inf"], got["neg_inf"], got["zeros"])
    assert counts == (single.nan, single.pos_inf, single.neg_inf, single.zeros)
    assert counts == (ref.nan, ref.pos_inf, ref.neg_inf, ref.zeros)
    assert got["numel"] == whole.numel()
    assert got["max_abs"] == single.max_abs == ref.max_abs
    assert math.isfinite(got["norm"])
    assert got["norm"] == pytest.approx(single.norm, rel=1e-12, abs=0.0)
    assert got["norm"] == pytest.approx(ref.norm, rel=1e-6, abs=0.0)


def test_ranks_agree(gloo_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, (first, second) = gloo_run
    for case in ("group", "dtensor"):
        assert first[case]["tensors"] == second[case]["tensors"], case
        assert first[case]["global_norm"] == second[case]["global_norm"], case


def test_group_shards_give_whole_parameter_stats(
    gloo_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = gloo_run
    wholes = whole_tensors()
    got = by_name(results[0]["group"])
    audited = {name: t for name, t in wholes.items() if t.is_floating_point()}
    assert set(got) == set(audited)
    for name, whole in audited.items():
        assert_whole(got[name], whole)
        # The layout of the whole tensor is unknown with group=: 1-D, summed count.
        assert got[name]["shape"] == [whole.numel()]
        assert got[name]["dtype"] == str(whole.dtype).removeprefix("torch.")
    assert results[0]["group"]["skipped"] == [
        ["ints", "dtype int64 is not floating-point; not audited"]
    ]
    single = audit(audited).summary.global_norm
    assert results[0]["group"]["global_norm"] == pytest.approx(single, rel=1e-12)


def test_group_case_really_splits() -> None:
    """The cases cover the risks: NaN/Inf on both sides, an empty side, zeros vs 1e-300s."""
    wholes = whole_tensors()
    specials = wholes["fp32_specials"]
    cut = CUTS["fp32_specials"]
    assert specials[:cut].isnan().any()
    assert specials[cut:].isnan().any()
    assert wholes["fp64_tiny_half_zero"][: CUTS["fp64_tiny_half_zero"]].eq(0).all()
    assert wholes["all_on_rank0"][CUTS["all_on_rank0"] :].numel() == 0
    assert reference_stats(wholes["fp64_tiny_half_zero"]).norm > 0


def test_dtensor_shards_give_whole_parameter_stats(
    gloo_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = gloo_run
    result = results[0]["dtensor"]
    got = by_name(result)
    wholes = dtensor_cases()
    for name, whole in wholes.items():
        if name == "partial":
            continue
        assert_whole(got[name], whole)
        assert got[name]["shape"] == list(whole.shape)
    assert "partial" not in got
    (skipped,) = result["skipped"]
    assert skipped[0] == "partial"
    assert "Partial placement" in skipped[1]
    # The risks are real: rank 1's single_row shard is empty, replicated data is whole on both.
    assert results[1]["dtensor"]["local_numels"]["single_row"] == 0
    assert results[1]["dtensor"]["local_numels"]["replicate"] == 9
    assert results[1]["dtensor"]["local_numels"]["mesh2d_replicate_shard"] == 12
    # The single-process API refuses a DTensor instead of auditing a shard as the whole.
    assert "is a DTensor" in results[0]["dtensor"]["audit_error"]


def test_fsdp2_stats_match_the_gathered_dump(
    gloo_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, results = gloo_run
    dump = out / "fsdp.safetensors"
    header = read_header(dump)
    assert header.metadata["step"] == "1"
    with safe_open(str(dump), framework="pt") as handle:
        gathered = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    assert set(gathered) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert gathered["0.weight"].shape == (7, 5)
    got = by_name(results[0]["fsdp"])
    for name, whole in gathered.items():
        assert_whole(got[name], whole)
        assert got[name]["shape"] == list(whole.shape)


def test_monitor_sees_a_nan_from_one_rank_on_every_rank(
    gloo_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, results = gloo_run
    for result in results:
        assert result["fsdp"]["monitor_nonfinite"] == ["0.weight"]
        assert result["fsdp"]["monitor_dump"] == "step_00000000.safetensors"
    (dump,) = (out / "dumps").iterdir()  # rank 0 alone wrote the gathered gradients
    with safe_open(str(dump), framework="pt") as handle:
        weight = handle.get_tensor("0.weight")
    assert weight.shape == (7, 5)
    assert int(weight.isnan().sum()) == 1
    assert bool(weight[4, 0].isnan())  # rank 1's shard starts at row 4 of 7


def test_distributed_scan_equals_single_process_scan(
    gloo_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, results = gloo_run
    paths = (out / "scan_paths.txt").read_text(encoding="utf-8").splitlines()
    with one_thread():
        single = to_document(scan_paths(paths, device="cpu"))
    single.pop("elapsed_s")
    for result in results:
        assert result["scan"]["document"] == json.loads(json.dumps(single))
    assert single["summary"]["input_errors"] == 2
    assert single["summary"]["nan_tensors"] == 1


def test_torchrun_cli_scan_equals_single_process(tmp_path: Path) -> None:
    paths = scan_inputs(tmp_path / "inputs")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(WORLD), "-m", "gradaudit", "scan", *paths]
    command += ["--format", "json"]
    result = subprocess.run(
        command,
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    with one_thread():
        single = runner.invoke(app, ["scan", *paths, "--format", "json"])
    assert single.exit_code == ExitCode.INPUT_ERROR
    distributed = json.loads(result.stdout)  # one document: rank 0 alone prints
    expected = json.loads(single.stdout)
    distributed.pop("elapsed_s")
    expected.pop("elapsed_s")
    assert distributed == expected
    # torchrun turns a worker's non-zero status into its own failure (status 1).
    assert result.returncode != 0
    assert result.stderr.count("gradaudit: error: ") == 2, result.stderr
    assert f"gradaudit: error: {paths[2]}: " in result.stderr


def test_assign_sources_balances_bytes_and_keeps_input_order() -> None:
    shares = assign_sources([10, 100, 0, 50, 60, 0], 2)
    assert shares == [[0, 1, 2], [3, 4, 5]]  # 110 + 1 bytes each
    assert sorted(i for share in shares for i in share) == list(range(6))
    assert assign_sources([5], 3) == [[0], [], []]
    assert assign_sources([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        assign_sources([1], 0)


def test_torchrun_env() -> None:
    assert torchrun_env({}) is None
    assert torchrun_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    job = torchrun_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert job == TorchrunEnv(rank=3, world_size=4, local_rank=1)
    with pytest.raises(UsageError, match="must be integers"):
        torchrun_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(UsageError, match="outside"):
        torchrun_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_cli_distributed_flag_without_torchrun_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    result = runner.invoke(app, ["scan", str(path), "--distributed"], env=clean_env())
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert "not started by torchrun" in result.stderr


def test_cli_no_distributed_ignores_a_torchrun_environment(tmp_path: Path) -> None:
    """A scan started from inside a torchrun job must not try to join it."""
    path = tmp_path / "g.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    result = runner.invoke(app, ["scan", str(path), "--no-distributed"], env=env)
    assert result.exit_code == ExitCode.OK, result.stderr
    assert "Audited 1 tensor" in result.stdout


def test_cli_device_index_under_torchrun_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    # --distributed: the test process's parent is no launcher, so it would scan alone.
    command = ["scan", str(path), "--device", "cuda:1", "--distributed"]
    result = runner.invoke(app, command, env=env)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert "give no index" in result.stderr


def test_cli_incomplete_torchrun_environment_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    command = ["scan", str(path), "--device", "cpu", "--distributed"]
    result = runner.invoke(app, command, env=env)
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert result.stdout == ""
    assert "cannot join the torchrun job" in result.stderr
    assert "MASTER_ADDR" in result.stderr


def test_a_scan_run_from_inside_a_training_job_scans_alone(tmp_path: Path) -> None:
    """A rank's subprocess inherits RANK/WORLD_SIZE: joining waited forever (killed after
    45-60 s) for ranks that never come. Not started by a launcher, it scans alone."""
    path = tmp_path / "g.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29513")
    result = subprocess.run(
        [sys.executable, "-m", "gradaudit", "scan", str(path), "--format", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == ExitCode.OK, result.stderr
    assert json.loads(result.stdout)["summary"]["tensors"] == 1
    assert "not started by torchrun: scanning alone" in result.stderr


def test_only_a_launchers_child_joins_by_itself() -> None:
    from gradaudit.scan.torchrun import launched_as_rank, parent_command

    assert launched_as_rank(["/usr/bin/python3", "/usr/bin/torchrun", "--nproc-per-node", "2"])
    assert launched_as_rank(["/venv/bin/torchrun", "-m", "gradaudit", "scan", "ckpt"])
    assert launched_as_rank(["python", "-m", "torch.distributed.run", "--standalone", "x.py"])
    assert not launched_as_rank(["python", "train.py", "--lr", "3e-4"])
    # A launcher's name elsewhere in the arguments is not a launcher.
    assert not launched_as_rank(["python", "-m", "pytest", "-k", "torchrun or deepspeed"])
    assert launched_as_rank(None)  # no /proc: as before, the environment decides
    own = parent_command(os.getpid())
    assert own is None or any("python" in arg or "pytest" in arg for arg in own)
