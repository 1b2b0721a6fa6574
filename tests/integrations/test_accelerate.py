"""The Accelerate helper, with a real ``Accelerator`` on the CPU.

The reference for each collected step is a float64 norm of the accumulated gradients,
taken by the loop itself right before the helper runs. The fp16 (GradScaler) case needs
CUDA: Accelerate runs fp16 without a scaler on the CPU.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from gradaudit import GradientMonitor, NonFiniteGradientWarning
from tests.conftest import requires_cuda

#: Slow (not in the quick loop): trains tiny models under the real Accelerator.
pytestmark = pytest.mark.slow


def _loop(accelerator: Any, *, batches: int, nan_at: int | None = None, device: str = "cpu") -> Any:
    from gradaudit.integrations.accelerate import accelerate_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None, on_nonfinite="warn")
    gen = torch.Generator().manual_seed(1)
    seen: list[float] = []
    for index in range(batches):
        x = torch.randn(6, 4, generator=gen).to(device)
        with accelerator.accumulate(model):
            loss = model(x).float().pow(2).mean()
            if index == nan_at:
                loss = loss * math.nan
            accelerator.backward(loss)
            scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else 1.0
            if accelerator.sync_gradients:
                seen.append(
                    math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
                    / scale
                )
            accelerate_step(accelerator, monitor, optimizer)
            optimizer.step()
            optimizer.zero_grad()
    return monitor, seen


def test_collects_once_per_accumulation_window_on_the_accumulated_gradients() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    monitor, seen = _loop(accelerator, batches=9)
    assert [r.step for r in monitor.history] == [0, 1, 2]
    assert [r.global_norm for r in monitor.history] == pytest.approx(seen, rel=1e-6)


def test_a_nan_in_one_micro_batch_is_reported_for_its_optimizer_step() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    with pytest.warns(NonFiniteGradientWarning, match=r"^step 1: NaN/Inf gradients in 4 tensors"):
        monitor, _ = _loop(accelerator, batches=4, nan_at=2)
    assert [bool(r.nonfinite) for r in monitor.history] == [False, True]


@pytest.mark.cuda
@requires_cuda
def test_fp16_gradients_are_unscaled_before_the_stats() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # Accelerate keeps one process-wide state: an earlier test's Accelerator(cpu=True)
    # made Accelerator(mixed_precision="fp16") raise on an H200 (docs/gpu.md). Its own
    # tests reset it the same way.
    AcceleratorState._reset_state(reset_partial_state=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator = Accelerator(mixed_precision="fp16")
    assert accelerator.scaler is not None
    monitor, seen = _loop(accelerator, batches=3, device="cuda")
    assert [r.global_norm for r in monitor.history] == pytest.approx(seen, rel=1e-3)


def test_it_steps_the_monitor_on_every_synchronised_step_and_never_the_optimizer() -> None:
    """What ``accelerate_step`` is documented to do, with a real Accelerator: without
    accumulation every call is a monitor step (numbered 0, 1, 2 …) returning that step's
    record (``sync=True``); the parameters move only when the caller steps the optimizer."""
    from accelerate import Accelerator

    from gradaudit.integrations.accelerate import accelerate_step

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None)
    before = [p.detach().clone() for p in model.parameters()]
    returned = []
    for _ in range(3):
        accelerator.backward(model(torch.randn(6, 4)).pow(2).mean())
        returned.append(accelerate_step(accelerator, monitor, optimizer))
    assert [r.step if r is not None else None for r in returned] == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _Accelerator:
    """The attributes accelerate_step reads, for the cases a single CPU cannot launch."""

    def __init__(self, processes: int, kind: str) -> None:
        self.num_processes = processes
        self.distributed_type = kind
        self.sync_gradients = True

    def unscale_gradients(self, optimizer: Any = None) -> None:
        pass


@pytest.mark.parametrize(
    ("processes", "kind", "told"),
    [(1, "NO", 0), (2, "MULTI_CPU", 1), (2, "MULTI_GPU", 1), (2, "FSDP", 0), (2, "DEEPSPEED", 0)],
)
def test_a_monitor_that_cannot_check_replicas_under_ddp_says_so_once(
    processes: int, kind: str, told: int
) -> None:
    """Under DDP a monitor over the unprepared model is told, once (the real 2-rank runs are
    in tests/integrations/test_ddp.py); a single process or a sharded strategy is not."""
    from gradaudit.integrations.accelerate import accelerate_step

    model = torch.nn.Linear(2, 1)
    model.weight.grad = torch.ones(1, 2)
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None)
    accelerator = _Accelerator(processes, kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            accelerate_step(accelerator, monitor)
    messages = [str(w.message) for w in caught if "across ranks" in str(w.message)]
    assert len(messages) == told
    assert all("build it over the prepared model" in m for m in messages)
