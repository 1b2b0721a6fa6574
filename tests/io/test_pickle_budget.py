"""Pickle memory bombs (issue 29 item 5): refused by their opcodes before any unpickling.

5 MB of ``EMPTY_SET`` opcodes is ~1.1 GB of sets once unpickled; as a DCP ``.metadata``,
a zip checkpoint's ``data.pkl`` or a legacy ``torch.save`` file it is refused with exit 3
and a message saying what was exceeded, and the healthy file beside it is reported.
"""

from __future__ import annotations

import pickle
import resource
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from gradaudit import ExitCode
from gradaudit.io import pickle_budget
from gradaudit.io.pickle_budget import budget_problem
from tests.hostile import good_safetensors
from tests.io.test_hostile_inputs import assert_one_line_error, scan

BOMBS = {
    "EMPTY_SET": b"\x8f",
    "EMPTY_LIST": b"]",
    "EMPTY_DICT": b"}",
    "MARK": b"(",
}
SIZE = 5_000_000


def bomb(op: bytes, protocol: int = 4) -> bytes:
    return bytes([0x80, protocol]) + op * SIZE + b"."


def bomb_pt(path: Path, body: bytes) -> Path:
    """A zip checkpoint whose ``data.pkl`` is ``body``, written by torch's own zip writer."""
    writer = torch._C.PyTorchFileWriter(str(path))
    records = (("data.pkl", body), ("byteorder", b"little"), ("version", b"3\n"))
    for name, data in records:
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return path


def dcp_dir(tmp_path: Path, metadata: bytes) -> Path:
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(directory))
    (directory / ".metadata").write_bytes(metadata)
    return directory


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("op", sorted(BOMBS))
def test_the_bombs_are_over_budget(op: str) -> None:
    problem = budget_problem(bomb(BOMBS[op]))
    assert problem is not None
    assert "MiB of objects" in problem


def test_real_pickles_fit_the_budget(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    for value in (optimizer.state_dict(), model.state_dict(), {"a": list(range(10**5))}):
        assert budget_problem(pickle.dumps(value, protocol=2)) is None
        assert budget_problem(pickle.dumps(value, protocol=5)) is None


@pytest.mark.parametrize(
    ("body", "cause"),
    [
        (b"\x80\x02]r\xff\xff\xff\x7f.", "memo index 2147483647 is out of range"),
        (b"(]p99999999999999999999999\n.", "memo index 99999999999999999999999 is out"),
        (b"\x80\x04\x8e" + (2**62).to_bytes(8, "little") + b"x.", "corrupt pickle data"),
        (b"\x80\x04\x8e" + (2**64 - 1).to_bytes(8, "little") + b"x.", "corrupt pickle data"),
    ],
    ids=["long_binput", "text_put", "binbytes8", "binbytes8_max"],
)
def test_memo_indices_and_lengths_are_checked_before_unpickling(body: bytes, cause: str) -> None:
    problem = budget_problem(body)
    assert problem is not None
    assert cause in problem


@pytest.fixture(params=sorted(BOMBS))
def any_bomb(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Each one-opcode bomb, for the tests of where a bomb is refused (DCP metadata, a zip
    checkpoint's ``data.pkl``). ``EMPTY_SET`` is the real 5 MB one under the real floor;
    the others are 200,000 opcodes under a floor of 1 MiB: the same walk over the same
    opcode, refused by the ratio, for a twenty-fifth of the time
    (``test_the_bombs_are_over_budget`` holds every one to the real constants)."""
    op = BOMBS[request.param]
    if request.param == "EMPTY_SET":
        return bomb(op)
    monkeypatch.setattr(pickle_budget, "FLOOR_BYTES", 1 << 20)
    return bytes([0x80, 4]) + op * 200_000 + b"."


def test_a_bomb_as_dcp_metadata_is_refused_unread(any_bomb: bytes, tmp_path: Path) -> None:
    bad = dcp_dir(tmp_path, any_bomb)
    good = good_safetensors(tmp_path)
    before = _peak_mib()

    result = scan(str(good), str(bad))

    line = assert_one_line_error(result, bad, ".metadata: pickle would build more than")
    assert "memory bomb" in line
    assert "good.weight" in result.stdout
    assert _peak_mib() - before < 150  # the sets would be ~1.1 GB


def test_a_bomb_as_data_pkl_is_refused_before_torch_load(any_bomb: bytes, tmp_path: Path) -> None:
    bad = bomb_pt(tmp_path / "bomb.pt", any_bomb)
    good = good_safetensors(tmp_path)

    result = scan(str(good), str(bad))

    assert_one_line_error(result, bad, "pickle would build more than")
    assert "good.weight" in result.stdout


def test_a_bomb_in_a_legacy_file_is_refused(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    magic = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
    assert data.startswith(magic)
    legacy.write_bytes(magic + bomb(BOMBS["EMPTY_SET"], protocol=2))

    result = scan(str(legacy))

    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "pickle would build more than" in result.stderr


def test_a_huge_memo_index_in_dcp_metadata_is_refused(tmp_path: Path) -> None:
    bad = dcp_dir(tmp_path, b"\x80\x02]r\xff\xff\xff\x7f.")
    result = scan(str(bad))
    assert_one_line_error(result, bad, "memo index 2147483647 is out of range")


def test_a_legacy_checkpoint_still_loads(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.tensor([3.0, 4.0])}, legacy, _use_new_zipfile_serialization=False)
    result = scan(str(legacy), "--format", "json")
    assert result.exit_code == ExitCode.OK, result.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
def test_a_real_dcp_metadata_fits_the_ratio_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy ``dcp.save`` of 100,000 tensors (20.6 MB of ``.metadata``) was refused as a
    memory bomb: its estimate reaches 35 bytes per pickled byte over its state-dict part,
    past the old ratio of 32. A 5,000-tensor one has the same density; with the floor out of
    the way, only the ratio judges it."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {f"model.layers.{i}.weight": torch.ones(2) for i in range(5000)},
            checkpoint_id=str(directory),
        )
    metadata = (directory / ".metadata").read_bytes()
    import gradaudit.io.pickle_budget as module

    monkeypatch.setattr(module, "FLOOR_BYTES", 1 << 20)
    assert budget_problem(metadata) is None
    for op in BOMBS.values():  # still over the ratio, without the floor's help
        assert budget_problem(bytes([0x80, 4]) + op * 200_000 + b".") is not None
