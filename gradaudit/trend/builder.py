"""``gradaudit trend``: how gradient norms evolve over a series of dumps.

A run that diverges rarely does so in one step. Auditing the dumps of many
steps together shows where it began: which layer's norm spiked first, at which
step the first NaN/Inf appeared and in which tensor, which layer died.

The pass is streaming: dumps are ordered by their step from the headers alone
(:mod:`gradaudit.trend.dumps`), then audited one at a time with
:func:`gradaudit.scan.paths.scan_paths` (one host read each). Only per-layer numbers
are kept between dumps (a few floats per layer and step), never a tensor, so memory
does not grow with the dumps' size.

Findings
--------
* **nonfinite**: the first step at which any tensor held NaN or ±Inf, naming
  the tensor(s) (one finding per run).
* **spike**: a layer's norm above ``spike_factor`` times the median of its
  norms at all earlier steps. Needs :data:`MIN_SPIKE_HISTORY` earlier steps, and
  a median at or above the vanishing threshold: the noise of a dead layer is
  not a spike. One finding per layer, at its first spike; every spiking step is
  listed in the layer's data.
* **collapse**: a layer whose norm was at or above the vanishing threshold,
  then fell below it at some step and stayed below until the last step, for at
  least :data:`MIN_COLLAPSE_STEPS` steps. A layer that was always below (an
  attention key bias) has not collapsed.

Steps at which a layer holds NaN/Inf are left out of its spike and collapse
analysis: its finite-part norm means little there, and the nonfinite finding
already covers them. By default nonfinite and spike fail the run, collapse is a
warning (like vanishing in ``scan``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gradaudit.engine.options import Engine, EngineOptions
from gradaudit.errors import UsageError
from gradaudit.grouping import GroupBy, group_layers, model_order, resolve
from gradaudit.io.discover import FileInput, expand_inputs, input_kind
from gradaudit.policy import InputKind, Thresholds
from gradaudit.precision.formats import Precision
from gradaudit.precision.headroom import Headroom
from gradaudit.precision.judging import precision_report
from gradaudit.results import FileResult, InputProblem, Report
from gradaudit.results.trend import (
    MIN_COLLAPSE_STEPS,
    MIN_SPIKE_HISTORY,
    LayerTrend,
    NonFiniteTensor,
    Spike,
    StepResult,
    TrendFinding,
    TrendKind,
    TrendPolicy,
    TrendReport,
)
from gradaudit.scan import torch_free
from gradaudit.trend.dumps import Dump, mapped_metadata, order_dumps

# -- the streaming pass ---------------------------------------------------------------------


def _has_finite(report: Report) -> bool:
    """Whether any audited element of ``report`` is finite (its global norm means something)."""
    return any(t.numel > t.nan + t.pos_inf + t.neg_inf for t in report.tensors)


def _median(ordered: Sequence[float]) -> float:
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


@dataclass
class _LayerState:
    """What the builder keeps of one layer between dumps: numbers only."""

    norms: list[float | None]
    max_abs: list[float | None]
    nonfinite: list[int]
    history: list[float] = field(default_factory=list)  # sorted finite-step norms
    spikes: list[Spike] = field(default_factory=list)
    first_nonfinite_step: int | None = None
    was_above: bool = False
    below_since: int | None = None  # step index where the current run below began
    below_steps: int = 0


class TrendBuilder:
    """Accumulates one report per step, in step order, into a :class:`TrendReport`.

    Usable from a training loop as well as from files: ``add(step, label, report)``
    after each audit, ``finish()`` at the end. Keeps per-layer numbers only.
    """

    def __init__(self, policy: TrendPolicy | None = None, group_by: GroupBy | None = None) -> None:
        self.policy = policy or TrendPolicy()
        self._requested = group_by or GroupBy()
        self._spec: GroupBy | None = None
        self._steps: list[StepResult] = []
        self._layers: dict[str, _LayerState] = {}
        #: (index of the step, the monitor's earlier step or None, path, tensors)
        self._first_nonfinite: tuple[int, int | None, str, tuple[NonFiniteTensor, ...]] | None = (
            None
        )
        self._errors: list[InputProblem] = []
        self._devices: dict[str, None] = {}
        self._engine = Engine.EAGER.value

    def add_error(self, problem: InputProblem) -> None:
        self._errors.append(problem)

    def add(
        self, step: int, path: str, report: Report, *, nonfinite_step: int | None = None
    ) -> None:
        """Fold in the audit of the dump at ``step``; steps must come in increasing order.

        ``nonfinite_step``: the earlier step at which the monitor that wrote this dump saw
        NaN/Inf (its ``nonfinite_step`` metadata); the first NaN/Inf is reported there, not
        at the step of the gradients the dump holds.
        """
        if self._steps and step <= self._steps[-1].step:
            raise ValueError(f"steps must increase: {step} after {self._steps[-1].step}")
        if report.tensors:
            self._devices[report.device] = None
            self._engine = report.engine
        if self._spec is None and report.tensors:
            self._spec = resolve(self._requested, (t.name for t in report.tensors))
        index = len(self._steps)
        nonfinite = [t for t in report.tensors if t.nonfinite]
        self._steps.append(
            StepResult(
                step=step,
                path=path,
                tensors=report.summary.tensors,
                global_norm=report.summary.global_norm if _has_finite(report) else None,
                nonfinite_tensors=len(nonfinite),
                gradient_health=report.summary.gradient_health,
                read_as=report.files[0].read_as if report.files else "gradients",
            )
        )
        if self._spec is None:
            return
        spec = self._spec
        if (nonfinite or nonfinite_step is not None) and self._first_nonfinite is None:
            order = {name: i for i, name in enumerate(model_order(t.name for t in nonfinite))}
            nonfinite.sort(key=lambda t: order[t.name])
            self._first_nonfinite = (
                index,
                nonfinite_step,
                path,
                tuple(
                    NonFiniteTensor(t.name, spec.key(t.name), t.nan, t.pos_inf, t.neg_inf)
                    for t in nonfinite
                ),
            )
        for layer in group_layers(report.tensors, (), spec):
            state = self._layers.get(layer.name)
            if state is None:
                state = self._layers[layer.name] = _LayerState(
                    norms=[None] * index, max_abs=[None] * index, nonfinite=[0] * index
                )
            state.norms.append(layer.norm if layer.nonfinite < layer.numel else None)
            state.max_abs.append(layer.max_abs)
            state.nonfinite.append(layer.nonfinite)
            if layer.nonfinite:
                if state.first_nonfinite_step is None:
                    state.first_nonfinite_step = step
                continue
            self._judge(state, index, step, layer.norm)
        for state in self._layers.values():
            if len(state.norms) <= index:  # absent from this dump
                state.norms.append(None)
                state.max_abs.append(None)
                state.nonfinite.append(0)

    def _judge(self, state: _LayerState, index: int, step: int, norm: float) -> None:
        """Spike and collapse bookkeeping for one finite step of one layer."""
        policy = self.policy
        if len(state.history) >= MIN_SPIKE_HISTORY:
            median = _median(state.history)
            if median > 0 and median >= policy.vanishing and norm > policy.spike_factor * median:
                state.spikes.append(Spike(step, norm, median))
        bisect.insort(state.history, norm)
        if norm < policy.vanishing:
            if state.below_since is None:
                state.below_since = index
                state.below_steps = 0
            state.below_steps += 1
        else:
            state.was_above = True
            state.below_since = None
            state.below_steps = 0

    def finish(self, elapsed_s: float = 0.0) -> TrendReport:
        names = model_order(self._layers)
        layers: list[LayerTrend] = []
        findings: list[TrendFinding] = []
        policy = self.policy
        if self._first_nonfinite is not None:
            index, earlier, path, tensors = self._first_nonfinite
            dumped = self._steps[index].step
            at = dumped if earlier is None else earlier
            if tensors:
                first = tensors[0]
                more = f" and {len(tensors) - 1} more tensors" if len(tensors) > 1 else ""
                what, layer = f"{first.name} ({first.counts()}){more}", first.layer
            else:
                what, layer = "this dump's gradients are finite", ""
            seen = (
                ""
                if earlier is None
                else f" (seen by the monitor's stats; the dump holds step {dumped}'s gradients)"
            )
            findings.append(
                TrendFinding(
                    TrendKind.NONFINITE,
                    policy.severity(TrendKind.NONFINITE),
                    layer,
                    at,
                    path,
                    f"first NaN/Inf at step {at}{seen}: {what}",
                    tensors,
                )
            )
        for name in names:
            state = self._layers[name]
            collapse = None
            if (
                state.below_since is not None
                and state.was_above
                and state.below_steps >= MIN_COLLAPSE_STEPS
            ):
                collapse = self._steps[state.below_since].step
            layers.append(
                LayerTrend(
                    name=name,
                    norms=tuple(state.norms),
                    max_abs=tuple(state.max_abs),
                    nonfinite=tuple(state.nonfinite),
                    spikes=tuple(state.spikes),
                    first_nonfinite_step=state.first_nonfinite_step,
                    collapse_step=collapse,
                )
            )
            if state.spikes:
                spike = state.spikes[0]
                others = ""
                if len(state.spikes) > 1:
                    shown = ", ".join(str(s.step) for s in state.spikes[:6])
                    tail = ", …" if len(state.spikes) > 6 else ""
                    others = f" (spikes at {len(state.spikes)} steps: {shown}{tail})"
                findings.append(
                    TrendFinding(
                        TrendKind.SPIKE,
                        policy.severity(TrendKind.SPIKE),
                        name,
                        spike.step,
                        self._path_of(spike.step),
                        f"norm {spike.norm:.3g} at step {spike.step} is {spike.ratio:.3g}× "
                        f"its running median {spike.median:.3g}{others}",
                    )
                )
            if collapse is not None:
                index = state.below_since or 0
                findings.append(
                    TrendFinding(
                        TrendKind.COLLAPSE,
                        policy.severity(TrendKind.COLLAPSE),
                        name,
                        collapse,
                        self._steps[index].path,
                        f"norm fell below the vanishing threshold {policy.vanishing:.3g} at "
                        f"step {collapse} ({state.norms[index] or 0.0:.3g}) and stayed below "
                        f"for the last {state.below_steps} steps",
                    )
                )
        findings.sort(key=lambda f: (list(TrendKind).index(f.kind), f.step))
        return TrendReport(
            steps=tuple(self._steps),
            layers=tuple(layers),
            findings=tuple(findings),
            errors=tuple(self._errors),
            policy=policy,
            group_by=self._spec or self._requested,
            device=",".join(self._devices) or "none",
            engine=self._engine,
            elapsed_s=elapsed_s,
        )

    def _path_of(self, step: int) -> str:
        return next(s.path for s in self._steps if s.step == step)


def trend_paths(
    paths: Sequence[str | Path],
    *,
    policy: TrendPolicy | None = None,
    group_by: GroupBy | None = None,
    device: str | None = "auto",
    engine: Engine | str = Engine.AUTO,
    chunk_elements: int | None = None,
    kind: InputKind = InputKind.AUTO,
    precision: Precision | None = None,
    recursive: bool = False,
) -> TrendReport:
    """Order the dumps by step, then audit them one at a time into a :class:`TrendReport`.

    Directories are searched as ``scan`` searches them (:func:`~gradaudit.trend.dumps.dump_files`;
    ``recursive`` descends into subdirectories).
    ``kind`` says what the dumps hold (``--kind``); dumps read as weights and as
    gradients in one series are a :class:`UsageError`. ``precision`` also collects
    exponent histograms and keeps each step's headroom in that format
    (:mod:`gradaudit.precision`).
    """

    started = time.perf_counter()
    options = EngineOptions(device, chunk_elements, engine)

    def scan_dump(path: str, thresholds: Thresholds) -> Report:
        # torch (~1.2 s): only once there is work to do, and only on this path.
        from gradaudit.scan.paths import scan_paths  # torch: see above

        return scan_paths(
            [path], thresholds=thresholds, options=options, histograms=precision is not None
        )

    dumps, problems = order_dumps(paths, recursive=recursive)
    return _trend(dumps, problems, scan_dump, policy, group_by, kind, precision, started)


def trend_paths_torch_free(
    paths: Sequence[str | Path],
    *,
    policy: TrendPolicy | None = None,
    group_by: GroupBy | None = None,
    kind: InputKind = InputKind.AUTO,
    precision: Precision | None = None,
    recursive: bool = False,
) -> TrendReport:
    """:func:`trend_paths` without torch, on the CPU with the native kernel (``precision``'s
    histograms counted in the same read as the rows); the caller checks
    :func:`gradaudit.scan.torch_free.applies` first.

    The dumps are read by the torch-free scan (:func:`~gradaudit.scan.torch_free.scan_torch_free`);
    ordering, the builder and the report are :func:`trend_paths`'. Raises
    :class:`~gradaudit.scan.torch_free.NeedsTorch` when an input is not what the torch-free
    scan takes (:func:`~gradaudit.scan.torch_free.takes`) or is a sharded index (its
    reader checks the index while the dumps are ordered), or holds a dtype only torch
    reports as it should, or is a ``torch.save`` file the torch-free reader declines
    (:mod:`gradaudit.io.zip_checkpoint`).
    """
    started = time.perf_counter()
    entries = list(expand_inputs(paths, recursive=recursive))
    indexes = any(isinstance(e, FileInput) and input_kind(e.path) == "index" for e in entries)
    if indexes or not torch_free.takes(entries):
        raise torch_free.NeedsTorch(paths)

    def scan_dump(path: str, thresholds: Thresholds) -> Report:
        return torch_free.scan_torch_free(
            [FileInput(path)], thresholds=thresholds, histograms=precision is not None
        )

    dumps, problems = order_dumps(paths, recursive=recursive, metadata_of=mapped_metadata)
    return _trend(dumps, problems, scan_dump, policy, group_by, kind, precision, started)


def _trend(
    dumps: list[Dump],
    problems: list[InputProblem],
    scan_dump: Callable[[str, Thresholds], Report],
    policy: TrendPolicy | None,
    group_by: GroupBy | None,
    kind: InputKind,
    precision: Precision | None,
    started: float,
) -> TrendReport:
    """Audit the ordered dumps one at a time (``scan_dump``: one path's report) into a
    :class:`TrendReport`: the one trend of both paths."""
    policy = policy or TrendPolicy()
    builder = TrendBuilder(policy, group_by)
    for problem in problems:
        builder.add_error(problem)
    # Findings of the per-dump audit are not used; the thresholds only have to be valid.
    thresholds = Thresholds(
        vanishing=policy.vanishing, exploding=math.inf, fail_on=frozenset(), kind=kind
    )
    first: FileResult | None = None
    headroom: list[tuple[int, Headroom]] = []
    for dump in dumps:
        report = scan_dump(dump.path, thresholds)
        if report.errors:
            for problem in report.errors:
                builder.add_error(problem)
            continue
        first = _check_same_reading(first, report)
        builder.add(dump.step, dump.path, report, nonfinite_step=dump.nonfinite_step)
        if precision is not None and report.tensors:
            headroom.append((dump.step, precision_report(report, precision).total))
    result = builder.finish(time.perf_counter() - started)
    return dataclasses.replace(result, headroom=tuple(headroom)) if headroom else result


def _check_same_reading(first: FileResult | None, report: Report) -> FileResult | None:
    """A series is one kind of file: norms of weights and of gradients do not make one trend.

    Returns the reading later dumps are held to (the first one with tensors).
    """
    if not report.files or not report.tensors:
        return first
    here = report.files[0]
    if here.read_as not in ("weights", "gradients"):
        # A Trainer checkpoint holds weights and Adam moments: one norm per layer over both
        # would be neither, and "gradient norm" of it a wrong name.
        raise UsageError(
            f"{here.path} was read as {here.read_as} ({here.read_as_evidence}): a trend "
            "follows one kind of tensor per layer; trend its model files for weights (e.g. "
            "checkpoint-*/model.safetensors) or gradient dumps"
        )
    if first is None:
        return here
    if first.read_as != here.read_as:
        raise UsageError(
            f"{here.path} was read as {here.read_as} ({here.read_as_evidence}) but "
            f"{first.path} as {first.read_as} ({first.read_as_evidence}): a trend is over "
            "one kind of file; say what they hold with --kind"
        )
    return first
