"""Triton's interpreter without its repeated language patching inside a kernel.

The tests run the Triton kernels through Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``). A launch patches ``triton.language`` once for the kernel
(``GridExecutor.__call__``), but every call of a ``@triton.jit`` device function inside
the kernel patches it again (``InterpretedFunction.__call__`` → ``_patch_lang``), which
walks the language modules with ``inspect.getmembers``: ~1 ms a call. The row kernels
call ~65 device functions per program, so in Triton 3.8 this re-patching was half the
time of the interpreter tests (``test_triton_plan.py``'s slowest test: 12.8 of 24 s,
cProfile), and more under coverage's tracer.

A second patch of the same globals changes nothing: the language modules it would patch
were patched by the launch or by the first call (Triton never restores a device call's
patches), their builtins are replaced already (only builtins are patched), and the rest is
set again to functions of the same behaviour. So
within a launch, a device function whose ``__globals__`` were patched already (the
kernel's module, or ``triton.language.standard`` after its first ``tl.zeros``) is called
directly; the first call from any other globals takes Triton's own path. The results are
unchanged — every interpreter test still compares the kernels against the float64
reference — only the repeated work is skipped.

It relies on the interpreter's private structure, so it is applied only to the Triton
releases it was checked against (:data:`CHECKED_TRITON`); any other release keeps Triton's
own, slower path, and ``tests/engine/test_triton_interpreter.py`` fails so that the check
is redone.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

#: The Triton releases whose interpreter this shortcut was read against.
CHECKED_TRITON = {(3, 8)}


def triton_release() -> tuple[int, int] | None:
    """The installed Triton's (major, minor), or ``None`` where it is not imported."""
    triton = sys.modules.get("triton")
    if triton is None:
        return None
    major, minor = str(getattr(triton, "__version__", "0.0")).split(".")[:2]
    return int(major), int(minor)


@contextlib.contextmanager
def coverage_paused() -> Iterator[None]:
    """Coverage's tracer off on this thread while the interpreter runs a kernel (``--cov``).

    The interpreter is pure Python that runs the kernel's body once per program: under
    coverage's tracer (Python 3.11's, called for every line of every module) the
    interpreter tests took 99-103 s of CPU instead of 44. What it runs is device code
    (``gradaudit/engine/_triton_rows.py``), left out of the measured lines for this reason
    (``[tool.coverage.run] omit``); the host code around each launch is still measured.

    The tracer is taken off and put back as a debugger would (``sys.settrace``; coverage's
    C tracer reinstalls itself when set that way), and only coverage's: an xdist worker
    under pytest-cov can hold two stacked ``Coverage`` objects, so stopping
    ``Coverage.current()`` would only hand the thread to the other one.
    """
    tracer = sys.gettrace()
    if tracer is None or not type(tracer).__module__.startswith("coverage"):
        yield
        return
    sys.settrace(None)
    try:
        yield
    finally:
        sys.settrace(tracer)


def skip_repatching_in_device_calls() -> bool:
    """Install the shortcut if Triton's interpreter is loaded and a checked release;
    return whether it is installed. Idempotent."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None or triton_release() not in CHECKED_TRITON:
        return False
    grid_executor = interpreter.GridExecutor
    device_function = interpreter.InterpretedFunction
    if getattr(grid_executor.__call__, "_skips_repatching", False):
        return True
    # The ids of the globals patched by each running launch, innermost last.
    running: list[set[int]] = []
    launch = grid_executor.__call__
    device_call = device_function.__call__

    @functools.wraps(launch)
    def launch_noting_globals(self: Any, *args: Any, **kwargs: Any) -> Any:
        running.append({id(self.fn.__globals__)})
        try:
            with coverage_paused():
                return launch(self, *args, **kwargs)
        finally:
            running.pop()

    @functools.wraps(device_call)
    def device_call_in_patched_globals(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not running or id(self.fn.__globals__) not in running[-1]:
            result = device_call(self, *args, **kwargs)
            if running:
                running[-1].add(id(self.fn.__globals__))
            return result
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            raise interpreter.InterpreterError(repr(error)) from error

    launch_noting_globals._skips_repatching = True  # type: ignore[attr-defined]
    grid_executor.__call__ = launch_noting_globals
    device_function.__call__ = device_call_in_patched_globals
    return True
