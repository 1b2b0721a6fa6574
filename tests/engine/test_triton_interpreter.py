"""The interpreter shortcut of ``tests/triton_interpreter.py`` is on where it was checked.

That it is harmless is what every interpreter test shows: each compares the kernels, run
with the shortcut, against the float64 reference.
"""

from __future__ import annotations

import sys

import pytest

from gradaudit.engine import triton_kernel
from tests.triton_interpreter import (
    CHECKED_TRITON,
    coverage_paused,
    skip_repatching_in_device_calls,
    triton_release,
)


@pytest.mark.skipif(not triton_kernel.installed(), reason="Triton is not installed")
def test_the_installed_triton_is_one_the_shortcut_was_checked_against() -> None:
    """A Triton upgrade fails here, so that the shortcut's reading of the interpreter's
    private structure is redone (meanwhile the interpreter tests take Triton's own path)."""
    import triton.runtime.interpreter  # noqa: F401  (what the shortcut patches)

    release = triton_release()
    assert release is not None
    if release < min(CHECKED_TRITON):
        # The torch-floor leg: torch 2.4 pins Triton 3.0, and runs no interpreter test.
        pytest.skip(f"Triton {release} is older than the releases the shortcut was read against")
    assert release in CHECKED_TRITON
    assert skip_repatching_in_device_calls()
    assert "triton.runtime.interpreter" in sys.modules


def test_coverage_is_paused_during_a_launch_and_no_other_tracer() -> None:
    """``coverage_paused``: coverage's tracer is off inside and back after; any other tracer
    (a debugger's) stays on."""
    original = sys.gettrace()
    coverage_like = type(
        "CTracer", (), {"__module__": "coverage.tracer", "__call__": lambda self, *args: None}
    )
    tracer = coverage_like()

    def debugger(*args: object) -> None:
        return None

    try:
        sys.settrace(tracer)
        with coverage_paused():
            assert sys.gettrace() is None
        assert sys.gettrace() is tracer
        sys.settrace(debugger)
        with coverage_paused():
            assert sys.gettrace() is debugger
        assert sys.gettrace() is debugger
    finally:
        sys.settrace(original)
