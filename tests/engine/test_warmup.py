"""The background compile (``gradaudit/engine/warmup.py``), on the CPU.

Faked at one boundary only, the child's command line (``warmup.command``): the child is
a real process that waits until the test lets it finish, then leaves the marker (as the
real child does after compiling) or fails with a message. Everything else runs as on a
GPU: the ``Popen``, the non-blocking polls, the marker, ``compile_worth``'s decision and
the collector's routing (a pretend sm_90, ``meta`` tensors standing for its tensors).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gradaudit
from gradaudit.engine import triton_kernel, warmup
from gradaudit.engine.stats import StatsCollector
from gradaudit.errors import KernelCompileWarning
from tests.engine.test_gpu_logic import triton_on_meta  # noqa: F401 (a fixture)

GPU = torch.device("cuda", 0)
ARCH = "sm_90"
REAL_COMMAND = warmup.command

#: The fake child: waits (at most a minute) for the test's word in ``go``, then leaves the
#: marker and exits 0 ("ok"), or prints a cause and exits 1.
CHILD = """
import os, sys, time
go, marker = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.005)
word = open(go).read() if os.path.exists(go) else "timeout"
if word == "ok":
    open(marker, "a").close()
    sys.exit(0)
print("Traceback (most recent call last): ...", file=sys.stderr)
print("RuntimeError: Failed to find C compiler", file=sys.stderr)
sys.exit(1)
"""


class Child:
    """The fake child's controls: the word it waits for, and how many were started."""

    def __init__(self, tmp_path: Path) -> None:
        self.go = tmp_path / "go"
        self.started: list[int] = []

    def command(self, device_index: int) -> list[str]:
        self.started.append(device_index)
        return [sys.executable, "-c", CHILD, str(self.go), triton_kernel._marker(ARCH)]

    def finish(self, word: str) -> warmup.State | None:
        self.go.write_text(word)
        return warmup.wait(ARCH, timeout=60)


@pytest.fixture
def child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Child]:
    """A cold pretend sm_90 (a temporary Triton cache), the fake child's command."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(triton_kernel, "_arch", lambda device: ARCH)
    monkeypatch.setattr(triton_kernel, "_warm", set())
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", 0)
    monkeypatch.setattr(warmup, "ENABLED", True)
    fake = Child(tmp_path)
    monkeypatch.setattr(warmup, "command", fake.command)
    (tmp_path / "cache").mkdir()
    triton_kernel._marker.cache_clear()
    warmup.reset()
    yield fake
    if not fake.go.exists():
        fake.finish("fail")  # never leave a child waiting
    warmup.reset()
    triton_kernel._marker.cache_clear()


def test_the_step_never_waits_for_the_compile(child: Child) -> None:
    assert not triton_kernel.compile_worth(GPU)  # starts the child, returns at once
    run = warmup._runs[ARCH]
    assert run.process.poll() is None  # still waiting for the test's word: nobody waited
    # However much goes through the eager kernel meanwhile, no compile in the process.
    triton_kernel.defer(triton_kernel.COMPILE_AFTER_BYTES)
    assert not triton_kernel.compile_worth(GPU)
    assert child.started == [0]  # one child, not one per call
    assert child.finish("ok") is warmup.State.DONE
    assert triton_kernel.compile_worth(GPU)
    assert Path(triton_kernel._marker(ARCH)).exists()  # what the next process finds
    triton_kernel._warm.clear()  # a new process: warm from the marker, no child
    assert triton_kernel.compile_worth(GPU)
    assert child.started == [0]


def test_a_failed_compile_is_reported_once_and_changes_nothing_else(child: Child) -> None:
    assert not triton_kernel.compile_worth(GPU)
    with pytest.warns(KernelCompileWarning, match="Failed to find C compiler"):
        assert child.finish("fail") is warmup.State.FAILED
    assert warmup.cause(ARCH) == "RuntimeError: Failed to find C compiler"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once: no second warning
        assert not triton_kernel.compile_worth(GPU)  # the rule before: eager first ...
        triton_kernel.defer(triton_kernel.COMPILE_AFTER_BYTES)
        assert triton_kernel.compile_worth(GPU)  # ... then a compile in the process
    assert child.started == [0]  # never started again


def test_a_child_that_cannot_start_is_reported_once(
    child: Child, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(warmup, "command", lambda index: [str(tmp_path / "no-such-python")])
    with pytest.warns(KernelCompileWarning, match="could not start"):
        assert not triton_kernel.compile_worth(GPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not triton_kernel.compile_worth(GPU)
    child.go.write_text("fail")


def test_the_collector_uses_eager_until_the_compile_is_done(
    child: Child,
    triton_on_meta: list[int],  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``meta`` tensors stand for the pretend GPU's: the real decision routes them."""
    real = triton_kernel.compile_worth
    monkeypatch.setattr(triton_kernel, "compile_worth", lambda device: real(GPU))
    tensors = [torch.empty(100_000, device="meta") for _ in range(3)]

    def collect() -> str:
        collector = StatsCollector(engine="auto")
        for tensor in tensors:
            collector.submit(tensor)
        collector.flush()
        return collector.engine_used

    assert collect() == "eager"  # the child is compiling: nothing launched, nobody waited
    assert triton_on_meta == []
    assert child.finish("ok") is warmup.State.DONE
    assert collect() == "triton"
    programs = -(-100_000 // triton_kernel.span_for(300_000))
    assert triton_on_meta == [3 * programs, 4]


def test_the_child_imports_the_parents_gradaudit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found through ``sys.path`` alone (a notebook, a checkout), the parent's copy must be
    the child's: its folder comes first on the child's ``PYTHONPATH``, the rest kept."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", ""]))
    paths = warmup._environment()["PYTHONPATH"].split(os.pathsep)
    assert paths == [str(Path(gradaudit.__file__).resolve().parents[1]), "/elsewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert warmup._environment()["PYTHONPATH"] == paths[0]


@pytest.mark.slow
def test_the_real_child_fails_harmlessly_without_a_gpu(
    child: Child, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child module itself, on a machine without CUDA (or under the interpreter): a
    non-zero exit status and a cause, which the parent reports once (about 3 s: the child
    imports torch)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the child would compile")
    monkeypatch.setattr(warmup, "command", REAL_COMMAND)
    assert not triton_kernel.compile_worth(GPU)
    with pytest.warns(KernelCompileWarning, match="in the background failed"):
        assert warmup.wait(ARCH, timeout=120) is warmup.State.FAILED
    cause = warmup.cause(ARCH)
    assert cause
    assert "No module named" not in cause  # it imported gradaudit: it failed for the GPU
    assert not Path(triton_kernel._marker(ARCH)).exists()
    child.go.write_text("fail")


@pytest.mark.parametrize(
    ("value", "enabled"), [(None, True), ("1", True), ("yes", True), ("0", False), (" 0 ", False)]
)
def test_the_environment_turns_the_background_compile_off(value: str | None, enabled: bool) -> None:
    environ = {} if value is None else {warmup.ENVIRONMENT: value}
    assert warmup.enabled_by_environment(environ) is enabled
