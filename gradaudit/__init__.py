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

__version__ = "0.1.0"

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
