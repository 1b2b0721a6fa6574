"""What a monitor does about a completed step: the NaN/Inf, replica-divergence and finding
warnings or errors (``on_nonfinite``, ``on_divergence``, ``on_finding``), and the rate limit
that keeps a finding from warning at every collected step.

Apart from :class:`~gradaudit.training.monitor.GradientMonitor`, which collects and reads the
steps: these functions decide nothing about what is collected, only what the caller hears.
Each warning points at the caller of ``monitor.step()`` / ``flush()``: the functions are
called from the monitor's ``_act``, so their ``stacklevel`` counts that frame and the
monitor's public method.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from gradaudit.errors import (
    GradientFindingError,
    GradientFindingWarning,
    NonFiniteGradientError,
    NonFiniteGradientWarning,
    ReplicaDivergenceError,
    ReplicaDivergenceWarning,
)
from gradaudit.results import Finding
from gradaudit.training.locate import Location
from gradaudit.training.messages import dump_note, finding_message, nonfinite_message
from gradaudit.training.monitor_options import DivergenceAction, FindingAction, NonFiniteAction
from gradaudit.training.record import MonitorRecord

#: A finding on one tensor warns again only after this many collected steps.
QUIET_RECORDS = 10
#: warn() -> act_on_* -> GradientMonitor._act -> step()/flush() -> the training loop.
_CALLER = 4


class FindingRateLimit:
    """Which findings warn: a finding on one tensor (a dead attention bias, a layer that keeps
    exploding, an outlier that comes and goes) warns when it first appears and then at most
    once per :data:`QUIET_RECORDS` collected steps; its count is in every record (and every
    logged row) meanwhile."""

    def __init__(self) -> None:
        #: (kind, tensor) -> the record that last warned about it.
        self._warned_at: dict[tuple[str, str], int] = {}
        self._records = 0  # records acted on

    def next_record(self) -> None:
        """Count one more record acted on (also one whose findings are ignored)."""
        self._records += 1

    def due(self, findings: Iterable[Finding]) -> list[Finding]:
        """The findings that warn now, noted as warned."""
        due = []
        for finding in findings:
            pair = (finding.kind.value, finding.tensor)
            last = self._warned_at.get(pair)
            if last is None or self._records - last >= QUIET_RECORDS:
                self._warned_at[pair] = self._records
                due.append(finding)
        return due


def act_on_nonfinite(
    record: MonitorRecord, now: int, action: NonFiniteAction, location: Location | None
) -> None:
    """Warn or raise about a step with NaN/Inf gradients (``location``: where a locator
    found them, if it did)."""
    if not record.nonfinite or action == "ignore":
        return
    message = nonfinite_message(record, now, location)
    if action == "raise":
        raise NonFiniteGradientError(record.step, record.nonfinite, record.dump, message, location)
    warnings.warn(message, NonFiniteGradientWarning, stacklevel=_CALLER)


def act_on_divergence(record: MonitorRecord, now: int, action: DivergenceAction) -> None:
    """Warn or raise about replicated gradients that differ across ranks: on every
    collected step that shows it (a diverged replica rarely comes back)."""
    divergence = None if record.replicas is None else record.replicas.divergence
    if divergence is None or action == "ignore":
        return
    message = f"step {record.step}: {divergence.describe()}" + dump_note(record, now)
    if action == "raise":
        raise ReplicaDivergenceError(
            record.step,
            divergence.tensor,
            divergence.ranks,
            divergence.tensors,
            record.dump,
            message,
        )
    warnings.warn(message, ReplicaDivergenceWarning, stacklevel=_CALLER)


def act_on_findings(
    record: MonitorRecord, now: int, action: FindingAction, limit: FindingRateLimit
) -> None:
    """Findings warn (rate-limited by ``limit``); failing ones raise if asked."""
    limit.next_record()
    if action == "ignore":
        return
    new = limit.due(record.findings)
    failing = record.failing_findings
    if action == "raise" and failing:
        raise GradientFindingError(
            record.step,
            tuple((f.kind.value, f.tensor) for f in failing),
            record.dump,
            finding_message(record, failing, now, new=False),
        )
    if new:
        new.sort(key=lambda f: not f.failing)  # exploding (failing) before the warnings
        warnings.warn(
            finding_message(record, new, now, new=True), GradientFindingWarning, stacklevel=_CALLER
        )
