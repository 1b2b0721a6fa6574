"""A pytest plugin that pins which kernel ``auto`` uses for CUDA tensors (the GPU check's passes).

    GA_CHECK_ENGINE=triton python -m pytest -p benchmarks.force_engine -m cuda tests/...

``triton``: ``auto`` launches the Triton kernels at once, compiled before or not (with a
fresh ``TRITON_CACHE_DIR`` that is the cold pass: the first test compiles); ``eager``:
``auto`` never launches them. Both go through the one decision ``auto`` makes,
``triton_kernel.compile_worth``; a test that names an engine keeps it, and tests named
``test_auto_*`` check that decision itself, so they run unforced. ``GA_CHECK_REQUIRE_CUDA=1``
makes a machine without CUDA a usage error (every CUDA test would skip, which is not a
pass). The terminal summary ends with a ``figure:`` line: the forced engine and how many
Triton flushes ran.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest
import torch

from gradaudit.engine import triton_kernel, triton_plan

ENGINES = ("triton", "eager")
#: Tests of ``auto``'s own choice between the kernels: forcing it would falsify them.
AUTO_TESTS = "test_auto_"

_forced: str | None = None
_counts = {"forced tests": 0, "triton flushes": 0}


def pytest_configure(config: pytest.Config) -> None:
    global _forced
    if os.environ.get("GA_CHECK_REQUIRE_CUDA") == "1" and not torch.cuda.is_available():
        raise pytest.UsageError("no CUDA device: every CUDA test would skip (see env.txt)")
    engine = os.environ.get("GA_CHECK_ENGINE") or None
    if engine is not None and engine not in ENGINES:
        raise pytest.UsageError(f"GA_CHECK_ENGINE={engine}: one of {', '.join(ENGINES)}")
    for name in ("compile_worth", "TritonBatch"):
        if not hasattr(triton_kernel, name):
            raise pytest.UsageError(
                f"gradaudit.engine.triton_kernel.{name} is gone: update benchmarks/force_engine.py"
            )
    _forced = engine


def pytest_report_header() -> str:
    return f"force_engine: auto -> {_forced or 'not forced'} for CUDA tensors"


def _counting(launch: Any) -> Any:
    def counted(*args: Any) -> Any:
        _counts["triton flushes"] += 1
        return launch(*args)

    return counted


#: What launches a flush: a batch, or the plan of a list planned once (where torch's C shim
#: is bound, a collector's first list too).
_LAUNCHERS = (triton_kernel.TritonBatch, triton_plan.TritonPlan)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    with pytest.MonkeyPatch.context() as patch:
        for owner in _LAUNCHERS:
            patch.setattr(owner, "launch", _counting(owner.launch))
        if _forced is not None and not item.name.startswith(AUTO_TESTS):
            worth = _forced == "triton"
            patch.setattr(triton_kernel, "compile_worth", lambda device: worth)
            _counts["forced tests"] += 1
        yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"figure: auto -> {_forced or 'not forced'} in {_counts['forced tests']} tests, "
        f"{_counts['triton flushes']} Triton flushes"
    )
