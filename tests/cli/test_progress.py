"""When the progress bar shows: never for JSON or pipes by default, flags win."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradaudit.cli import progress
from gradaudit.cli.progress import AUTO_PROGRESS_BYTES, input_bytes, progress_bar, wants_progress


def test_flags_win_over_the_default() -> None:
    assert wants_progress(True, machine_output=True, total=0) is True
    assert wants_progress(False, machine_output=False, total=10 * AUTO_PROGRESS_BYTES) is False


def test_default_needs_a_terminal_large_input_and_human_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True)
    assert wants_progress(None, machine_output=False, total=AUTO_PROGRESS_BYTES)
    assert not wants_progress(None, machine_output=False, total=AUTO_PROGRESS_BYTES - 1)
    assert not wants_progress(None, machine_output=True, total=AUTO_PROGRESS_BYTES)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False)
    assert not wants_progress(None, machine_output=False, total=AUTO_PROGRESS_BYTES)


def test_input_bytes_counts_regular_files_only(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"x" * 5)
    assert input_bytes([tmp_path / "a", tmp_path / "b", tmp_path / "missing"]) == 15


def test_disabled_bar_yields_no_callback() -> None:
    with progress_bar(100, enabled=False) as advance:
        assert advance is None
    with progress_bar(100, enabled=True) as advance:
        assert advance is not None
        advance(50)
