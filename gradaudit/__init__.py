"""gradaudit: exact, fast, bounded-memory gradient-health audits for PyTorch.

Library API: :func:`audit` for in-memory tensors, :func:`collect_async` +
:meth:`PendingStats.materialize` to collect inside a training loop without a
device sync, :func:`scan_paths` for files; :func:`dual_stats`, :func:`compare`
and :func:`compare_paths` for host vs seed and A vs B. Results are frozen
dataclasses. Inside a training loop: :func:`collect_module`,
:func:`save_gradients` and :class:`GradientMonitor`; across ranks:
:mod:`gradaudit.distributed`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what mypy and IDEs see; at run time names resolve on first use
    from gradaudit.audit import PendingEntry, PendingStats, audit, collect_async, scan_paths
    from gradaudit.checks import exit_code
    from gradaudit.compare import CompareInput, compare, compare_paths, dual_stats
    from gradaudit.compare_checks import comparison_exit_code
    from gradaudit.comparison import (
        DEFAULT_MAX_CHANGE,
        CompareFinding,
        CompareFindingKind,
        ComparePolicy,
        Comparison,
        DualGradientStats,
        Mismatch,
        ParameterChange,
        ParameterComparison,
        SideStats,
    )
    from gradaudit.distributed import scan_paths_distributed
    from gradaudit.dump import save_gradients
    from gradaudit.errors import (
        ExitCode,
        GradauditError,
        InputError,
        NonFiniteGradientError,
        NonFiniteGradientWarning,
        UsageError,
    )
    from gradaudit.locate import Location, NanLocator
    from gradaudit.module import collect_module, named_gradients
    from gradaudit.monitor import GradientMonitor, LocateMode, MonitorRecord, NonFiniteAction
    from gradaudit.policy import (
        DEFAULT_EXPLODING_THRESHOLD,
        DEFAULT_FAIL_ON,
        DEFAULT_VANISHING_THRESHOLD,
        FindingKind,
        LimitKind,
        Severity,
        Thresholds,
    )
    from gradaudit.results import (
        FileResult,
        Finding,
        InputProblem,
        LimitFinding,
        Report,
        Skipped,
        Summary,
        TensorStats,
    )

#: Public name -> the module that defines it. Importing one resolves it (PEP 562):
#: most of these modules import torch, which costs about 1.2 s, and the CLI's
#: --help, --version and shell completion need none of them.
_LAZY: dict[str, str] = {
    "PendingEntry": "gradaudit.audit",
    "PendingStats": "gradaudit.audit",
    "audit": "gradaudit.audit",
    "collect_async": "gradaudit.audit",
    "scan_paths": "gradaudit.audit",
    "exit_code": "gradaudit.checks",
    "CompareInput": "gradaudit.compare",
    "compare": "gradaudit.compare",
    "compare_paths": "gradaudit.compare",
    "dual_stats": "gradaudit.compare",
    "comparison_exit_code": "gradaudit.compare_checks",
    "CompareFinding": "gradaudit.comparison",
    "CompareFindingKind": "gradaudit.comparison",
    "ComparePolicy": "gradaudit.comparison",
    "Comparison": "gradaudit.comparison",
    "DEFAULT_MAX_CHANGE": "gradaudit.comparison",
    "DualGradientStats": "gradaudit.comparison",
    "Mismatch": "gradaudit.comparison",
    "ParameterChange": "gradaudit.comparison",
    "ParameterComparison": "gradaudit.comparison",
    "SideStats": "gradaudit.comparison",
    "scan_paths_distributed": "gradaudit.distributed",
    "save_gradients": "gradaudit.dump",
    "ExitCode": "gradaudit.errors",
    "GradauditError": "gradaudit.errors",
    "InputError": "gradaudit.errors",
    "NonFiniteGradientError": "gradaudit.errors",
    "NonFiniteGradientWarning": "gradaudit.errors",
    "UsageError": "gradaudit.errors",
    "Location": "gradaudit.locate",
    "NanLocator": "gradaudit.locate",
    "collect_module": "gradaudit.module",
    "named_gradients": "gradaudit.module",
    "GradientMonitor": "gradaudit.monitor",
    "LocateMode": "gradaudit.monitor",
    "MonitorRecord": "gradaudit.monitor",
    "NonFiniteAction": "gradaudit.monitor",
    "DEFAULT_EXPLODING_THRESHOLD": "gradaudit.policy",
    "DEFAULT_FAIL_ON": "gradaudit.policy",
    "DEFAULT_VANISHING_THRESHOLD": "gradaudit.policy",
    "FindingKind": "gradaudit.policy",
    "LimitKind": "gradaudit.policy",
    "Severity": "gradaudit.policy",
    "Thresholds": "gradaudit.policy",
    "FileResult": "gradaudit.results",
    "Finding": "gradaudit.results",
    "InputProblem": "gradaudit.results",
    "LimitFinding": "gradaudit.results",
    "Report": "gradaudit.results",
    "Skipped": "gradaudit.results",
    "Summary": "gradaudit.results",
    "TensorStats": "gradaudit.results",
}


# Hidden from mypy, which would otherwise accept any name as ``Any``: it checks the
# names against the TYPE_CHECKING imports above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            globals()[name] = value
            return value
        # ``import gradaudit`` used to import every submodule as a side effect, so
        # ``gradaudit.distributed.…`` worked without importing it: it still does.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps ``gradaudit.audit`` and ``gradaudit.compare`` the functions.

    Importing a submodule binds it on its package: ``import gradaudit.audit``
    (which the CLI and the engine do) would set ``gradaudit.audit`` to the
    module, and the lazy lookup of the function would never run. The eager
    ``from gradaudit.audit import audit`` this replaces bound the function
    last; this keeps that promise whatever is imported first.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "DEFAULT_EXPLODING_THRESHOLD",
    "DEFAULT_FAIL_ON",
    "DEFAULT_MAX_CHANGE",
    "DEFAULT_VANISHING_THRESHOLD",
    "CompareFinding",
    "CompareFindingKind",
    "CompareInput",
    "ComparePolicy",
    "Comparison",
    "DualGradientStats",
    "ExitCode",
    "FileResult",
    "Finding",
    "FindingKind",
    "GradauditError",
    "GradientMonitor",
    "InputError",
    "InputProblem",
    "LimitFinding",
    "LimitKind",
    "LocateMode",
    "Location",
    "Mismatch",
    "MonitorRecord",
    "NanLocator",
    "NonFiniteAction",
    "NonFiniteGradientError",
    "NonFiniteGradientWarning",
    "ParameterChange",
    "ParameterComparison",
    "PendingEntry",
    "PendingStats",
    "Report",
    "Severity",
    "SideStats",
    "Skipped",
    "Summary",
    "TensorStats",
    "Thresholds",
    "UsageError",
    "__version__",
    "audit",
    "collect_async",
    "collect_module",
    "compare",
    "compare_paths",
    "comparison_exit_code",
    "dual_stats",
    "exit_code",
    "named_gradients",
    "save_gradients",
    "scan_paths",
    "scan_paths_distributed",
]
