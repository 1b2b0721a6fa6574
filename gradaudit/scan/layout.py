"""What judging a report takes from the tensors' facts alone, kept across a training loop.

A :class:`~gradaudit.GradientMonitor` reports on the same parameters step after step: their
names, shapes, dtypes and sources are the same every time, and so are what follows from
them alone: the columns of the shapes, each tensor's role and its evidence, which tensors
are optimizer state, and the groups the outlier check compares within. Worked out again on
every step they were about half of a monitor's step for 40 tensors (issue 28 item 9).

A :class:`LayoutCache` keeps the :class:`ReportLayout` of the last report;
:meth:`~gradaudit.scan.collected.Collected.report` takes it again when the facts of the
tensors it is given are equal to the layout's (:class:`LayoutKey`: compared at C speed, the
same name objects, the same shape columns), and works everything out afresh otherwise (a
parameter added, a gradient that became ``None``, a dtype changed, other thresholds).
Only the judging that reads the values runs every step, so a report made with a layout is
the report made without one: one implementation of each step, the layout only remembers
the results of those that depend on the facts.
"""

from __future__ import annotations

import array
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gradaudit.policy import Thresholds
from gradaudit.results.roles import FileEvidence
from gradaudit.scan.judge import RoleDecision
from gradaudit.scan.outliers import OutlierGroups

__all__ = ["LayoutCache", "LayoutKey", "ReportLayout"]


@dataclass(frozen=True)
class LayoutKey:
    """Every fact a :class:`ReportLayout` is worked out from; equal keys, equal layouts.

    Tensors with hints (a file's structure) or derived rows have no layout: a monitor's
    gradients have neither, and a file is reported once.
    """

    names: list[str]
    #: Each tensor's rank, and every dimension back to back (as a collection keeps them).
    ranks: array.array[int]
    dims: array.array[int]
    dtypes: list[str]
    sources: list[str | None]
    thresholds: Thresholds
    file_evidence: Mapping[str, FileEvidence]

    def frozen(self) -> LayoutKey:
        """A copy that holds its own lists: the collection's may grow after its report."""
        return LayoutKey(
            list(self.names),
            array.array("q", self.ranks),
            array.array("q", self.dims),
            list(self.dtypes),
            list(self.sources),
            self.thresholds,
            dict(self.file_evidence),
        )


@dataclass(frozen=True)
class ReportLayout:
    """What a report of tensors with these facts takes from the facts alone.

    Its arrays are read-only: every report made with the layout shares them.
    """

    key: LayoutKey
    #: The shapes as columns (:class:`~gradaudit.results.stats_table.StatsTable`'s
    #: ``dims``, ``starts``) and each tensor's element count.
    dims: np.ndarray
    starts: np.ndarray
    numel: np.ndarray
    dtype_codes: np.ndarray
    dtypes: tuple[str, ...]
    source_codes: np.ndarray
    sources: tuple[str | None, ...]
    roles: RoleDecision
    #: Indices of the tensors whose role is optimizer state.
    optimizer: list[int]
    #: The outlier groups of the report the layout was made with
    #: (:func:`~gradaudit.scan.outliers.find_outliers` checks they still apply).
    outliers: OutlierGroups

    def __post_init__(self) -> None:
        arrays = (self.dims, self.starts, self.numel, self.dtype_codes, self.source_codes)
        for column in (*arrays, self.roles.role_codes, self.roles.evidence_codes):
            column.flags.writeable = False
        self.outliers.candidates.flags.writeable = False
        self.outliers.eligible.flags.writeable = False
        self.outliers.shape_class.flags.writeable = False
        for members in self.outliers.members:
            members.flags.writeable = False


class LayoutCache:
    """The layout of the last report of a monitor's gradients, to take again if it fits.

    One layout, not several: a training loop's parameters change rarely and never back
    and forth, so the last one is the one that fits or none does.
    """

    def __init__(self) -> None:
        self._layout: ReportLayout | None = None

    def get(self, key: LayoutKey) -> ReportLayout | None:
        """The kept layout if it was made for facts equal to ``key``, else ``None``."""
        layout = self._layout
        return layout if layout is not None and layout.key == key else None

    def keep(self, layout: ReportLayout) -> None:
        """Keep ``layout`` (made from facts that no longer change: :meth:`LayoutKey.frozen`)."""
        self._layout = layout
