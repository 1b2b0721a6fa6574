"""A report or message that cannot be written ends the run with ExitCode.OUTPUT_ERROR (5).

Each case runs the real console entry point in a shell that really closes or
fills the streams (``>&-``, ``> /dev/full``, ``2>&-``, ``2>/dev/full``): never
exit 1 (CI would read findings), never 4 (a bug), never a traceback. A stream
nothing needed to be written to changes nothing, and a reader that stops early
keeps the verdict (tested in test_cli_gate.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import ExitCode
from gradaudit.cli import streams
from tests.conftest import runner

REPO = Path(__file__).resolve().parents[2]

needs_dev_full = pytest.mark.skipif(
    not os.path.exists("/dev/full"), reason="this system has no /dev/full"
)


#: (name, command after ``gradaudit``, expected exit code, text expected on stderr).
#: {healthy}: a clean dump (exit 0 when the report gets out); {broken}: a NaN (exit 1);
#: {missing}: no such file (exit 3); {report}: a report file in the temporary directory.
CASES: list[tuple[str, str, int, str]] = [
    # stdout closed: was exit 4, "internal error: AttributeError".
    ("closed stdout", "scan {healthy} >&-", 5, "cannot write to stdout: it is closed\n"),
    ("closed stdout, findings", "scan {broken} >&-", 5, "cannot write to stdout: it is closed"),
    # stdout full: was exit 4 from an OSError.
    ("full stdout", "scan {broken} > /dev/full", 5, "No space left on device"),
    ("full stdout, compare", "compare {healthy} {healthy} > /dev/full", 5, "No space left"),
    ("full stdout, trend", "trend {healthy} > /dev/full", 5, "No space left on device"),
    ("full stdout, help", "--help > /dev/full", 5, "No space left on device"),
    # stderr full or closed with an error to report: was exit 1, read as findings.
    ("full stderr, input error", "scan {missing} 2>/dev/full", 5, ""),
    ("closed stderr, input error", "scan {missing} 2>&-", 5, ""),
    ("full stderr, usage error", "scan --no-such-option 2>/dev/full", 5, ""),
    ("full stderr, note on --output", "scan {healthy} -o {report} 2>/dev/full", 5, ""),
    # Nothing needed the broken stream: the verdict stands.
    ("closed stderr, nothing to say", "scan {healthy} 2>&-", 0, ""),
    ("full stderr, nothing to say", "scan {broken} 2>/dev/full", 1, ""),
    ("closed stdout, report to a file", "scan {broken} -q -o {report} >&-", 1, ""),
    # Both gone.
    ("both closed", "scan {broken} >&- 2>&-", 5, ""),
    ("both full", "scan {healthy} > /dev/full 2>/dev/full", 5, ""),
]


def _run(command: str, errors: Path, cwd: Path) -> tuple[int, str, str]:
    """``gradaudit COMMAND`` under bash; stderr into ``errors`` unless COMMAND redirects it."""
    line = f"exec 3>{errors}; {sys.executable} -m gradaudit {command}"
    if "2>" not in command:
        line += " 2>&3"
    result = subprocess.run(
        ["bash", "-c", line],
        stdout=subprocess.PIPE,
        timeout=120,
        cwd=cwd,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "COLUMNS": "80",
            "PYTHONPATH": str(REPO),
        },
        check=False,
    )
    return result.returncode, result.stdout.decode(), errors.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Every case, run two at a time (each pays for importing torch)."""
    folder = tmp_path_factory.mktemp("streams")
    save_file({"w": torch.ones(4)}, str(folder / "healthy.safetensors"))
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(folder / "broken.safetensors"))
    # The current directory: a pyproject.toml without [tool.gradaudit] is passed over.
    (folder / "pyproject.toml").write_text("", encoding="utf-8")
    names = {
        "healthy": folder / "healthy.safetensors",
        "broken": folder / "broken.safetensors",
        "missing": folder / "missing.safetensors",
    }
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for index, (name, command, _, _) in enumerate(CASES):
            text = command.format(**names, report=folder / f"report{index}.txt")
            jobs[name] = pool.submit(_run, text, folder / f"stderr{index}.txt", folder)
    return {name: job.result() for name, job in jobs.items()}


@needs_dev_full
@pytest.mark.parametrize(("name", "command", "code", "message"), CASES, ids=[c[0] for c in CASES])
def test_output_failures_exit_5_never_1_or_4(
    outcomes: dict[str, tuple[int, str, str]], name: str, command: str, code: int, message: str
) -> None:
    returncode, stdout, stderr = outcomes[name]
    assert returncode == code, (command, stderr)
    assert "Traceback" not in stderr
    assert message in stderr
    if code == ExitCode.OUTPUT_ERROR and "2>" not in command:
        assert stderr.splitlines()[-1].startswith("gradaudit: error: cannot write to stdout")
    if name == "closed stderr, nothing to say":
        assert "OK: no failing findings" in stdout


def test_closed_descriptors_are_not_reused_for_files() -> None:
    """With fd 1 closed, the first file opened would become "stdout" without the guard."""
    code = (
        "import os, sys\n"
        "from gradaudit.cli import streams\n"
        "streams.guard()\n"
        "fd = os.open(os.devnull, os.O_RDONLY)\n"
        "print(fd > 2, sys.stdout.isatty(), file=sys.stderr)\n"
        "sys.stdout.write('lost')\n"
        "print(streams.failures(), file=sys.stderr)\n"
    )
    result = subprocess.run(
        ["bash", "-c", f'{sys.executable} -c "$CODE" >&-'],
        capture_output=True,
        env={**os.environ, "CODE": code},
        timeout=60,
        check=False,
    )
    assert result.stderr.decode().splitlines() == [
        "True False",
        "{'stdout': 'it is closed'}",
    ]


class _Failing:
    """A text stream whose writes fail with ``error``."""

    encoding = "utf-8"
    errors = "strict"

    def __init__(self, error: OSError) -> None:
        self.error = error
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise self.error

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        raise OSError("no descriptor")


def test_guarded_stream_notes_failures_and_keeps_quiet_after() -> None:
    streams._failures.clear()
    full = _Failing(OSError(28, "No space left on device"))
    guarded = streams.GuardedStream("stdout", full)  # type: ignore[arg-type]
    assert guarded.write("report") == 6
    assert guarded.write("more") == 4  # silenced: not written, not noted twice
    assert full.writes == 1
    assert streams.failures() == {"stdout": "No space left on device"}
    streams._failures.clear()
    piped = streams.GuardedStream("stdout", _Failing(BrokenPipeError(32, "Broken pipe")))  # type: ignore[arg-type]
    piped.write("x")
    assert streams.failures() == {}  # a reader that went away is not a failure


def test_a_plot_that_fails_to_write_is_an_output_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")

    from gradaudit.cli import app

    dump = tmp_path / "grads.safetensors"
    save_file({"w": torch.ones(4)}, str(dump))
    image = tmp_path / "flow.png"
    image.write_bytes(b"the previous image")

    def full(fd: int) -> None:  # the disk fills up while the new image is written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gradaudit.cli.output.os.fsync", full)
    result = runner.invoke(app, ["scan", str(dump), "--no-config", "--plot", str(image)])
    assert result.exit_code == ExitCode.OUTPUT_ERROR
    assert f"--plot {image}: cannot write: No space left on device" in result.stderr
    # Written atomically, like --output: the old image stays whole, no temporary is left.
    assert image.read_bytes() == b"the previous image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flow.png", "grads.safetensors"]


def test_rendering_stops_once_the_reader_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``gradaudit scan huge.safetensors -f json | head``: once the pipe is closed, the rest
    # of the report is not rendered into nowhere, and the exit code stays the verdict.
    from gradaudit.cli.output import write_stdout

    streams._failures.clear()
    piped = streams.GuardedStream("stdout", _Failing(BrokenPipeError(32, "Broken pipe")))  # type: ignore[arg-type]
    monkeypatch.setattr("sys.stdout", piped)
    rendered = []

    def chunks() -> Iterator[str]:
        for index in range(1000):
            rendered.append(index)
            yield f"chunk {index}\n"

    write_stdout(chunks())
    assert rendered == [0]
    assert piped.silenced
    assert streams.failures() == {}
