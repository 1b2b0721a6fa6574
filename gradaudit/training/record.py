"""What a :class:`~gradaudit.training.monitor.GradientMonitor` keeps of one collected step.

A record is read by the monitor (to act on it), by the loggers and callbacks of
:mod:`gradaudit.integrations` (every collected step) and by the user's own code (the
history): its numbers are worked out once, on the report's columns where it has them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradaudit._compat import cached_property
from gradaudit.policy import FindingKind, Severity
from gradaudit.precision.judging import StepHeadroom
from gradaudit.results import Finding, Report, TensorStats
from gradaudit.results.replicas import ReplicaCheck
from gradaudit.results.stats_table import StatsTable
from gradaudit.scan.finding_table import FindingTable

#: NaN and Inf are ``on_nonfinite``'s; every other kind is ``on_finding``'s.
NONFINITE_KINDS = frozenset({FindingKind.NAN, FindingKind.INF})


@dataclass(frozen=True)
class MonitorRecord:
    """The stats of one collected step, as the monitor keeps them in its history."""

    #: The step whose gradients these stats describe.
    step: int
    report: Report
    #: The dump written because of this record, or ``None``.
    dump: Path | None = None
    #: Why a dump this record called for could not be written, or ``None``.
    dump_error: str | None = None
    #: The cross-rank check of a DDP model's replicated gradients, or ``None`` when the
    #: step was not checked (not DDP, one rank, ``on_divergence="off"``, DTensor gradients).
    replicas: ReplicaCheck | None = None
    #: With ``precision=``: the gradients' headroom in that format (every gradient together,
    #: and the rows of those with a finding); its findings are ``cast`` findings of
    #: :attr:`report`, so :attr:`findings` has them. ``None`` without ``precision=``.
    headroom: StepHeadroom | None = None

    # The properties below are asked for several times per step (acting on the record,
    # logging it): cached, and worked out on the report's columns where it has them, so
    # that no TensorStats or Finding object is made for a healthy tensor (issue 28 item 9).

    @cached_property
    def global_norm(self) -> float:
        """L2 norm of every gradient, as ``torch.nn.utils.get_total_norm`` defines it: NaN
        when a gradient holds NaN, ``inf`` when one holds ±Inf (and none NaN).

        A step whose gradients are all NaN is never ``0.0`` here: on a dashboard that would
        read as gradients that vanished, while the Trainer's own ``grad_norm`` says ``nan``.
        The norm of the finite elements is :attr:`finite_norm`.
        """
        table = self._table
        if table is None:
            return _with_nonfinite(self.finite_norm, self.report.tensors)
        if table.nan.any():
            return math.nan
        if (table.pos_inf + table.neg_inf).any():
            return math.inf
        return self.finite_norm

    @property
    def finite_norm(self) -> float:
        """L2 norm over the finite elements of every gradient (overflow-safe)."""
        return self.report.summary.global_norm

    @property
    def gradient_health(self) -> float:
        """One number in [0, 1] for dashboards (:func:`gradaudit.scan.judge.gradient_health`)."""
        return self.report.summary.gradient_health

    @property
    def norms(self) -> dict[str, float]:
        """Per-parameter (per-layer) gradient norms, by parameter name: NaN for a gradient
        holding NaN, ``inf`` for one holding ±Inf (as :attr:`global_norm`)."""
        table = self._table
        if table is None:
            return {t.name: _with_nonfinite(t.norm, (t,)) for t in self.report.tensors}
        norms = np.where(table.pos_inf + table.neg_inf > 0, math.inf, table.norm)
        norms = np.where(table.nan > 0, math.nan, norms)
        return dict(zip(table.names, norms.tolist(), strict=True))

    @cached_property
    def nonfinite(self) -> tuple[str, ...]:
        """Names of the gradients holding NaN or Inf."""
        table = self._table
        if table is None:
            return tuple(t.name for t in self.report.tensors if t.nonfinite)
        nonfinite = table.nonfinite
        if not nonfinite.any():  # a healthy step
            return ()
        names = table.names
        return tuple(names[i] for i in np.flatnonzero(nonfinite).tolist())

    @cached_property
    def findings(self) -> tuple[Finding, ...]:
        """The findings other than NaN/Inf (exploding, vanishing, outlier …), not ignored,
        on gradients without NaN/Inf (``on_nonfinite`` speaks for those: the norm of
        their finite part says nothing)."""
        findings: Sequence[Finding] | Iterable[Finding] = self.report.findings
        if not findings:  # a healthy step
            return ()
        poisoned = set(self.nonfinite)
        if isinstance(findings, FindingTable):
            # Only the findings that pass the columns' filters are made as objects.
            kept = ~findings.kind_is(*NONFINITE_KINDS) & ~findings.severity_is(Severity.IGNORED)
            findings = findings.select(kept)
        return tuple(
            f
            for f in findings
            if f.kind not in NONFINITE_KINDS
            and f.severity is not Severity.IGNORED
            and f.tensor not in poisoned
        )

    @cached_property
    def failing_findings(self) -> tuple[Finding, ...]:
        """Those of :attr:`findings` the policy fails on (``Thresholds.fail_on``)."""
        return tuple(f for f in self.findings if f.failing)

    @property
    def _table(self) -> StatsTable | None:
        """The report's tensors as columns, when they are (an audit's report)."""
        tensors = self.report.tensors
        return tensors if isinstance(tensors, StatsTable) else None


def _with_nonfinite(norm: float, tensors: Sequence[TensorStats]) -> float:
    """``norm``, or NaN / ``inf`` when ``tensors`` hold NaN / ±Inf (NaN wins)."""
    if any(t.nan for t in tensors):
        return math.nan
    if any(t.pos_inf or t.neg_inf for t in tensors):
        return math.inf
    return norm
