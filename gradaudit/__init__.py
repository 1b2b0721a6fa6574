"""gradaudit: exact, fast, bounded-memory gradient-health audits for PyTorch.

Library API: :func:`audit` for in-memory tensors, :func:`collect_async` +
:meth:`PendingStats.materialize` to collect inside a training loop without a
device sync, :func:`scan_paths` for files. Results are frozen dataclasses.
"""

from __future__ import annotations

__version__ = "0.1.0"

from gradaudit.audit import PendingStats, audit, collect_async, scan_paths
from gradaudit.checks import exit_code
from gradaudit.errors import ExitCode, GradauditError, InputError, UsageError
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
    "DEFAULT_VANISHING_THRESHOLD",
    "ExitCode",
    "FileResult",
    "Finding",
    "FindingKind",
    "GradauditError",
    "InputError",
    "InputProblem",
    "LimitFinding",
    "LimitKind",
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
    "exit_code",
    "scan_paths",
]
