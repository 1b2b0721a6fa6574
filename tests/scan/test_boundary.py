"""The per-input boundary (:mod:`gradaudit.scan.boundary`): an exception while one input
is read is that input's error (exit 3); a defect in gradaudit is exit 4 — and in both
cases the healthy file beside it is still audited and reported.

Faults are planted with ``monkeypatch`` where a real hostile file would reach them, so
the rule is tested on its own, whatever the readers learn to check by name later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gradaudit import ExitCode, exit_code, scan_paths
from gradaudit.cli import app
from gradaudit.io import safetensors_map, torch_pickle
from gradaudit.scan import torch_free
from gradaudit.scan.pending import PendingStats
from tests.conftest import runner
from tests.hostile import good_checkpoint, good_safetensors


def scan(*args: str) -> Any:
    return runner.invoke(
        app, ["scan", "--no-config", *args], env={"COLUMNS": "120", "NO_COLOR": "1"}
    )


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scan ``.pt`` files with torch's reader, the one these tests wrap (a plain checkpoint
    would otherwise take the torch-free scan, whose boundary is tested on its own)."""
    monkeypatch.setattr(torch_free, "applies", lambda **_: False)


def _raising(error: Exception) -> Any:
    def fail(*args: object, **kwargs: object) -> Any:
        raise error

    return fail


def _assert_good_reported(result: Any) -> dict[str, Any]:
    assert "Traceback" not in result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert [t["name"] for t in document["tensors"]] == ["good.weight"]
    assert document["tensors"][0]["norm"] == 5.0
    return document


@pytest.mark.parametrize(
    "error",
    [
        TypeError("'int' object is not iterable"),
        OverflowError("Python int too large to convert to C ssize_t"),
        ValueError("bad value"),
        KeyError("state"),
        RecursionError("maximum recursion depth exceeded"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_unexpected_exception_in_a_reader_is_that_inputs_error(
    error: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torch_path(monkeypatch)
    good, bad = good_safetensors(tmp_path), good_checkpoint(tmp_path)
    monkeypatch.setattr(torch_pickle.TorchPickleSource, "items", _raising(error))

    result = scan(str(good), str(bad), "--format", "json")

    assert result.exit_code == ExitCode.INPUT_ERROR, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gradaudit: error: {bad}: malformed: reading it raised "), lines[0]
    assert type(error).__name__ in lines[0]
    document = _assert_good_reported(result)
    assert document["exit_code"] == 3
    assert document["errors"] == [{"file": str(bad), "message": lines[0].split(": ", 3)[3]}]


def test_an_unexpected_exception_in_a_lazy_piece_is_that_inputs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces are loaded while the engine consumes them: still the reader's step."""
    from tests.io.test_deepspeed import write_zero2

    good = good_safetensors(tmp_path)
    write_zero2(tmp_path / "ds")
    monkeypatch.setattr("gradaudit.io.deepspeed._slicer", lambda *a: _raising(TypeError("x")))

    result = scan(str(good), str(tmp_path / "ds"), "--format", "json")

    assert result.exit_code == ExitCode.INPUT_ERROR, result.stderr
    assert result.stderr.startswith(f"gradaudit: error: {tmp_path / 'ds'}: malformed: ")
    _assert_good_reported(result)


def test_the_torch_free_path_has_the_same_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = good_safetensors(tmp_path)
    bad = good_safetensors(tmp_path, "bad.safetensors")
    real = safetensors_map.MappedSafetensors.__init__

    def init(self: Any, path: str, *args: Any) -> None:
        if path == str(bad):
            raise IndexError("list index out of range")
        real(self, path, *args)

    monkeypatch.setattr(safetensors_map.MappedSafetensors, "__init__", init)

    result = scan(str(good), str(bad), "--format", "json", "--device", "cpu")

    assert result.exit_code == ExitCode.INPUT_ERROR, result.stderr
    assert result.stderr.startswith(f"gradaudit: error: {bad}: malformed: reading it raised ")
    _assert_good_reported(result)


def test_a_code_defect_in_a_reader_is_exit_4_and_the_others_are_still_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torch_path(monkeypatch)
    good, bad = good_safetensors(tmp_path), good_checkpoint(tmp_path)
    monkeypatch.setattr(
        torch_pickle.TorchPickleSource, "items", _raising(NameError("name 'x' is not defined"))
    )

    result = scan(str(good), str(bad), "--format", "json")

    assert result.exit_code == ExitCode.INTERNAL_ERROR, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gradaudit: internal error: {bad}: NameError: "), lines[0]
    assert "this is a bug in gradaudit, not a problem of the file" in lines[0]
    document = _assert_good_reported(result)
    assert document["exit_code"] == 4
    assert document["errors"][0]["internal"] is True


def test_an_engine_failure_on_one_input_is_exit_4_and_the_report_is_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torch_path(monkeypatch)
    good, bad = good_safetensors(tmp_path), good_checkpoint(tmp_path)
    real = PendingStats.queue_with_hint

    def queue(self: PendingStats, name: str, tensor: Any, source: Any, hint: Any) -> None:
        if source == str(bad):
            raise RuntimeError("engine exploded")
        real(self, name, tensor, source, hint)

    monkeypatch.setattr(PendingStats, "queue_with_hint", queue)

    result = scan(str(good), str(bad))  # the table: the verdict line says what happened

    assert result.exit_code == ExitCode.INTERNAL_ERROR, result.stderr
    assert result.stderr.startswith(f"gradaudit: internal error: {bad}: RuntimeError: ")
    assert "good.weight" in result.stdout
    assert "INCOMPLETE: 1 input could not be audited (1 by an internal error" in result.stdout

    report = scan_paths([good, bad], device="cpu")
    assert exit_code(report) is ExitCode.INTERNAL_ERROR
    (problem,) = report.errors
    assert problem.internal
    assert "engine exploded" in problem.traceback
    assert [t.name for t in report.tensors] == ["good.weight"]


def test_debug_shows_the_traceback_of_an_unexpected_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torch_path(monkeypatch)
    good, bad = good_safetensors(tmp_path), good_checkpoint(tmp_path)
    monkeypatch.setattr(torch_pickle.TorchPickleSource, "items", _raising(TypeError("boom")))

    result = scan(str(good), str(bad), "--debug")

    assert result.exit_code == ExitCode.INPUT_ERROR
    assert "Traceback" in result.stderr
    assert "TypeError: boom" in result.stderr


def test_a_usage_error_raised_while_reading_still_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torch_path(monkeypatch)
    """Not every exception is an input's: an unusable device is the run's (exit 2)."""
    from gradaudit.errors import UsageError

    good, bad = good_safetensors(tmp_path), good_checkpoint(tmp_path)
    monkeypatch.setattr(torch_pickle.TorchPickleSource, "items", _raising(UsageError("no GPU")))

    result = scan(str(good), str(bad))

    assert result.exit_code == ExitCode.USAGE_ERROR
