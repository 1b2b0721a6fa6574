"""Every hostile input of the issue, through the CLI, next to a good file.

Each bad input must end in exactly one stderr line that names the file and the cause,
exit code 3, no traceback, nothing executed, and the good file of the same run still
audited and reported. Property tests mutate valid files byte by byte and require the same
discipline: the CLI only ever exits 0, 1 or 3.
"""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner
from tests.hostile import (
    CASES,
    NOTHING_TO_AUDIT,
    TORCH_2_6_CASES,
    ExecMarker,
    OpenMarker,
    TouchMarker,
    data_pkl,
    good_safetensors,
    marker,
    member_span,
    patch_member,
)
from tests.torch_features import requires_torch_2_6

FUZZ_SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def scan(*args: str, timeout: float = 120.0) -> Any:
    """Run ``gradaudit scan`` in-process; fail (rather than hang the suite) if it blocks."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        outcome["result"] = runner.invoke(
            app, ["scan", *args], env={"COLUMNS": "120", "NO_COLOR": "1"}
        )

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"gradaudit scan {args} blocked"
    return outcome["result"]


def assert_one_line_error(result: Any, path: Path, cause: str) -> str:
    assert result.exit_code == ExitCode.INPUT_ERROR, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gradaudit: error: {path}: "), lines[0]
    assert cause in lines[0], lines[0]
    assert "weights_only=False" not in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=requires_torch_2_6) if n in TORCH_2_6_CASES else n
        for n in sorted(CASES)
    ],
)
def test_hostile_input_fails_alone_and_the_good_file_is_still_reported(
    name: str, tmp_path: Path
) -> None:
    bad = CASES[name].build(tmp_path)
    good = good_safetensors(tmp_path)

    result = scan(str(good), str(bad), "--format", "json")

    assert_one_line_error(result, bad, CASES[name].cause)
    document = json.loads(result.stdout)
    assert document["exit_code"] == ExitCode.INPUT_ERROR
    assert [t["name"] for t in document["tensors"]] == ["good.weight"]
    assert document["tensors"][0]["norm"] == 5.0
    assert [e["file"] for e in document["errors"]] == [str(bad)]
    assert not marker(tmp_path).exists()


@requires_torch_2_6
def test_all_hostile_inputs_in_one_run(tmp_path: Path) -> None:
    good = good_safetensors(tmp_path)
    bad = [case.build(tmp_path) for case in CASES.values()]

    result = scan(str(good), *map(str, bad))

    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == len(bad)
    for path, line in zip(bad, lines, strict=True):
        assert line.startswith(f"gradaudit: error: {path}: ")
    assert "good.weight" in result.stdout
    assert f"INCOMPLETE: {len(bad)} inputs could not be audited" in result.stdout
    assert not marker(tmp_path).exists()


def test_a_hostile_file_name_stays_on_one_escaped_line(tmp_path: Path) -> None:
    bad = tmp_path / "two\nlines\x1b[31m.pt"
    bad.write_text("version https://git-lfs.github.com/spec/v1\n")
    result = scan(str(bad), str(good_safetensors(tmp_path)))
    assert result.exit_code == ExitCode.INPUT_ERROR
    assert result.stderr.count("\n") == 1
    assert "two\\x0alines\\x1b[31m.pt: is a git-lfs pointer" in result.stderr
    assert "\x1b" not in result.stderr + result.stdout


def test_nothing_to_audit_alone_exits_3_but_not_next_to_audited_files(tmp_path: Path) -> None:
    ints = NOTHING_TO_AUDIT(tmp_path)
    alone = scan(str(ints))
    assert alone.exit_code == ExitCode.INPUT_ERROR
    assert alone.stderr == ("gradaudit: error: nothing to audit: no floating-point tensor found\n")
    assert "skipped step: dtype int64 is not floating-point; not audited" in alone.stdout

    together = scan(str(ints), str(good_safetensors(tmp_path)))
    assert together.exit_code == ExitCode.OK
    assert together.stderr == ""


# --------------------------------------------------------------------------- no code runs


PAYLOADS = [OpenMarker, ExecMarker, TouchMarker]


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.__name__)
def test_the_payloads_really_would_create_the_marker(payload: Any, tmp_path: Path) -> None:
    """Guards the tests below: an unpickler that runs code does create the marker."""
    target = marker(tmp_path)
    pickle.loads(pickle.dumps(payload(target)))  # the trusted, unsafe way: our own object
    assert target.exists()


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.__name__)
@pytest.mark.parametrize(
    "save",
    [
        pytest.param({}, id="zip"),
        pytest.param({"_use_new_zipfile_serialization": False}, id="legacy"),
        pytest.param({"pickle_protocol": 4}, id="protocol-4"),
    ],
)
def test_malicious_pickles_are_refused_and_never_run(
    payload: Any, save: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The variable that makes torch.load default to weights_only=False must not matter.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "x": payload(marker(tmp_path))}, path, **save)

    result = scan(str(path))

    line = assert_one_line_error(result, path, "refused as unsafe")
    assert "nothing from the file was run" in line
    assert not marker(tmp_path).exists()


def test_weights_only_is_passed_explicitly_with_mmap_for_zip_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    zipped = tmp_path / "zip.pt"
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, zipped)
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)

    assert scan(str(zipped), str(legacy)).exit_code == ExitCode.OK

    assert all(call["weights_only"] is True for call in calls)
    assert [(c["map_location"], c["mmap"]) for c in calls] == [
        ("meta", False),  # zip: the storage check reads data.pkl only
        ("cpu", True),  # zip: tensors memory-mapped
        ("cpu", False),  # legacy: cannot be memory-mapped
    ]


# --------------------------------------------------------------------------- properties


def assert_clean_outcome(result: Any, path: Path) -> None:
    """The only outcomes allowed for any bytes: audited (0/1) or one clean error line (3)."""
    assert result.exit_code in (ExitCode.OK, ExitCode.FINDINGS, ExitCode.INPUT_ERROR), (
        result.exit_code,
        result.stderr,
    )
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    if result.exit_code == ExitCode.INPUT_ERROR:
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("gradaudit: error: ")
        assert str(path) in lines[0] or "nothing to audit" in lines[0]
    else:
        assert lines == []


mutations = st.lists(
    st.tuples(st.integers(min_value=0), st.integers(min_value=0, max_value=255)),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, span: tuple[int, int], changes: list[tuple[int, int]]) -> bytes:
    start, size = span
    out = bytearray(data)
    for position, value in changes:
        out[start + position % size] = value
    return bytes(out)


@pytest.mark.slow
@FUZZ_SETTINGS
@given(changes=mutations, cut=st.one_of(st.none(), st.integers(min_value=1)))
def test_mutated_safetensors_headers_only_exit_0_1_or_3(
    tmp_path: Path, changes: list[tuple[int, int]], cut: int | None
) -> None:
    base = tmp_path / "base.safetensors"
    if not base.exists():
        save_file(
            {
                "a.weight": torch.randn(3, 4),
                "b.bias": torch.tensor([float("nan"), 1.0]),
                "steps": torch.arange(3),
            },
            str(base),
        )
    data = base.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    mutated = mutate(data, (0, header_end), changes)
    if cut is not None:
        mutated = mutated[: cut % len(mutated)]
    path = tmp_path / "fuzzed.safetensors"
    path.write_bytes(mutated)
    assert_clean_outcome(scan(str(path), "--format", "json"), path)


@pytest.mark.slow
@FUZZ_SETTINGS
@given(changes=mutations)
def test_mutated_checkpoint_pickles_only_exit_0_1_or_3(
    tmp_path: Path, changes: list[tuple[int, int]]
) -> None:
    """Damage data.pkl but keep its CRC right, so the bytes reach torch's unpickler."""
    base = tmp_path / "base.pt"
    if not base.exists():
        torch.save(
            {"model": {"w": torch.randn(4, 3), "b": torch.ones(2)}, "step": 3, "tags": [1, "x"]},
            base,
        )
    name = data_pkl(base)
    span = member_span(base, name)
    path = tmp_path / "fuzzed.pt"
    path.write_bytes(base.read_bytes())
    patched = mutate(base.read_bytes(), span, changes)[span[0] : span[0] + span[1]]
    patch_member(path, name, patched)
    assert_clean_outcome(scan(str(path), "--format", "json"), path)


@pytest.mark.slow
@FUZZ_SETTINGS
@given(changes=mutations, cut=st.one_of(st.none(), st.integers(min_value=1)))
def test_mutated_legacy_checkpoints_only_exit_0_1_or_3(
    tmp_path: Path, changes: list[tuple[int, int]], cut: int | None
) -> None:
    base = tmp_path / "base.pt"
    if not base.exists():
        torch.save(
            {"model": {"w": torch.randn(4, 3)}, "step": 3},
            base,
            _use_new_zipfile_serialization=False,
        )
    data = base.read_bytes()
    mutated = mutate(data, (0, len(data)), changes)
    if cut is not None:
        mutated = mutated[: cut % len(mutated)]
    path = tmp_path / "fuzzed.pt"
    path.write_bytes(mutated)
    assert_clean_outcome(scan(str(path), "--format", "json"), path)
