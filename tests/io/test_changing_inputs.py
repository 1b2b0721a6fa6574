"""Inputs that change while they are read: truncated under a memory map, replaced, rewritten.

The changes are made at fixed points by wrapping the readers (after the first tensor is
handed out, or between the header and the data), so every run takes the same path.
A truncation under a map raises SIGBUS in whichever thread touches the page; the scans
that can meet one run in a subprocess, so a regression kills that process, not the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import scan_paths
from gradaudit.engine import native_rows
from gradaudit.errors import ExitCode
from gradaudit.io import mapguard

needs_guard = pytest.mark.skipif(
    not mapguard.available(), reason="the SIGBUS guard (gradaudit.io._mapguard) is not built"
)

#: Wraps the readers so that each truncates a ``victim*`` file to one page once the first
#: tensor has been handed out; every later read of the map is past the end.
TRUNCATING = textwrap.dedent(
    """
    import os, sys
    from gradaudit.io import safetensors_source, torch_pickle

    def truncating(cls, method):
        real = getattr(cls, method)
        def wrapped(self, *args):
            for index, item in enumerate(real(self, *args)):
                yield item
                if index == 0 and os.path.basename(self.path).startswith("victim"):
                    os.truncate(self.path, 4096)
        setattr(cls, method, wrapped)

    truncating(safetensors_source.SafetensorsSource, "items")
    truncating(safetensors_source.SafetensorsSource, "runs")
    truncating(torch_pickle.TorchPickleSource, "items")

    # The torch-free scan queues a whole file's addresses, then reduces them: truncated
    # in between, as the wrappers above truncate before the data is reduced.
    from gradaudit.scan import torch_free
    real_read = torch_free.NativeScan._read
    def read_then_truncate(self, source, *args):
        real_read(self, source, *args)
        if os.path.basename(source.path).startswith("victim"):
            os.truncate(source.path, 4096)
            print("torch-free", file=open(os.environ["MARK"], "a"))
    torch_free.NativeScan._read = read_then_truncate
    real_item = torch_free.NativeScan._checkpoint_item
    def item_then_truncate(self, source, *args):
        real_item(self, source, *args)
        victim = os.path.basename(source.path).startswith("victim")
        if victim and os.path.getsize(source.path) > 4096:
            os.truncate(source.path, 4096)
            print("torch-free", file=open(os.environ["MARK"], "a"))
    torch_free.NativeScan._checkpoint_item = item_then_truncate
    if os.environ.get("FORCE_TORCH"):
        torch_free.applies = lambda **_: False
    """
)
#: Runs the CLI with :data:`TRUNCATING`'s readers.
TRUNCATING_RUN = TRUNCATING + textwrap.dedent(
    """
    from gradaudit.cli import run
    sys.argv = ["gradaudit", *sys.argv[1:]]
    run()
    """
)


def many_tensors(count: int = 16, elements: int = 70_000) -> dict[str, torch.Tensor]:
    """Tensors too large to travel in runs: each is read after the truncation."""
    gen = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(elements, generator=gen) for i in range(count)}


def scan_truncating(
    tmp_path: Path, victim: Path, *extra: str, force_torch: bool = False
) -> subprocess.CompletedProcess[str]:
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(8)}, str(good))
    options = ["--format", "json", "--device", "cpu", *extra]
    env = {**os.environ, "COLUMNS": "200", "MARK": str(tmp_path / "mark")}
    if force_torch:
        env["FORCE_TORCH"] = "1"
    return subprocess.run(
        [sys.executable, "-c", TRUNCATING_RUN, "scan", str(victim), str(good), *options],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def assert_reported_as_changed(result: subprocess.CompletedProcess[str], victim: Path) -> None:
    assert result.returncode == ExitCode.INPUT_ERROR, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert str(victim) in lines[0]
    assert "changed size while being read" in lines[0]
    report = json.loads(result.stdout)
    assert [t["name"] for t in report["tensors"]] == ["w"]  # the other input is reported
    assert [e["file"] for e in report["errors"]] == [str(victim)]


@needs_guard
@pytest.mark.parametrize(
    ("engine", "force_torch"), [("auto", False), ("auto", True), ("eager", False)]
)
def test_safetensors_truncated_while_mapped_is_an_input_error(
    tmp_path: Path, engine: str, force_torch: bool
) -> None:
    """With and without torch (``auto`` on the CPU with the native kernel: the torch-free scan)."""
    victim = tmp_path / "victim.safetensors"
    save_file(many_tensors(), str(victim))
    result = scan_truncating(tmp_path, victim, "--engine", engine, force_torch=force_torch)
    assert_reported_as_changed(result, victim)
    assert victim.stat().st_size == 4096
    torch_free = engine == "auto" and not force_torch and native_rows.available()
    assert (tmp_path / "mark").exists() == torch_free


@pytest.mark.slow
@needs_guard
@pytest.mark.parametrize("force_torch", [False, True])
def test_torch_zip_truncated_while_mapped_is_an_input_error(
    tmp_path: Path, force_torch: bool
) -> None:
    """With and without torch (a plain state dict takes the torch-free scan on the CPU)."""
    victim = tmp_path / "victim.pt"
    torch.save(many_tensors(), victim)
    result = scan_truncating(tmp_path, victim, force_torch=force_torch)
    assert_reported_as_changed(result, victim)
    torch_free = not force_torch and native_rows.available()
    assert (tmp_path / "mark").exists() == torch_free


def test_a_fault_outside_gradaudits_maps_still_kills_the_process(tmp_path: Path) -> None:
    """The handler forwards faults it does not own: a crash elsewhere is still a crash."""
    path = tmp_path / "other.bin"
    path.write_bytes(b"\1" * 8192)
    script = textwrap.dedent(
        f"""
        import mmap, os, torch
        from gradaudit.io.mapguard import MapGuard
        import gradaudit.io.safetensors_source  # noqa: F401
        own = mmap.mmap(-1, 4096)
        MapGuard(torch.frombuffer(own, dtype=torch.uint8).data_ptr(), 4096, owner=own)
        with open({str(path)!r}, "rb") as handle:
            other = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        os.truncate({str(path)!r}, 0)
        print(torch.frombuffer(other, dtype=torch.uint8).sum())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert result.returncode == -7  # SIGBUS, as without gradaudit


#: A long-lived host: scans once (gradaudit's SIGBUS guard goes in), installs its own SIGBUS
#: handler the way argv[1] says, then scans a file truncated under the map.
HOST_REPLACING_THE_HANDLER = TRUNCATING + textwrap.dedent(
    """
    import faulthandler, json, signal
    from gradaudit import scan_paths
    victim, good, how = sys.argv[1:]
    assert not scan_paths([good], device="cpu").errors
    if how == "python":
        signal.signal(signal.SIGBUS, lambda signum, frame: None)  # returns: the fault repeats
    elif how == "faulthandler":
        faulthandler.enable()
    else:
        signal.signal(signal.SIGBUS, signal.SIG_DFL)
    report = scan_paths([victim, good], device="cpu")
    errors = [[e.path, e.message] for e in report.errors]
    print(json.dumps({"errors": errors, "tensors": [t.name for t in report.tensors]}))
    """
)


@needs_guard
@pytest.mark.slow
@pytest.mark.parametrize("how", ["python", "faulthandler", "default"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_the_guard_reasserts_itself_when_the_host_replaces_the_handler(
    tmp_path: Path, how: str, suffix: str
) -> None:
    """Issue 29 item 9: the host's handler, installed after the first scan, was the one
    the truncation met: a Python handler hung, faulthandler and SIG_DFL killed the host."""
    victim = tmp_path / f"victim{suffix}"
    if suffix == ".pt":
        torch.save(many_tensors(), victim)
    else:
        save_file(many_tensors(), str(victim))
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(8)}, str(good))
    env = {**os.environ, "MARK": str(tmp_path / "mark")}
    command = [sys.executable, "-c", HOST_REPLACING_THE_HANDLER, str(victim), str(good), how]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    report = json.loads(result.stdout)
    ((path, message),) = report["errors"]
    assert path == str(victim)
    assert "changed size while being read" in message
    assert report["tensors"] == ["w"]
    assert victim.stat().st_size == 4096


@needs_guard
@pytest.mark.slow
@pytest.mark.parametrize("how", ["python", "faulthandler", "default"])
def test_a_fault_outside_the_maps_under_a_host_handler_is_a_crash_not_a_hang(
    tmp_path: Path, how: str
) -> None:
    """The re-installed guard chains to the host's handler; faulthandler chains back to the
    guard and a Python handler repairs nothing, so a chain could loop: it ends in SIGBUS."""
    path = tmp_path / "other.bin"
    path.write_bytes(b"\1" * 8192)
    script = textwrap.dedent(
        f"""
        import faulthandler, mmap, os, signal, torch
        from gradaudit.io.mapguard import MapGuard
        def guard():
            own = mmap.mmap(-1, 4096)
            MapGuard(torch.frombuffer(own, dtype=torch.uint8).data_ptr(), 4096, owner=own)
            return own
        first = guard()
        if {how!r} == "python":
            signal.signal(signal.SIGBUS, lambda signum, frame: None)
        elif {how!r} == "faulthandler":
            faulthandler.enable()
        else:
            signal.signal(signal.SIGBUS, signal.SIG_DFL)
        second = guard()  # the guard goes back in, chaining to the host's handler
        with open({str(path)!r}, "rb") as handle:
            other = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        os.truncate({str(path)!r}, 0)
        print(other[5000])
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert result.returncode == -7  # SIGBUS, as without gradaudit
    assert (b"Fatal Python error: Bus error" in result.stderr) == (how == "faulthandler")


def two_files(tmp_path: Path) -> tuple[Path, Path]:
    """A clean file and an all-NaN one of exactly the same size and layout."""
    clean, poisoned = tmp_path / "clean.safetensors", tmp_path / "nan.safetensors"
    save_file({"a": torch.ones(1024), "b": torch.ones(1024)}, str(clean))
    save_file({"a": torch.full((1024,), float("nan")), "b": torch.ones(1024)}, str(poisoned))
    assert clean.stat().st_size == poisoned.stat().st_size
    return clean, poisoned


def test_file_replaced_between_header_and_data_is_refused_not_misread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradaudit.io.safetensors_map import MappedSafetensors

    clean, poisoned = two_files(tmp_path)
    real_map = MappedSafetensors.map

    def replace_then_map(self: MappedSafetensors) -> object:
        os.replace(poisoned, clean)  # same size: only the inode tells
        return real_map(self)

    monkeypatch.setattr(MappedSafetensors, "map", replace_then_map)
    report = scan_paths([clean], device="cpu")
    assert report.tensors == ()
    assert report.findings == ()
    ((problem),) = report.errors
    assert problem.path == str(clean)
    assert "changed while being read" in problem.message


def test_data_is_read_from_the_file_whose_header_was_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The map is made from the descriptor the header came from, not by reopening the path."""
    from gradaudit.io.safetensors_map import MappedSafetensors
    from gradaudit.io.safetensors_source import SafetensorsSource

    clean, poisoned = two_files(tmp_path)
    real_map = MappedSafetensors.map

    def replace_then_map(self: MappedSafetensors) -> object:
        os.replace(poisoned, clean)
        return real_map(self)

    monkeypatch.setattr(MappedSafetensors, "map", replace_then_map)
    source = SafetensorsSource(str(clean))
    values = {name: tensor.clone() for name, tensor in source.items()}
    assert not values["a"].isnan().any()  # the validated (clean) file's bytes


def test_file_rewritten_in_place_while_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradaudit.io.safetensors_source import SafetensorsSource

    clean, _ = two_files(tmp_path)
    real_runs = SafetensorsSource.runs

    def rewriting(self: SafetensorsSource) -> object:
        yield from real_runs(self)
        with open(self.path, "r+b") as handle:  # same size, new modification time
            handle.seek(-4, os.SEEK_END)
            handle.write(b"\0\0\xc0\x7f")
        stat = os.stat(self.path)
        os.utime(self.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))

    monkeypatch.setattr(SafetensorsSource, "runs", rewriting)
    report = scan_paths([clean], device="cpu")
    assert report.tensors == ()
    ((problem),) = report.errors
    assert "changed while being read" in problem.message
