"""A gradient monitor for training loops: stats every N steps, never waiting for the device.

``monitor.step()`` goes between ``backward()`` and ``optimizer.step()``. On a
collecting step it queues the stats of every gradient on the device
(:func:`~gradaudit.training.gradients.collect_gradients`) and starts their copy to the host
(:meth:`PendingStats.prefetch`); the report is built at the next call, when the
copy has long finished, so the loop never waits for the current step's work.

The price is that a NaN is learned one call late, when the gradients that held
it are gone (and the optimizer has already applied them). A dump written then
holds the *current* gradients, named after the current step, with the step
whose stats showed the NaN in its metadata. ``sync=True`` reads the stats in
the same call instead: one device sync per collecting step (every ``every``
steps), and in exchange the dump holds exactly the gradients that had the NaN,
and ``on_nonfinite="raise"`` stops the loop before ``optimizer.step()`` applies
them. Chasing a NaN, use ``sync=True``; watching a healthy run, the default.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from gradaudit.engine.dtensor import any_dtensor, is_dtensor
from gradaudit.engine.stats import StatsCollector
from gradaudit.errors import NonFiniteGradientWarning
from gradaudit.policy import Thresholds
from gradaudit.precision import (
    DEFAULT_MAX_UNDERFLOW,
    Precision,
    StepHeadroom,
    cast_findings,
    step_headroom,
)
from gradaudit.results import Report
from gradaudit.results.stats_table import StatsTable
from gradaudit.scan.judge import with_findings
from gradaudit.scan.layout import LayoutCache
from gradaudit.training.acting import (
    FindingRateLimit,
    act_on_divergence,
    act_on_findings,
    act_on_nonfinite,
)
from gradaudit.training.dump import save_gradients
from gradaudit.training.gradients import (
    GradientLister,
    HistogramCounts,
    ParametersInput,
    collect_columns,
    collect_with_histograms,
    named_gradients,
    named_parameters,
)
from gradaudit.training.locate import Location, NanLocator
from gradaudit.training.messages import divergence_metadata, finding_metadata, nonfinite_metadata
from gradaudit.training.monitor_options import (
    AdapterOptions,
    DivergenceAction,
    FindingAction,
    LocateMode,
    MonitorOptions,
    NonFiniteAction,
    check_options,
)
from gradaudit.training.record import MonitorRecord
from gradaudit.training.replay import StepReplay
from gradaudit.training.replicas import (
    GatheredDigests,
    gather_digests,
    model_device,
    replica_group,
    replicating_wrapper,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from gradaudit.scan.pending import PendingStats

__all__ = [
    "AdapterOptions",
    "DivergenceAction",
    "FindingAction",
    "GradientMonitor",
    "LocateMode",
    "MonitorOptions",
    "NonFiniteAction",
]


@dataclasses.dataclass(frozen=True)
class _Collected:
    """A collected step not read yet: its stats, its replicas' digests (a DDP model), its
    exponent histograms (``precision=``)."""

    step: int
    pending: PendingStats
    digests: GatheredDigests | None
    histograms: HistogramCounts | None


class GradientMonitor:
    """Gradient stats every ``every`` steps, a short history, and dumps on NaN/Inf.

    ::

        monitor = GradientMonitor(model, every=100, dump_dir="grad_dumps")
        for batch in loader:
            loss = model(batch).loss
            loss.backward()
            monitor.step()          # after backward, before optimizer.step()
            optimizer.step()
            optimizer.zero_grad()
        monitor.flush()             # the last collected step's stats

    ``step()`` returns the :class:`MonitorRecord` it completed in this call (in
    the default mode, the previous collected step's), or ``None``. The history
    keeps the last ``history`` records. With ``DTensor`` gradients or ``group``
    the stats are of whole parameters on every rank (see
    :func:`~gradaudit.collect_module`), so every rank must call ``step()``.

    With a ``DistributedDataParallel`` model (or ``replicated_by=`` its wrapper, when
    ``model`` is the module it wraps or some of its parameters) every collected step also
    checks that the replicated gradients are bit-identical on every rank
    (``on_divergence``; :mod:`gradaudit.training.replicas`).

    With ``precision="fp16"`` (or ``"bf16"``, ``"fp8_e4m3fn"``, ``"fp8_e5m2"``) every
    collected step also judges the gradients' headroom in that format
    (:mod:`gradaudit.precision`): ``record.headroom``, from the same collection (on the CPU
    the native kernel counts the exponent histograms in the read that makes the stats;
    elsewhere one more pass per gradient, on collecting steps only). A gradient with more
    than ``max_underflow`` of its non-zero values flushing to zero, or any overflowing, is a
    ``cast`` finding, acted on as ``on_finding`` says. With ``DTensor`` gradients or
    ``group`` each shard's histogram is summed across ranks in the stats rows' own
    collective, so every rank judges the whole parameters and reports the same findings.
    See ``docs/precision.md``, "In a training loop", for what a ``GradScaler``'s scaled
    gradients mean there.

    Dumps go to ``dump_dir/step_NNNNNNNN.safetensors`` (at most ``max_dumps``
    of them; ``dump_dir=None`` never writes one). With DTensor gradients rank 0
    writes the gathered gradients; other distributed runs write one file per
    rank (``step_NNNNNNNN.rankRRRRR.safetensors``). A dump that fails (a full
    disk) does not stop training in ``dump`` mode: the warning says why.
    """

    def __init__(
        self,
        model: ParametersInput,
        *,
        every: int = 100,
        dump_dir: str | Path | None = "grad_dumps",
        on_nonfinite: NonFiniteAction = "dump",
        on_finding: FindingAction = "warn",
        on_divergence: DivergenceAction = "dump",
        sync: bool = False,
        history: int = 32,
        max_dumps: int = 3,
        thresholds: Thresholds | None = None,
        prefix: str | None = None,
        group: ProcessGroup | None = None,
        replicated_by: torch.nn.Module | None = None,
        locate: LocateMode = "off",
        locate_every: int = 1,
        precision: Precision | str | None = None,
        max_underflow: float = DEFAULT_MAX_UNDERFLOW,
    ) -> None:
        check_options(
            every=every,
            on_nonfinite=on_nonfinite,
            on_finding=on_finding,
            on_divergence=on_divergence,
            history=history,
            max_dumps=max_dumps,
            locate=locate,
            locate_every=locate_every,
            precision=precision,
            max_underflow=max_underflow,
            hooks_modules=isinstance(model, torch.nn.Module),
        )
        # A generator of parameters would be used up by the first collection.
        self._params: ParametersInput = model
        if not isinstance(model, torch.nn.Module | Mapping | list | tuple):
            self._params = cast(ParametersInput, list(model))
        self.every = every
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self.on_nonfinite: NonFiniteAction = on_nonfinite
        self.on_finding: FindingAction = on_finding
        self.on_divergence: DivergenceAction = on_divergence
        self._finding_warnings = FindingRateLimit()
        self.sync = sync
        self.max_dumps = max_dumps
        self.thresholds = thresholds or Thresholds()
        self.prefix = prefix
        self._gradients = GradientLister(self._params, prefix=prefix)
        self.group = group
        if replicated_by is not None and not isinstance(
            replicated_by, torch.nn.parallel.DistributedDataParallel
        ):
            raise ValueError(
                "replicated_by must be the DistributedDataParallel wrapper of the model; "
                f"got {type(replicated_by).__name__}"
            )
        self._replicated_by = replicated_by
        self._searched: list[int] | None = None  # the candidates find_replicas last looked at
        self.dumps_written = 0
        self._history: deque[MonitorRecord] = deque(maxlen=history)
        self._collector = StatsCollector()
        # What judging the gradients takes from their names and shapes alone, kept while
        # the parameters stay the same (issue 28 item 9).
        self._layouts = LayoutCache()
        self._pending: _Collected | None = None
        self._next_step = 0
        self.locate: LocateMode = locate
        self.locate_every = locate_every
        #: The format whose headroom each collected step judges, or ``None``.
        self.precision = None if precision is None else Precision(precision)
        self.max_underflow = max_underflow
        self._locator = (
            NanLocator(model) if locate != "off" and isinstance(model, torch.nn.Module) else None
        )
        self._locate_next = False  # a NaN/Inf was seen and not located yet
        self._locations: deque[tuple[int, Location]] = deque(maxlen=history)
        # With this step's stats read in this call (sync), a NaN/Inf step is located before
        # step() returns, by replaying its forward and backward: keep each step's batch.
        self._replay = (
            StepReplay(model)
            if sync and locate != "off" and isinstance(model, torch.nn.Module)
            else None
        )
        if self._replay is not None:
            self._replay.arm()
        if locate == "always":
            self._arm_for(0)

    @property
    def locations(self) -> tuple[tuple[int, Location], ...]:
        """``(step, Location)`` of the recent located steps (``locate=...``), oldest first."""
        return tuple(self._locations)

    @property
    def history(self) -> tuple[MonitorRecord, ...]:
        """The most recent records, oldest first."""
        return tuple(self._history)

    @property
    def last(self) -> MonitorRecord | None:
        return self._history[-1] if self._history else None

    def norm_history(self, name: str | None = None) -> list[tuple[int, float]]:
        """``(step, norm)`` over the history: the global norm, or parameter ``name``'s."""
        if name is None:
            return [(r.step, r.global_norm) for r in self._history]
        return [(r.step, r.norms[name]) for r in self._history if name in r.norms]

    def step(self, step: int | None = None, *, collect: bool | None = None) -> MonitorRecord | None:
        """Call once per optimizer step, after ``backward()``; see the class docstring.

        ``step`` numbers this call (e.g. your global step); by default calls are
        numbered 0, 1, 2, ... Steps that are multiples of ``every`` are collected, unless
        ``collect`` decides (a framework adapter collecting the steps its trainer logs).
        """
        current = self._next_step if step is None else step
        self._next_step = current + 1
        record = self._complete(current)
        if current % self.every == 0 if collect is None else collect:
            names, gradients = self._gradients.columns()
            histograms: HistogramCounts | None = None
            if self.precision is None:
                pending = collect_columns(
                    names, gradients, group=self.group, collector=self._collector
                )
            else:
                pending, histograms = collect_with_histograms(
                    names, gradients, group=self.group, collector=self._collector
                )
            collected = _Collected(
                current, pending, self._gather_digests(pending, gradients), histograms
            )
            if self.sync:
                record = self._finish(collected, current)
            else:
                pending.prefetch()
                self._pending = collected
        # With this step's own stats at hand (sync), they name the poisoned gradients.
        same_step = record is not None and record.step == current
        acting_on_it = record is not None and same_step and bool(record.nonfinite)
        self._read_location(
            current, record.report if same_step and record else None, announce=not acting_on_it
        )
        if record is not None and record.nonfinite and self._locator is not None:
            if self._location_of(record.step) is None and same_step and self._replay:
                # Before optimizer.step() applies it: replay this step under the locator.
                replayed = self._replay.replay(self._locator, record.report)
                if replayed is not None:
                    self._locations.append((record.step, replayed))
            if self.locate == "on_nonfinite" and self._location_of(record.step) is None:
                # Not located (async stats, a NaN that did not reproduce): arm the next steps.
                self._locate_next = True
        if self._replay is not None:
            self._replay.clear()
            self._replay.arm()
        self._arm_for(current + 1)
        if record is not None:
            self._act(record, current)
        return record

    def _gather_digests(
        self, pending: PendingStats, gradients: list[torch.Tensor]
    ) -> GatheredDigests | None:
        """Every rank's digests of a DDP model's replicated gradients (collective), or
        ``None`` when this step is not checked (see :mod:`gradaudit.training.replicas`)."""
        if self.on_divergence == "off":
            return None
        wrapper = self._params if self._replicated_by is None else self._replicated_by
        group = replica_group(wrapper, self.group)
        if group is None or any_dtensor(gradients):
            return None
        assert isinstance(wrapper, torch.nn.Module)  # a DDP wrapper: replica_group
        return gather_digests(pending, self._gradients.names(), group, model_device(wrapper))

    @property
    def replicated_by(self) -> torch.nn.Module | None:
        """The ``DistributedDataParallel`` wrapper whose replicated gradients are checked
        across ranks: ``model`` itself when it is one, else ``replicated_by``."""
        if isinstance(self._params, torch.nn.parallel.DistributedDataParallel):
            return self._params
        return self._replicated_by

    def find_replicas(self, candidates: Iterable[object]) -> torch.nn.Module | None:
        """Check across ranks the gradients of the first ``DistributedDataParallel`` among
        ``candidates`` that holds every parameter this monitor watches, from the next
        collected step on; returns it, or ``None`` (nothing changes then).

        For a framework adapter whose monitor watches the module DDP wraps, or some of its
        parameters, while the framework holds the wrapper (see
        :func:`~gradaudit.training.replicas.replicating_wrapper`). Collective-free: the
        wrapper is matched by its parameters' identity.
        """
        if self.replicated_by is not None:
            return self.replicated_by
        candidates = list(candidates)
        searched = [id(candidate) for candidate in candidates]
        if searched == self._searched:  # an adapter asking at every step: looked already
            return None
        self._searched = searched
        parameters = [param for _, param in named_parameters(self._params, prefix=self.prefix)]
        self._replicated_by = replicating_wrapper(candidates, parameters)
        return self._replicated_by

    def _location_of(self, step: int) -> Location | None:
        """The location found for ``step``, if it was located and held NaN/Inf."""
        return next((loc for s, loc in reversed(self._locations) if s == step and loc.found), None)

    def _arm_for(self, step: int) -> None:
        """Arm the locator for ``step`` (hooks must be in place before its forward), or not."""
        if self._locator is None or self.locate == "off":
            return
        if self._locate_next or (self.locate == "always" and step % self.locate_every == 0):
            self._locator.arm()
        else:
            self._locator.disarm()

    def _read_location(self, step: int, report: Report | None, *, announce: bool) -> None:
        """The one read of an armed step's hook counts; a found NaN/Inf is warned about
        (``announce``; otherwise the NaN/Inf warning or error of this step says it)."""
        if self._locator is None or not self._locator.armed:
            return
        location = self._locator.read(report)
        self._locations.append((step, location))
        if location.found:
            self._locate_next = False
            if self.on_nonfinite != "ignore" and announce:
                warnings.warn(
                    f"step {step}: NaN/Inf located: " + location.describe().replace("\n", "; "),
                    NonFiniteGradientWarning,
                    stacklevel=4,
                )

    def flush(self) -> MonitorRecord | None:
        """Complete the stats still pending (call after the loop); ``None`` if there are none.

        Also removes a locator's hooks.
        """
        now = self._next_step - 1
        if self._locator is not None:
            self._locator.disarm()
        if self._replay is not None:
            self._replay.disarm()
        record = self._complete(now)
        if record is not None:
            self._act(record, now)
        return record

    def _complete(self, now: int) -> MonitorRecord | None:
        if self._pending is None:
            return None
        collected = self._pending
        self._pending = None
        return self._finish(collected, now)

    def _finish(self, collected: _Collected, now: int) -> MonitorRecord:
        """The one host read for step ``collected.step`` (the gathered digests and the
        histograms are read right after it); a dump holds the gradients of ``now``."""
        report = collected.pending.materialize(
            self.thresholds, layouts=self._layouts, histograms=False
        )
        headroom = None
        if collected.histograms is not None:
            headroom = self._headroom(report, collected.histograms)
            report = with_findings(report, cast_findings(headroom.findings, self.thresholds))
        digests = collected.digests
        replicas = None if digests is None else digests.read()
        record = MonitorRecord(collected.step, report, replicas=replicas, headroom=headroom)
        divergence = None if replicas is None else replicas.divergence
        if record.nonfinite and self.on_nonfinite in ("dump", "raise"):
            record = self._dump(record, now, nonfinite_metadata(record))
        elif divergence is not None and self.on_divergence in ("dump", "raise"):
            record = self._dump(record, now, divergence_metadata(record))
        elif record.failing_findings and self.on_finding in ("dump", "raise"):
            record = self._dump(record, now, finding_metadata(record))
        self._history.append(record)
        return record

    def _headroom(self, report: Report, histograms: HistogramCounts) -> StepHeadroom:
        """The headroom of the collected gradients, judged on the histogram counts as one
        matrix (no object per healthy gradient)."""
        assert self.precision is not None
        counts = histograms.histogram_counts()
        tensors = report.tensors
        if isinstance(tensors, StatsTable):
            names: Sequence[str] = tensors.names
            max_abs = tensors.max_abs
        else:
            names = [t.name for t in tensors]
            max_abs = np.array([t.max_abs for t in tensors], dtype=np.float64)
        return step_headroom(names, counts, max_abs, self.precision, self.max_underflow)

    def _act(self, record: MonitorRecord, now: int) -> None:
        """Warn or raise about NaN/Inf, then about divergent replicas, then about the other
        findings (:mod:`gradaudit.training.acting`)."""
        location = self._location_of(record.step) if record.nonfinite else None
        act_on_nonfinite(record, now, self.on_nonfinite, location)
        act_on_divergence(record, now, self.on_divergence)
        act_on_findings(record, now, self.on_finding, self._finding_warnings)

    def _dump(self, record: MonitorRecord, now: int, metadata: dict[str, str]) -> MonitorRecord:
        if self.dump_dir is None or self.dumps_written >= self.max_dumps:
            return record
        gradients = named_gradients(self._params, prefix=self.prefix)
        if not gradients:
            return dataclasses.replace(record, dump=None, dump_error="no gradients to dump")
        path = self.dump_dir / _dump_name(now, gathered=any(is_dtensor(g) for _, g in gradients))
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            save_gradients(gradients, path, step=now, metadata=metadata)
        except OSError as error:
            return dataclasses.replace(
                record, dump=None, dump_error=f"{type(error).__name__}: {error}"
            )
        self.dumps_written += 1
        return dataclasses.replace(record, dump=path)


def _dump_name(step: int, *, gathered: bool) -> str:
    """``step_00000120.safetensors``; per rank when each rank writes its own shards."""
    import torch.distributed as dist

    name = f"step_{step:08d}"
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and not gathered:
        name += f".rank{dist.get_rank():05d}"
    return name + ".safetensors"
