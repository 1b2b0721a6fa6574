"""gradaudit: exact, fast, bounded-memory gradient-health audits for PyTorch.

Library API: :func:`audit` for in-memory tensors, :func:`collect_async` +
:meth:`PendingStats.materialize` to collect inside a training loop without a
device sync, :func:`scan_paths` for files. Results are frozen dataclasses.
Inside a training loop: :func:`collect_module`, :func:`save_gradients` and
:class:`GradientMonitor`; across ranks: :mod:`gradaudit.distributed`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from gradaudit.audit import PendingEntry, PendingStats, audit, collect_async, scan_paths
from gradaudit.checks import exit_code
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
from gradaudit.module import collect_module, named_gradients
from gradaudit.monitor import GradientMonitor, MonitorRecord, NonFiniteAction
from gradaudit.policy import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_FAIL_ON,
    DEFAULT_VANISHING_THRESHOLD,
    FindingKind,
    Severity,
    Thresholds,
)
from gradaudit.results import (
    FileResult,
    Finding,
    InputProblem,
    Report,
    Skipped,
    Summary,
    TensorStats,
)

__all__ = [
    "DEFAULT_EXPLODING_THRESHOLD",
    "DEFAULT_FAIL_ON",
    "DEFAULT_VANISHING_THRESHOLD",
    "ExitCode",
    "FileResult",
    "Finding",
    "FindingKind",
    "GradauditError",
    "GradientMonitor",
    "InputError",
    "InputProblem",
    "MonitorRecord",
    "NonFiniteAction",
    "NonFiniteGradientError",
    "NonFiniteGradientWarning",
    "PendingEntry",
    "PendingStats",
    "Report",
    "Severity",
    "Skipped",
    "Summary",
    "TensorStats",
    "Thresholds",
    "UsageError",
    "__version__",
    "audit",
    "collect_async",
    "collect_module",
    "exit_code",
    "named_gradients",
    "save_gradients",
    "scan_paths",
    "scan_paths_distributed",
]
