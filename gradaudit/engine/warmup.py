"""The Triton kernels compiled in a background process, off the training step's path.

A cold compile of the kernels takes seconds. Done inside the first
``GradientMonitor.step()`` (or ``audit()``) that launches them, it stalls that step;
so under ``auto`` the first CUDA use of the kernels on a GPU architecture whose
compiled kernels are not on disk starts a child process (:mod:`._warmup_child`)
that compiles and runs them on a few tiny tensors of that GPU. It fills Triton's
on-disk cache and leaves the marker :func:`~.triton_kernel.compile_worth` looks for;
the parent never waits for it. Until it has finished, the eager kernel reduces the
tensors; the first flush after it launches the kernels, which Triton then loads from
its cache instead of compiling.

A child that fails (no C compiler for Triton's launcher, a GPU in exclusive-process
mode that refuses a second context, a killed process) is reported once per process
and architecture (:class:`~gradaudit.errors.KernelCompileWarning`) and changes nothing
else: ``auto`` keeps the rule it had before, eager until ``COMPILE_AFTER_BYTES``,
then a compile in the process.

This module is the parent's side; it imports neither torch nor Triton.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gradaudit.errors import KernelCompileWarning

#: The environment variable that turns the background compile off (``0``): the child
#: holds a CUDA context, a few hundred MiB of the GPU's memory for its few seconds, which a
#: job that fills its GPUs to the last MiB cannot spare.
ENVIRONMENT = "GRADAUDIT_BACKGROUND_COMPILE"


def enabled_by_environment(environ: dict[str, str] | None = None) -> bool:
    """Whether :data:`ENVIRONMENT` leaves the background compile on (unset, or not ``0``)."""
    value = (os.environ if environ is None else environ).get(ENVIRONMENT, "1")
    return value.strip() != "0"


#: Whether ``auto`` compiles in a background process (``False``: the rule before it,
#: eager until ``COMPILE_AFTER_BYTES`` went through it, then a compile in the step).
ENABLED = enabled_by_environment()


class State(enum.Enum):
    """Where the background compile of one GPU architecture stands."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


def command(device_index: int) -> list[str]:
    """The child's command line: this Python, the child module, the CUDA device index.

    The boundary the tests fake: everything else here runs as it does on a GPU.
    """
    return [sys.executable, "-m", "gradaudit.engine._warmup_child", str(device_index)]


@dataclass
class _Run:
    process: subprocess.Popen[bytes]
    stderr: IO[bytes]


_runs: dict[str, _Run] = {}
_states: dict[str, State] = {}
_causes: dict[str, str] = {}


def poll(arch: str, device_index: int) -> State:
    """The background compile for ``arch``: started on the first call, then looked at
    (a non-blocking ``waitpid``); never waited for."""
    state = _states.get(arch)
    if state is not None and state is not State.RUNNING:
        return state
    run = _runs.get(arch)
    if run is None:
        # Closed when the child is collected: it outlives this call.
        stderr = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            process = subprocess.Popen(
                command(device_index),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=_environment(),
            )
        except OSError as error:
            stderr.close()
            return _failed(arch, f"could not start: {error}")
        _runs[arch] = _Run(process, stderr)
        _states[arch] = State.RUNNING
        return State.RUNNING
    code = run.process.poll()
    if code is None:
        return State.RUNNING
    del _runs[arch]
    if code == 0:
        run.stderr.close()
        _states[arch] = State.DONE
        return State.DONE
    run.stderr.seek(0)
    lines = run.stderr.read().decode("utf-8", "replace").strip().splitlines()
    run.stderr.close()
    return _failed(arch, lines[-1] if lines else f"exit status {code}")


def _environment() -> dict[str, str]:
    """The parent's environment (``TRITON_CACHE_DIR``, ``CUDA_VISIBLE_DEVICES`` …), with the
    folder this gradaudit was imported from first on ``PYTHONPATH``: a parent that found
    it through ``sys.path`` alone (a notebook, a checkout) must not start a child that
    cannot import it, or imports another copy."""
    environment = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    paths = [root, *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


def _failed(arch: str, cause: str) -> State:
    _states[arch] = State.FAILED
    _causes[arch] = cause
    warnings.warn(
        f"gradaudit: compiling the Triton kernels for {arch} in the background failed "
        f"({cause}); the eager kernel goes on, and the kernels are compiled in the "
        "process once 1 GiB went through it",
        KernelCompileWarning,
        stacklevel=2,
    )
    return State.FAILED


def cause(arch: str) -> str | None:
    """Why the background compile for ``arch`` failed, or ``None``."""
    return _causes.get(arch)


def wait(arch: str, timeout: float | None = None) -> State | None:
    """Wait for ``arch``'s background compile, at most ``timeout`` seconds (tests, and a
    script that would rather wait once than run its first steps on the eager kernel);
    its state, or ``None`` if none was started."""
    run = _runs.get(arch)
    if run is not None:
        try:
            run.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return State.RUNNING
        return poll(arch, 0)  # finished: collected, never started again
    return _states.get(arch)


def reset() -> None:
    """Forget every background compile (tests); a running child is left to finish."""
    _runs.clear()
    _states.clear()
    _causes.clear()
