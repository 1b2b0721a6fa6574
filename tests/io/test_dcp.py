"""``torch.distributed.checkpoint`` directories made by real ``dcp.save``.

Each checkpoint is checked against scanning the same state saved whole with
``torch.save`` (same names, same stats) and against the float64 reference. The sharded
case runs two gloo processes (``tests/dcp_worker.py``): an FSDP2 model with its AdamW
state, and DTensors with NaN/Inf/huge/tiny values split unevenly along either dimension.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode, scan_paths
from gradaudit.cli import app
from gradaudit.errors import InputError
from gradaudit.io import open_source
from gradaudit.io.base import Pieces
from gradaudit.io.dcp import DcpSource
from gradaudit.policy import Role
from gradaudit.results import Report, TensorStats
from tests.conftest import runner
from tests.dcp_worker import planted
from tests.hostile import OpenMarker, marker, member_names, member_span
from tests.io.test_pickle_budget import bomb_pt
from tests.reference import reference_stats
from tests.scan.test_distributed import clean_env
from tests.torch_features import requires_torch_2_6

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _dcp_save(state: dict[str, Any], directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(directory))


def _training_state() -> dict[str, Any]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "extra": planted(), "step": 4}


def _by_name(report: Report) -> dict[str, TensorStats]:
    return {t.name: t for t in report.tensors}


def assert_same_stats(dcp_report: Report, whole_report: Report) -> None:
    """Same tensors by name; counts and maxima exact, norms to merge-order rounding."""
    got, want = _by_name(dcp_report), _by_name(whole_report)
    assert list(got)
    assert sorted(got) == sorted(want)
    for name, stats in got.items():
        other = want[name]
        assert (stats.shape, stats.dtype, stats.numel) == (other.shape, other.dtype, other.numel)
        assert (stats.nan, stats.pos_inf, stats.neg_inf, stats.zeros) == (
            other.nan,
            other.pos_inf,
            other.neg_inf,
            other.zeros,
        ), name
        assert stats.max_abs == other.max_abs, name
        assert stats.norm == pytest.approx(other.norm, rel=1e-12, abs=0.0), name
    skipped = {s.name for s in dcp_report.skipped}
    assert {n for n in skipped if n.endswith(".step")} == {
        s.name for s in whole_report.skipped if s.name.endswith(".step")
    }


def assert_reference(report: Report, prefix: str = "extra.") -> None:
    for name, whole in planted().items():
        stats = _by_name(report)[prefix + name]
        ref = reference_stats(whole)
        assert (stats.nan, stats.pos_inf, stats.neg_inf, stats.zeros) == (
            ref.nan,
            ref.pos_inf,
            ref.neg_inf,
            ref.zeros,
        )
        assert stats.max_abs == ref.max_abs
        assert math.isfinite(stats.norm)
        assert stats.norm == pytest.approx(ref.norm, rel=1e-6, abs=0.0)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A single-process ``dcp.save`` and the same state through ``torch.save``."""
    out = tmp_path_factory.mktemp("dcp_plain")
    state = _training_state()
    _dcp_save(state, out / "ckpt")
    torch.save(state, out / "whole.pt")
    return out / "ckpt", out / "whole.pt"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two gloo ranks save FSDP2 + DTensor state with ``dcp.save``; rank 0 the gathered file."""
    out = tmp_path_factory.mktemp("dcp_gloo")
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.dcp_worker", str(rank), "2", str(out)],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [worker.communicate(timeout=TIMEOUT_S) for worker in workers]
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
            worker.communicate()
        pytest.fail(f"the gloo workers did not finish within {TIMEOUT_S} s")
    for rank, (worker, (_, stderr)) in enumerate(zip(workers, outputs, strict=True)):
        assert worker.returncode == 0, f"rank {rank} failed:\n{stderr}"
    return out / "sharded", out / "gathered.pt"


def test_plain_dcp_checkpoint_equals_the_same_state_saved_whole(plain: tuple[Path, Path]) -> None:
    directory, whole = plain
    report = scan_paths([directory], device="cpu")
    assert report.files[0].path == str(directory)
    assert_same_stats(report, scan_paths([whole], device="cpu"))
    assert_reference(report)
    bytes_entries = {s.name for s in report.skipped if "saved as bytes" in s.reason}
    assert "step" in bytes_entries
    assert "optim.param_groups.0.lr" in bytes_entries


@pytest.mark.slow  # the sharded fixture: two gloo processes, ~4 s
@requires_torch_2_6
def test_sharded_dcp_checkpoint_equals_the_gathered_state(sharded: tuple[Path, Path]) -> None:
    directory, gathered = sharded
    assert sorted(p.name for p in directory.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    report = scan_paths([directory], device="cpu")
    assert_same_stats(report, scan_paths([gathered], device="cpu"))
    assert_reference(report)
    stats = _by_name(report)
    assert stats["extra.specials"].nan == 2
    assert stats["extra.specials"].pos_inf == 1
    assert "model.0.weight" in stats
    assert "optim.state.0.weight.exp_avg_sq" in stats


@pytest.mark.slow  # the sharded fixture: two gloo processes, ~4 s
@requires_torch_2_6
def test_sharded_tensors_really_come_in_pieces(sharded: tuple[Path, Path]) -> None:
    """Every sharded tensor is read chunk by chunk (two files), never put together."""
    source = DcpSource(str(sharded[0]))
    chunks = {t.name: t.chunks for t in source.tensors}
    assert {len(chunks[f"extra.{n}"]) for n in planted()} == {2}
    assert {c.file for c in chunks["extra.specials"]} == {"__0_0.distcp", "__1_0.distcp"}
    assert [c.sizes for c in chunks["extra.specials"]] == [(51,), (50,)]
    assert [c.sizes for c in chunks["extra.tiny64_cols"]] == [(9, 20), (9, 20)]
    items = list(source.items())
    pieces = [item for item in items if isinstance(item, Pieces)]
    assert {p.name for p in pieces} >= {f"extra.{n}" for n in planted()}
    specials = next(p for p in pieces if p.name == "extra.specials")
    assert [tuple(t.shape) for t in specials.load()] == [(51,), (50,)]


@pytest.mark.slow  # the sharded fixture: two gloo processes, ~4 s
@requires_torch_2_6
def test_the_cli_scans_a_dcp_directory_and_flags_its_nan(sharded: tuple[Path, Path]) -> None:
    result = runner.invoke(app, ["scan", str(sharded[0]), "--format", "json"])
    assert result.exit_code == ExitCode.FINDINGS, result.stderr
    assert '"extra.specials"' in result.stdout


def test_include_leaves_chunks_unread(plain: tuple[Path, Path]) -> None:
    report = scan_paths([plain[0]], device="cpu", include=["model.*"])
    assert {t.name for t in report.tensors} == {
        "model.0.weight",
        "model.0.bias",
        "model.1.weight",
        "model.1.bias",
    }


def test_a_dcp_directory_found_by_a_recursive_search(plain: tuple[Path, Path]) -> None:
    report = scan_paths([plain[0].parent], device="cpu", recursive=True)
    assert {f.path for f in report.files} == {str(plain[0]), str(plain[1])}


# --- hostile and broken checkpoints ----------------------------------------------------


def _copy(directory: Path, to: Path) -> Path:
    to.mkdir()
    for path in directory.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def _real_metadata(directory: Path) -> Any:
    with (directory / ".metadata").open("rb") as handle:
        return pickle.load(handle)  # our own test file: the reader under test never does this


def _rewrite(directory: Path, metadata: Any) -> None:
    with (directory / ".metadata").open("wb") as handle:
        pickle.dump(metadata, handle)


def test_metadata_with_a_foreign_global_is_refused_and_nothing_runs(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    metadata = _real_metadata(directory)
    metadata.planner_data = {"model.0.weight": OpenMarker(marker(tmp_path))}
    _rewrite(directory, metadata)
    with pytest.raises(InputError) as error:
        open_source(directory)
    assert "refused as unsafe or corrupt" in error.value.cause
    assert "builtins" in error.value.cause or "io.open" in error.value.cause
    assert not marker(tmp_path).exists()


def test_a_data_file_outside_the_directory_is_refused(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    metadata = _real_metadata(directory)
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    _rewrite(directory, metadata)
    with pytest.raises(InputError, match="outside the directory"):
        open_source(directory)


def test_a_truncated_data_file_is_an_input_error_in_the_cli(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    data = directory / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    result = runner.invoke(app, ["scan", str(directory), str(good), "--format", "json"])
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "truncated?" in result.stderr
    assert "Traceback" not in result.stderr
    assert [t["name"] for t in json.loads(result.stdout)["tensors"]] == ["w"]


def test_a_missing_data_file_is_named(plain: tuple[Path, Path], tmp_path: Path) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    (directory / "__0_0.distcp").unlink()
    with pytest.raises(InputError, match=r'data file "__0_0\.distcp" is missing'):
        open_source(directory)


def test_a_chunk_of_the_wrong_shape_is_refused(plain: tuple[Path, Path], tmp_path: Path) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    metadata = _real_metadata(directory)
    entry = metadata.state_dict_metadata["extra.huge64"]
    entry.chunks[0].sizes = torch.Size([7, 10])
    entry.size = torch.Size([7, 10])
    for index in metadata.storage_data:
        index.__dict__.pop("index", None)
    _rewrite(directory, metadata)
    result = scan_paths([directory], device="cpu")
    (problem,) = result.errors
    assert "extra.huge64" in problem.message
    assert "metadata says float64 [7, 10]" in problem.message


@pytest.mark.slow  # the sharded fixture (two gloo processes) and torchrun
@requires_torch_2_6
def test_under_torchrun_the_chunks_are_split_and_the_report_is_the_single_process_one(
    sharded: tuple[Path, Path],
) -> None:
    """Each rank loads only its share of the chunks; every rank reports what one process would."""
    from gradaudit.report.formats.json import to_document

    directory, gathered = sharded
    results = [
        json.loads((directory.parent / f"rank{rank}.json").read_text(encoding="utf-8"))
        for rank in range(2)
    ]
    assert results[0]["document"] == results[1]["document"]
    source = DcpSource(str(directory))
    audited = [t for t in source.tensors if source.skipped(t) is None]
    reads = [r["chunks_read"] for r in results]
    assert sum(reads) == sum(len(t.chunks) for t in audited)  # each chunk read once
    assert min(reads) > 0  # by both ranks
    single = to_document(scan_paths([directory, gathered], device="cpu"))
    got = results[0]["document"]
    assert len(got["files"]) == len(single["files"]) == 2
    for mine, theirs in zip(got["files"], single["files"], strict=True):
        assert mine["global_norm"] == pytest.approx(theirs["global_norm"], rel=1e-12)
        mine.pop("global_norm")
        theirs.pop("global_norm")
        assert mine == theirs
    assert [t["name"] for t in got["tensors"]] == [t["name"] for t in single["tensors"]]
    for mine, theirs in zip(got["tensors"], single["tensors"], strict=True):
        for key in ("shape", "numel", "nan", "pos_inf", "neg_inf", "zeros", "max_abs", "file"):
            assert mine[key] == theirs[key], (mine["name"], key)
        assert mine["norm"] == pytest.approx(theirs["norm"], rel=1e-12), mine["name"]
    assert [s["name"] for s in got["skipped"]] == [s["name"] for s in single["skipped"]]


# -- hostile-but-loadable metadata (issue 29 item 4): the input's error, the good file reported


def _scan_beside_good(directory: Path, tmp_path: Path) -> Any:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    result = runner.invoke(
        app, ["scan", str(directory), str(good), "--format", "json", "--no-config"]
    )
    assert "Traceback" not in result.stdout + result.stderr
    assert [t["name"] for t in json.loads(result.stdout)["tensors"]][-1] == "w"
    return result


def test_a_field_named_get_does_not_shadow_the_reader(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    metadata = _real_metadata(directory)
    metadata.get = 5  # lands in the pickled state next to the real fields
    _rewrite(directory, metadata)
    result = _scan_beside_good(directory, tmp_path)
    assert result.exit_code in (ExitCode.OK, ExitCode.FINDINGS), result.stderr
    assert result.stderr == ""


def test_transform_descriptors_that_are_not_names_are_refused(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    metadata = _real_metadata(directory)
    for info in metadata.storage_data.values():
        info.transform_descriptors = 7
    _rewrite(directory, metadata)
    result = _scan_beside_good(directory, tmp_path)
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "transform_descriptors that are not names" in result.stderr


def test_a_dimension_past_int64_is_refused_by_the_metadata_check(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    metadata = _real_metadata(directory)
    name = next(k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks"))
    metadata.state_dict_metadata[name].size = (0, 2**64)
    _rewrite(directory, metadata)
    result = _scan_beside_good(directory, tmp_path)
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "fewer than 2**63 elements" in result.stderr


def test_a_pickled_float_too_large_for_a_float_is_the_inputs_error(
    plain: tuple[Path, Path], tmp_path: Path
) -> None:
    directory = _copy(plain[0], tmp_path / "ckpt")
    (directory / ".metadata").write_bytes(b"(F1e99999\nl.")  # OverflowError in _pickle
    result = _scan_beside_good(directory, tmp_path)
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert ".metadata is truncated or corrupt (OverflowError" in result.stderr


def test_optimizer_state_in_a_dcp_checkpoint_keeps_its_role(tmp_path: Path) -> None:
    """``get_state_dict``'s ``optim.state.<fqn>.exp_avg`` are moments, ``model.…`` weights:
    the moments of a healthy run were judged as weights (outlier warnings) before."""
    state = _training_state()
    del state["extra"]
    _dcp_save(state, tmp_path / "ckpt")
    report = scan_paths([tmp_path / "ckpt"], device="cpu")
    roles = {t.name: t.role for t in report.tensors}
    assert roles["optim.state.0.weight.exp_avg"] is Role.OPTIMIZER_MOMENT
    assert roles["optim.state.0.weight.exp_avg_sq"] is Role.OPTIMIZER_SECOND_MOMENT
    assert roles["model.0.weight"] is Role.WEIGHT
    assert report.files[0].read_as == "training checkpoint"
    assert not report.files[0].evidence_thin


# -- bombs inside .distcp chunks (issue 29 items 3 and 5): the guards of a .pt file --------


def _with_chunk(tmp_path: Path, payload: bytes, sizes: list[int]) -> Path:
    """A real ``dcp.save`` checkpoint whose tensor ``bomb`` is ``payload`` (a chunk archive)
    of global shape ``sizes``, stored in a ``.distcp`` of its own."""
    directory = tmp_path / "ckpt"
    _dcp_save({"bomb": torch.zeros(4), "ok": torch.ones(3)}, directory)
    metadata = _real_metadata(directory)
    (directory / "__9_0.distcp").write_bytes(payload)
    entry = metadata.state_dict_metadata["bomb"]
    entry.size = entry.chunks[0].sizes = torch.Size(sizes)
    for index, info in metadata.storage_data.items():
        if index.fqn == "bomb":
            info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(payload)
    _rewrite(directory, metadata)
    return directory


def _saved(value: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_expanded_tensor_in_a_chunk_is_refused_unread(tmp_path: Path) -> None:
    """``torch.zeros(1).expand(2**40)`` is 1.5 KB as a chunk; reducing it ran past 60 s."""
    directory = _with_chunk(tmp_path, _saved(torch.zeros(1).expand(2**40)), [2**40])
    started = time.monotonic()
    result = _scan_beside_good(directory, tmp_path)
    assert time.monotonic() - started < 30
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr.count("\n") == 1
    assert (
        f'{directory}: "bomb" (chunk at [0] in "__9_0.distcp") holds an expanded view: '
        "1,099,511,627,776 elements over 1 stored (a zero stride); refused unread"
    ) in result.stderr


def test_a_pickle_memory_bomb_in_a_chunk_is_refused_before_torch_load(tmp_path: Path) -> None:
    """10 MB of ``EMPTY_SET`` as a chunk's ``data.pkl`` took 31 s and 2.6 GB to unpickle."""
    writer_path = tmp_path / "chunk.pt"
    bomb_pt(writer_path, b"\x80\x02" + b"\x8f" * (10 << 20) + b".")
    directory = _with_chunk(tmp_path, writer_path.read_bytes(), [4])
    before = _peak_mib()
    result = _scan_beside_good(directory, tmp_path)
    assert _peak_mib() - before < 150
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert '"bomb" (chunk at [0] in "__9_0.distcp"): pickle would build more than' in (
        result.stderr
    )
    assert "memory bomb" in result.stderr


def test_a_chunk_with_a_flipped_byte_fails_its_crc_check(tmp_path: Path) -> None:
    """The container checks of a .pt file: torch reads a chunk's zip without CRCs, so a
    flipped bit in its values loaded silently as a wrong value before."""
    chunk = tmp_path / "chunk.pt"
    chunk.write_bytes(_saved(torch.ones(4)))
    (values,) = [name for name in member_names(chunk) if name.endswith("/data/0")]
    start, length = member_span(chunk, values)
    payload = bytearray(chunk.read_bytes())
    payload[start + length - 1] ^= 0x40
    directory = _with_chunk(tmp_path, bytes(payload), [4])
    result = _scan_beside_good(directory, tmp_path)
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "fails its CRC-32 check" in result.stderr


def test_a_chunk_at_an_offset_passes_the_same_checks(plain: tuple[Path, Path]) -> None:
    """Real chunks sit at byte offsets inside shared .distcp files: still read."""
    source = DcpSource(str(plain[0]))
    assert any(chunk.start > 0 for tensor in source.tensors for chunk in tensor.chunks)
    assert not scan_paths([plain[0]], device="cpu").errors
