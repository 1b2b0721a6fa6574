"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import skip_repatching_in_device_calls


@pytest.fixture(autouse=True)
def _interpreter_without_repatching() -> None:
    """Triton's interpreter, where a test runs it, without the language re-patched at every
    device-function call (``tests/triton_interpreter.py``: half the interpreter's time)."""
    skip_repatching_in_device_calls()
