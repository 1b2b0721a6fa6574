"""gradaudit: exact, fast, bounded-memory gradient-health audits for PyTorch.

Library API: :func:`audit` for in-memory tensors, :func:`collect_async` +
:meth:`PendingStats.materialize` to collect inside a training loop without a
device sync, :func:`scan_paths` for files; :func:`dual_stats`, :func:`compare`
and :func:`compare_paths` for host vs seed and A vs B; :func:`trend_paths` and
:class:`TrendBuilder` for norms over a series of steps. Results are frozen
dataclasses. Inside a training loop: :func:`collect_module`,
:func:`save_gradients` and :class:`GradientMonitor`; across ranks:
:mod:`gradaudit.training.distributed` (sharded gradients) and
:mod:`gradaudit.scan.distributed` (a scan split across a torchrun job).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what mypy and IDEs see; at run time names resolve on first use
    from gradaudit.comparison.api import CompareInput, compare, compare_paths, dual_stats
    from gradaudit.engine.options import EngineOptions
    from gradaudit.errors import (
        ExitCode,
        GradauditError,
        GradientFindingError,
        GradientFindingWarning,
        InputError,
        NonFiniteGradientError,
        NonFiniteGradientWarning,
        ReplicaDivergenceError,
        ReplicaDivergenceWarning,
        UsageError,
    )
    from gradaudit.policy import (
        DEFAULT_EXPLODING_THRESHOLD,
        DEFAULT_FAIL_ON,
        DEFAULT_VANISHING_THRESHOLD,
        FindingKind,
        InputKind,
        LimitKind,
        Role,
        Severity,
        Thresholds,
    )
    from gradaudit.results import (
        FileResult,
        Finding,
        GradientEstimate,
        InputProblem,
        LimitFinding,
        Report,
        Skipped,
        Summary,
        TensorStats,
    )
    from gradaudit.results.comparison import (
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
    from gradaudit.results.replicas import ReplicaCheck, ReplicaDivergence
    from gradaudit.results.trend import (
        LayerTrend,
        TrendFinding,
        TrendKind,
        TrendPolicy,
        TrendReport,
    )
    from gradaudit.results.verdict import comparison_exit_code, exit_code, trend_exit_code
    from gradaudit.scan.distributed import scan_paths_distributed
    from gradaudit.scan.paths import scan_paths
    from gradaudit.scan.pending import PendingEntry, PendingStats, audit, collect_async
    from gradaudit.training.dump import save_gradients
    from gradaudit.training.gradients import collect_module, named_gradients
    from gradaudit.training.locate import Location, NanLocator
    from gradaudit.training.monitor import (
        DivergenceAction,
        FindingAction,
        GradientMonitor,
        LocateMode,
        NonFiniteAction,
    )
    from gradaudit.training.record import MonitorRecord
    from gradaudit.trend.builder import TrendBuilder, trend_paths

#: Public name -> the module that defines it. Importing one resolves it (PEP 562):
#: most of these modules import torch, which costs about 1.2 s, and the CLI's
#: --help, --version and shell completion need none of them.
_LAZY: dict[str, str] = {
    "PendingEntry": "gradaudit.scan.pending",
    "PendingStats": "gradaudit.scan.pending",
    "audit": "gradaudit.scan.pending",
    "collect_async": "gradaudit.scan.pending",
    "scan_paths": "gradaudit.scan.paths",
    "exit_code": "gradaudit.results.verdict",
    "CompareInput": "gradaudit.comparison.api",
    "compare": "gradaudit.comparison.api",
    "compare_paths": "gradaudit.comparison.api",
    "dual_stats": "gradaudit.comparison.api",
    "comparison_exit_code": "gradaudit.results.verdict",
    "CompareFinding": "gradaudit.results.comparison",
    "CompareFindingKind": "gradaudit.results.comparison",
    "ComparePolicy": "gradaudit.results.comparison",
    "Comparison": "gradaudit.results.comparison",
    "DEFAULT_MAX_CHANGE": "gradaudit.results.comparison",
    "DualGradientStats": "gradaudit.results.comparison",
    "Mismatch": "gradaudit.results.comparison",
    "ParameterChange": "gradaudit.results.comparison",
    "ParameterComparison": "gradaudit.results.comparison",
    "SideStats": "gradaudit.results.comparison",
    "scan_paths_distributed": "gradaudit.scan.distributed",
    "save_gradients": "gradaudit.training.dump",
    "EngineOptions": "gradaudit.engine.options",
    "ExitCode": "gradaudit.errors",
    "GradauditError": "gradaudit.errors",
    "GradientFindingError": "gradaudit.errors",
    "GradientFindingWarning": "gradaudit.errors",
    "InputError": "gradaudit.errors",
    "NonFiniteGradientError": "gradaudit.errors",
    "NonFiniteGradientWarning": "gradaudit.errors",
    "ReplicaDivergenceError": "gradaudit.errors",
    "ReplicaDivergenceWarning": "gradaudit.errors",
    "UsageError": "gradaudit.errors",
    "Location": "gradaudit.training.locate",
    "NanLocator": "gradaudit.training.locate",
    "collect_module": "gradaudit.training.gradients",
    "named_gradients": "gradaudit.training.gradients",
    "GradientMonitor": "gradaudit.training.monitor",
    "LocateMode": "gradaudit.training.monitor",
    "MonitorRecord": "gradaudit.training.record",
    "NonFiniteAction": "gradaudit.training.monitor",
    "FindingAction": "gradaudit.training.monitor",
    "DivergenceAction": "gradaudit.training.monitor",
    "ReplicaCheck": "gradaudit.results.replicas",
    "ReplicaDivergence": "gradaudit.results.replicas",
    "DEFAULT_EXPLODING_THRESHOLD": "gradaudit.policy",
    "DEFAULT_FAIL_ON": "gradaudit.policy",
    "DEFAULT_VANISHING_THRESHOLD": "gradaudit.policy",
    "FindingKind": "gradaudit.policy",
    "InputKind": "gradaudit.policy",
    "Role": "gradaudit.policy",
    "LimitKind": "gradaudit.policy",
    "Severity": "gradaudit.policy",
    "Thresholds": "gradaudit.policy",
    "FileResult": "gradaudit.results",
    "Finding": "gradaudit.results",
    "GradientEstimate": "gradaudit.results",
    "InputProblem": "gradaudit.results",
    "LimitFinding": "gradaudit.results",
    "Report": "gradaudit.results",
    "Skipped": "gradaudit.results",
    "Summary": "gradaudit.results",
    "TensorStats": "gradaudit.results",
    "LayerTrend": "gradaudit.results.trend",
    "TrendBuilder": "gradaudit.trend.builder",
    "TrendFinding": "gradaudit.results.trend",
    "TrendKind": "gradaudit.results.trend",
    "TrendPolicy": "gradaudit.results.trend",
    "TrendReport": "gradaudit.results.trend",
    "trend_exit_code": "gradaudit.results.verdict",
    "trend_paths": "gradaudit.trend.builder",
}


def _submodules(package: str) -> Callable[[str], types.ModuleType]:
    """A module ``__getattr__`` that imports ``package.name`` on first use.

    ``import gradaudit`` used to import every submodule as a side effect, so
    ``gradaudit.results.…`` worked without importing it: it still does, in every
    subpackage too (``gradaudit.engine.stats.…``).
    """

    def submodule(name: str) -> types.ModuleType:
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return submodule


# Hidden from mypy, which would otherwise accept any name as ``Any``: it checks the
# names against the TYPE_CHECKING imports above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            globals()[name] = value
            return value
        return _submodules(__name__)(name)

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))


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
    "DivergenceAction",
    "DualGradientStats",
    "EngineOptions",
    "ExitCode",
    "FileResult",
    "Finding",
    "FindingAction",
    "FindingKind",
    "GradauditError",
    "GradientEstimate",
    "GradientFindingError",
    "GradientFindingWarning",
    "GradientMonitor",
    "InputError",
    "InputKind",
    "InputProblem",
    "LayerTrend",
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
    "ReplicaCheck",
    "ReplicaDivergence",
    "ReplicaDivergenceError",
    "ReplicaDivergenceWarning",
    "Report",
    "Role",
    "Severity",
    "SideStats",
    "Skipped",
    "Summary",
    "TensorStats",
    "Thresholds",
    "TrendBuilder",
    "TrendFinding",
    "TrendKind",
    "TrendPolicy",
    "TrendReport",
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
    "trend_exit_code",
    "trend_paths",
]
