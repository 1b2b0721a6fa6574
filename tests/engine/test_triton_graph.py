"""A planned flush replayed from one captured CUDA graph (``gradaudit.engine.triton_graph``).

On a GPU (the GPU check's ``tests-kernel`` step) the flush is captured for real. On the
CPU the kernels run through Triton's interpreter and a stand-in records what a capture
holds (the table copied from a fixed pinned buffer into a fixed device buffer, the kernels
on it writing one fixed rows buffer) and runs it again on each replay. What decides when
a plan captures, when a step may replay and which buffers are rewritten when is the same
code either way; every step's report is checked against the per-tensor path and float64.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit.engine import triton_graph, triton_plan
from gradaudit.engine.stats import StatsCollector
from gradaudit.results import TensorStats
from gradaudit.scan.pending import PendingStats
from tests.engine.interpreted import DEVICE, MARKS  # the interpreter, before a kernel is built
from tests.engine.test_stats import assert_matches_reference
from tests.engine.test_triton_plan import gradients, per_tensor

pytestmark = MARKS


class _Done:
    """The stand-in's event: every replay has run (the interpreter ran it at once)."""

    def query(self) -> bool:
        return True

    def record(self, stream: Any) -> None:
        pass


class _NotYet(_Done):
    """An event whose replay has not run yet."""

    def query(self) -> bool:
        return False


def recorded_capture(
    device: torch.device, bases: tuple[int, ...], host: torch.Tensor, kernels: Any
) -> triton_graph.Captured:
    """What a CUDA graph of the flush holds, for the CPU: fixed buffers, and the kernels
    on them run again on each replay (into the same rows buffer)."""
    pinned = host.clone()
    flat = torch.empty_like(host)
    out = kernels(flat.copy_(pinned)).clone()

    class Graph:
        def replay(self) -> None:
            flat.copy_(pinned)
            out.copy_(kernels(flat))

    return triton_graph.Captured(bases, None, pinned, flat, out, Graph(), _Done())


@pytest.fixture(autouse=True)
def graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays on (whatever the environment says); on the CPU, through the stand-in."""
    monkeypatch.setattr(triton_graph, "ENABLED", True)
    # Captures this test retires stay its own (a stand-in's replay may never "finish").
    monkeypatch.setattr(triton_graph, "_retired", [])
    if DEVICE.type != "cuda":
        monkeypatch.setattr(triton_graph, "DEVICE_TYPES", frozenset({"cuda", DEVICE.type}))
        monkeypatch.setattr(triton_graph, "capture", recorded_capture)


def step(collector: StatsCollector, tensors: dict[str, torch.Tensor]) -> PendingStats:
    """A training loop's step, queued (the monitor's ``add_tensors``), not yet read."""
    pending = PendingStats(collector=collector.fresh())
    pending.add_tensors(list(tensors), list(tensors.values()))
    return pending


def read(pending: PendingStats) -> list[TensorStats]:
    return list(pending.materialize().tensors)


def check(got: list[TensorStats], tensors: dict[str, torch.Tensor]) -> None:
    """The step's report is the per-tensor path's and matches float64."""
    assert got == per_tensor(tensors)
    for stats, tensor in zip(got, tensors.values(), strict=True):
        assert_matches_reference(tensor.cpu(), stats)


def rewrite(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """New values in the same memory: a loop whose gradients come back to the same blocks."""
    for tensor, new in zip(tensors.values(), gradients(seed).values(), strict=True):
        tensor.copy_(new)


def replays(collector: StatsCollector) -> triton_graph.Replays:
    (plan,) = collector._routes.plans.values()  # keyed by the tensors' device (cuda:0)
    assert isinstance(plan, triton_plan.TritonPlan)
    return plan.replays


def loop(steps: int) -> triton_graph.Replays:
    """A loop of ``steps`` steps at the same places, new values each (each report checked):
    its plan's replays."""
    collector = StatsCollector(engine="triton")
    tensors = gradients(0)
    for seed in range(steps):
        rewrite(tensors, seed)
        check(read(step(collector, tensors)), tensors)
    return replays(collector)


def steady(collector: StatsCollector, tensors: dict[str, torch.Tensor]) -> None:
    """Steps at the same places until the flush is captured (each step's report checked)."""
    for seed in range(10, 20):
        rewrite(tensors, seed)
        check(read(step(collector, tensors)), tensors)
        plan = collector._routes.plans.get(next(iter(tensors.values())).device)
        if plan is not None and plan.replays.captured is not None:
            return
    raise AssertionError("a steady loop's flush was never captured")


def test_a_steady_loop_replays_its_flush_with_each_steps_values() -> None:
    collector = StatsCollector(engine="triton")
    tensors = gradients(0)
    steady(collector, tensors)
    graphs = replays(collector)
    assert (graphs.captures, graphs.replays) == (1, 0)
    for seed in range(4):  # NaN, ±Inf and zeros planted in places that differ each time
        rewrite(tensors, seed)
        check(read(step(collector, tensors)), tensors)
    assert (graphs.captures, graphs.replays) == (1, 4)


def test_a_steps_rows_read_after_the_next_replay_are_its_own() -> None:
    """A monitor may read a step's rows after the next step has queued its flush: the graph
    writes the same buffer every replay, so each replay's rows are handed out as a copy."""
    collector = StatsCollector(engine="triton")
    tensors = gradients(0)
    steady(collector, tensors)
    rewrite(tensors, 1)
    first = step(collector, tensors)
    before = {name: tensor.clone() for name, tensor in tensors.items()}
    rewrite(tensors, 2)
    second = step(collector, tensors)
    assert replays(collector).replays == 2
    check(read(first), before)
    check(read(second), tensors)


def test_gradients_that_move_launch_and_a_new_place_is_captured_in_turn() -> None:
    collector = StatsCollector(engine="triton")
    here = gradients(0)
    steady(collector, here)
    graphs = replays(collector)
    there = {name: tensor.clone() for name, tensor in here.items()}  # other addresses
    check(read(step(collector, there)), there)
    assert (graphs.captures, graphs.replays) == (1, 0)  # launched: the bases differ
    check(read(step(collector, there)), there)  # held twice: captured there
    assert graphs.captures == 2
    rewrite(there, 3)
    check(read(step(collector, there)), there)
    assert graphs.replays == 1
    # A loop whose gradients alternate between places captures at most MAX_CAPTURES times.
    for _ in range(4):
        for tensors in (here, there, there, here, here):
            check(read(step(collector, tensors)), tensors)
    assert graphs.captures == triton_graph.MAX_CAPTURES


def test_a_replay_whose_table_is_still_being_copied_launches_instead() -> None:
    """The pinned table is rewritten for a replay only once the last replay's copy has run;
    the step never waits for it: it launches as before."""
    collector = StatsCollector(engine="triton")
    tensors = gradients(0)
    steady(collector, tensors)
    graphs = replays(collector)
    assert graphs.captured is not None
    kept = graphs.captured.pinned.clone()
    graphs.captured = dataclasses.replace(graphs.captured, event=_NotYet())
    for seed in (5, 6, 7):
        rewrite(tensors, seed)
        check(read(step(collector, tensors)), tensors)
    assert graphs.replays == 0
    assert torch.equal(graphs.captured.pinned, kept)  # not rewritten under the copy
    # Launched at the captured places: nothing to capture again.
    assert graphs.captures == 1


def test_a_capture_dropped_while_its_replay_runs_is_kept_until_it_has() -> None:
    """A plan dropped (a list with other facts) while its last replay may still run keeps
    its capture (pinned table, buffers, the graph's pool) until that replay has run: let
    go at the next planned flush's or read's release, never waited for."""
    collector = StatsCollector(engine="triton")
    tensors = gradients(0)
    steady(collector, tensors)
    graphs = replays(collector)
    running = _NotYet()
    assert graphs.captured is not None
    graphs.captured = dataclasses.replace(graphs.captured, event=running)
    collector._routes.plans.clear()
    del graphs
    gc.collect()
    assert triton_graph.retired() == 1
    running.query = lambda: True  # type: ignore[method-assign]
    triton_plan.release_finished()
    assert triton_graph.retired() == 0


def test_a_capture_that_fails_leaves_the_plan_launching(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args: Any) -> triton_graph.Captured:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(triton_graph, "capture", failing)
    graphs = loop(6)
    assert (graphs.enabled, graphs.captures, graphs.replays) == (False, 1, 0)


def test_replays_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_graph, "ENABLED", False)
    graphs = loop(5)
    assert (graphs.captures, graphs.replays) == (0, 0)


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("0", False), ("1", True)])
def test_the_environment_variable_is_read_at_import(value: str | None, enabled: bool) -> None:
    env = {key: val for key, val in os.environ.items() if key != triton_graph.ENVIRONMENT}
    if value is not None:
        env[triton_graph.ENVIRONMENT] = value
    code = "from gradaudit.engine import triton_graph; print(triton_graph.ENABLED)"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == str(enabled)
