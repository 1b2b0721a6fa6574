"""The planned Triton flush of a training loop's list of tensors (``gradaudit.engine.triton_plan``).

Through Triton's interpreter on CPU tensors, routed as ``TRITON_INTERPRET=1`` routes them
(``engine="triton"``), as ``test_triton_kernel.py`` runs the kernels: the planned path gives
the rows the per-tensor path gives, and both match the float64 reference, step after step,
including the steps where the list changes and the plan must be made again.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
import torch

from gradaudit.engine import native, torch_shim, triton_kernel, triton_plan
from gradaudit.engine.stats import StatsCollector
from gradaudit.results import TensorStats
from gradaudit.scan.pending import PendingStats
from tests.engine.interpreted import DEVICE, MARKS  # the interpreter, before a kernel is built
from tests.engine.test_stats import assert_matches_reference

pytestmark = MARKS


@pytest.fixture(autouse=True, params=["the C shim", "the binding in C", "a pass per fact"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each step's facts and addresses read all three ways: through torch's C shim, through
    torch's binding in one pass of the native extension (where the shim is not bound), and
    one ``map`` per fact (where the extension is not built)."""
    if request.param == "the C shim":
        if not torch_shim.bound():
            pytest.skip("torch's C shim is not bound with this torch (test_torch_shim.py)")
        return str(request.param)
    monkeypatch.setattr(triton_plan.torch_shim, "bound", lambda: False)
    if request.param == "a pass per fact":
        monkeypatch.setattr(triton_plan.native, "available", lambda: False)
    elif not native.available():
        pytest.skip("the native extension is not built")
    return str(request.param)


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every plan made while the test runs, in order, then ``"launch"`` for each planned
    flush launched."""
    made: list[Any] = []
    real_init = triton_plan.TritonPlan.__init__
    real_launch = triton_plan.TritonPlan.launch

    def init(self: triton_plan.TritonPlan, *args: Any) -> None:
        real_init(self, *args)
        made.append(self)

    def launch(self: triton_plan.TritonPlan, *args: Any) -> torch.Tensor:
        made.append("launch")
        return real_launch(self, *args)

    monkeypatch.setattr(triton_plan.TritonPlan, "__init__", init)
    monkeypatch.setattr(triton_plan.TritonPlan, "launch", launch)
    return made


def gradients(seed: int, *, bf16: bool = True) -> dict[str, torch.Tensor]:
    """A model's worth of gradients: lengths around the kernel's steps and spans, three
    dtypes interleaved, NaN, ±Inf and zeros planted."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5000, 3, 70_000, 1025, 16_384, 2049]
    tensors = {f"layer{i}.weight": torch.randn(n, generator=gen) for i, n in enumerate(lengths)}
    tensors["layer1.weight"][1] = math.nan
    tensors["layer2.weight"][69_999] = -math.inf
    tensors["layer3.weight"][:100] = 0.0
    tensors["norm.weight"] = (torch.randn(64, 3, generator=gen) * 3e4).to(torch.float16)
    if bf16:
        tensors["embed.weight"] = torch.randn(33, 31, generator=gen).to(torch.bfloat16)
        tensors["embed.weight"][5, 7] = math.inf
    tensors["head.bias"] = torch.randn(10, generator=gen).to(torch.float16)
    return {name: tensor.to(DEVICE) for name, tensor in tensors.items()}


def planned(collector: StatsCollector, tensors: dict[str, torch.Tensor]) -> list[TensorStats]:
    """A training loop's step: the columns through ``add_tensors`` (the monitor's way)."""
    pending = PendingStats(collector=collector.fresh())
    pending.add_tensors(list(tensors), list(tensors.values()))
    return list(pending.materialize().tensors)


def per_tensor(tensors: dict[str, torch.Tensor]) -> list[TensorStats]:
    pending = PendingStats(engine="triton")
    for name, tensor in tensors.items():
        pending.queue(name, tensor)
    pending.settle()
    return list(pending.materialize().tensors)


def check(
    collector: StatsCollector,
    tensors: dict[str, torch.Tensor],
    plans: list[Any],
    made: int,
    *,
    took: bool = True,
) -> None:
    """The planned step's report is the per-tensor path's and matches float64; it made
    ``made`` new plans, and the planned flush ran (``took``) or the list went the
    per-tensor way."""
    before = len(plans)
    got = planned(collector, tensors)
    assert got == per_tensor(tensors)
    assert [stats.name for stats in got] == list(tensors)
    for stats, tensor in zip(got, tensors.values(), strict=True):
        assert stats.shape == tuple(tensor.shape)
        assert_matches_reference(tensor.cpu(), stats)
    new = plans[before:]
    assert len([each for each in new if each != "launch"]) == made
    assert new.count("launch") == int(took)


def start(collector: StatsCollector, plans: list[Any], reader: str) -> None:
    """A collector's first two lists, of the same facts. Through torch's C shim the first
    is planned (planning costs less than the per-tensor flush) and the second takes the
    plan; through the binding the first goes the per-tensor way (planning costs more, and
    a one-off audit never comes back to a plan) and the second is planned."""
    shim = reader == "the C shim"
    check(collector, gradients(0), plans, made=int(shim), took=shim)
    check(collector, gradients(7), plans, made=int(not shim))


def test_a_fixed_list_is_planned_once_and_matches_the_per_tensor_path(
    plans: list[Any], reader: str
) -> None:
    collector = StatsCollector(engine="triton")
    start(collector, plans, reader)
    # The next steps: new tensors (new addresses), the same facts: the plan is reused.
    check(collector, gradients(1), plans, made=0)
    check(collector, gradients(2), plans, made=0)
    assert collector._ran == {}  # fresh() collectors ran the kernels, the base kept none
    assert len(collector._routes.plans) == 1


def test_the_plan_is_made_again_when_the_list_changes(plans: list[Any], reader: str) -> None:
    collector = StatsCollector(engine="triton")
    start(collector, plans, reader)
    # A parameter added.
    added = {**gradients(1), "extra.weight": torch.randn(300).to(DEVICE)}
    check(collector, added, plans, made=1)
    # A gradient None on this step (left out of the columns, as GradientLister does).
    missing = gradients(2)
    del missing["layer2.weight"]
    check(collector, missing, plans, made=1)
    # A dtype changed under the same names (``model.to(torch.bfloat16)``).
    changed = gradients(3)
    changed["layer0.weight"] = changed["layer0.weight"].to(torch.bfloat16)
    check(collector, changed, plans, made=1)
    # The same element count in another shape: the report's shape is the new one.
    reshaped = gradients(4)
    reshaped["norm.weight"] = reshaped["norm.weight"].reshape(3, 64)
    check(collector, reshaped, plans, made=1)
    # Back to the first list's facts.
    check(collector, gradients(5), plans, made=1)
    check(collector, gradients(6), plans, made=0)


def test_views_at_odd_offsets_are_read_right_or_go_the_per_tensor_way(
    plans: list[Any], reader: str
) -> None:
    collector = StatsCollector(engine="triton")
    start(collector, plans, reader)
    # A view 3 elements into a buffer, not its group's first tensor: addressed from the
    # group's base at an element offset, its head taken by the kernel's masked head.
    views = gradients(1)
    buffer = torch.randn(16_387).to(DEVICE)
    views["layer4.weight"] = buffer[3:]
    check(collector, views, plans, made=0)
    # The group's first tensor 4 bytes past a 16-byte boundary: the table cannot count from
    # it, so this step goes the per-tensor way (same results); the plan stays.
    first = gradients(2)
    first["layer0.weight"] = torch.randn(5001).to(DEVICE)[1:]
    assert first["layer0.weight"].data_ptr() % triton_kernel.VECTOR_BYTES
    check(collector, first, plans, made=0, took=False)
    # A half-precision view at an odd element offset (2 bytes) from its group's base.
    halves = gradients(3)
    halves["head.bias"] = torch.randn(11).to(torch.float16).to(DEVICE)[1:]
    check(collector, halves, plans, made=0)
    check(collector, gradients(4), plans, made=0)


def test_lists_the_plan_does_not_take_go_the_per_tensor_way(plans: list[Any], reader: str) -> None:
    shim = reader == "the C shim"
    collector = StatsCollector(engine="triton")
    # Through the shim the first list is planned, and the plan stays through the lists it
    # does not take; through the binding the first goes the per-tensor way.
    check(collector, gradients(7), plans, made=int(shim), took=shim)
    strided = gradients(0)
    strided["layer0.weight"] = torch.randn(50, 100).to(DEVICE).t()
    check(collector, strided, plans, made=0, took=False)
    double = gradients(1)
    double["layer3.weight"] = double["layer3.weight"].double()
    check(collector, double, plans, made=0, took=False)
    empty = gradients(2)
    empty["head.bias"] = torch.empty(0, dtype=torch.float16, device=DEVICE)
    check(collector, empty, plans, made=0, took=False)
    check(collector, gradients(3), plans, made=int(not shim))
    # A subclass (a DTensor, a wrapper) with every other fact of the plan: its type is
    # checked with those facts, and the list goes the per-tensor way; the plan stays.
    wrapped = gradients(4)
    wrapped["layer1.weight"] = wrapped["layer1.weight"].as_subclass(_Wrapped)
    check(collector, wrapped, plans, made=0, took=False)
    check(collector, gradients(5), plans, made=0)


class _Wrapped(torch.Tensor):
    """A tensor subclass that changes nothing but its type."""


def test_tensors_dropped_right_after_queuing_are_read_correctly() -> None:
    """The caller lets go of its gradients at once (``zero_grad(set_to_none=True)``): the
    rows are still theirs. (On the CPU the interpreter has read them by then; on a GPU the
    default stream's order or a held list keeps their memory: ``tests/engine/test_cuda.py``.)"""
    collector = StatsCollector(engine="triton")
    planned(collector, gradients(7))  # the first list (planned through the C shim only)
    tensors = gradients(0)
    # The reference values, copied before the originals go.
    expected = [(tensor.cpu().clone(), name) for name, tensor in tensors.items()]
    pending = PendingStats(collector=collector.fresh())
    pending.add_tensors(list(tensors), list(tensors.values()))
    del tensors
    gc.collect()
    # Memory that the freed tensors had, filled with NaN.
    junk = [torch.full((70_000,), math.nan, device=DEVICE) for _ in range(8)]
    got = pending.materialize().tensors
    assert all(bool(each.isnan().all()) for each in junk)
    for stats, (values, name) in zip(got, expected, strict=True):
        assert stats.name == name
        assert_matches_reference(values, stats)


class _Event:
    """A CUDA event stand-in: done when the test says so."""

    def __init__(self) -> None:
        self.done = False
        self.recorded_on: object = None

    def record(self, stream: object) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.done


def test_a_list_is_held_off_the_default_stream_until_its_kernels_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lifetime rule of the planned path, on a pretend CUDA device: nothing is held on
    the default stream (stream order protects the memory), a side stream's list is held
    until the event after its kernels has completed."""
    events: list[_Event] = []

    def new_event() -> _Event:
        events.append(_Event())
        return events[-1]

    streams = {"current": "default"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams["current"])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: "default")
    monkeypatch.setattr(torch.cuda, "Event", new_event)
    monkeypatch.setattr(triton_plan, "_held", [])
    cuda = torch.device("cuda", 0)
    triton_plan.hold(torch.device("cpu"), ["cpu tensors"])
    triton_plan.hold(cuda, ["on the default stream"])
    assert triton_plan.held() == 0
    assert not events
    streams["current"] = "side"
    first, second = ["step 1"], ["step 2"]
    triton_plan.hold(cuda, first)
    triton_plan.hold(cuda, second)
    assert [event.recorded_on for event in events] == ["side", "side"]
    triton_plan.release_finished()
    assert triton_plan.held() == 2
    events[0].done = True
    triton_plan.release_finished()
    assert [held for _, held in triton_plan._held] == [second]
    events[1].done = True
    triton_plan.release_finished()
    assert triton_plan.held() == 0
