"""Where a NaN/Inf came from, in every way of locating it: the batch, a weight, an op in
forward (log of a negative, 0/0), an op only in backward (sqrt at 0).

Each case is a real tiny model (attention with LayerNorm, or an MLP) trained with a real
optimizer; each mode is a way a user locates: the locator by hand (with and without
backward hooks), and a monitor with ``locate="always"`` or ``locate="on_nonfinite"``, which
(with ``sync=True``) replays the NaN step on its own batch before ``optimizer.step()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.training.locate import NanLocator
from tests.ranks import single_rank_group


class Log(nn.Module):
    """``log`` once switched on (``spoil``), the identity before: the healthy steps stay so."""

    def __init__(self, on: bool = True) -> None:
        super().__init__()
        self.on = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) if self.on else x  # log of a negative: NaN


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)  # a zero row: 0/0


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)  # sqrt(0) = 0 is finite; its derivative is not


class Attention(nn.Module):
    """Input projection, LayerNorm, self-attention, an op, a feed-forward layer, a head."""

    def __init__(self, op: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.op = op or nn.Identity()
        self.ff = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x))
        a, _ = self.attn(h, h, h)
        return self.head(torch.relu(self.ff(self.op(a + h))))


def _mlp(*middle: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8, bias=False), *middle, nn.Linear(8, 2))


def _case(name: str) -> tuple[nn.Module, torch.Tensor, Callable[[], None]]:
    """The model, the bad step's batch, and what spoils the model right before that step."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    model: nn.Module

    def spoil() -> None:
        pass

    if name == "batch":
        model = Attention()
        x[0, 1, 3] = float("nan")
    elif name == "weight":
        model = Attention()

        def spoil() -> None:
            with torch.no_grad():
                model.ff.weight[0, 0] = float("nan")

    elif name == "log":
        log = Log(on=False)
        model = Attention(log)

        def spoil() -> None:
            log.on = True

    elif name == "0/0":
        model = _mlp(Normalize())
        x = torch.randn(4, 8)
        x[1] = 0.0
    else:  # "sqrt"
        model = _mlp(Square(), Sqrt())
        x = torch.randn(4, 8)
        x[1] = 0.0
    return model, x, spoil


#: case -> (cause, the module named, anything else the location must say)
EXPECTED: dict[str, tuple[str, str]] = {
    "batch": ("batch", "<model>"),
    "weight": ("weight", "ff"),
    "log": ("forward", "op"),
    "0/0": ("forward", "1"),
    "sqrt": ("backward", "2"),
}


def _by_hand(
    model: nn.Module, x: torch.Tensor, spoil: Callable[[], None], *, backward: bool
) -> gradaudit.Location:
    spoil()
    with NanLocator(model, backward=backward) as locator:
        model(x).sum().backward()
    return locator.read()


def _monitored(
    model: nn.Module,
    x: torch.Tensor,
    spoil: Callable[[], None],
    *,
    locate: str,
    on_nonfinite: str,
) -> gradaudit.Location:
    """Two healthy steps, then the bad one; the location of the bad step, as the monitor
    gives it (the error's, when it raises)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = gradaudit.GradientMonitor(
        model,
        every=1,
        sync=True,
        dump_dir=None,
        on_nonfinite=on_nonfinite,  # type: ignore[arg-type]
        on_finding="ignore",
        locate=locate,  # type: ignore[arg-type]
    )
    healthy = torch.randn_like(x)
    error: gradaudit.NonFiniteGradientError | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step, batch in enumerate((healthy, healthy, x)):
                if step == 2:
                    spoil()
                optimizer.zero_grad()
                model(batch).sum().backward()
                monitor.step()
                optimizer.step()
        except gradaudit.NonFiniteGradientError as raised:
            error = raised
    monitor.flush()
    found = [(step, loc) for step, loc in monitor.locations if loc.found]
    assert [step for step, _ in found] == [2], monitor.locations
    if on_nonfinite == "raise":
        assert error is not None
        assert error.step == 2
        assert error.location is found[0][1]
        assert "located: origin: " + found[0][1].origin() in str(error)
    else:
        assert error is None
        # One warning for the step, the location in it (not a second warning).
        nonfinite = [
            w for w in caught if issubclass(w.category, gradaudit.NonFiniteGradientWarning)
        ]
        assert len(nonfinite) == 1, [str(w.message) for w in nonfinite]
        assert "located: origin: " + found[0][1].origin() in str(nonfinite[0].message)
    return found[0][1]


Mode = Callable[[nn.Module, torch.Tensor, Callable[[], None]], gradaudit.Location]
MODES: dict[str, Mode] = {
    "locator": lambda m, x, s: _by_hand(m, x, s, backward=True),
    "locator, forward hooks only": lambda m, x, s: _by_hand(m, x, s, backward=False),
    "monitor always, warn": lambda m, x, s: _monitored(
        m, x, s, locate="always", on_nonfinite="warn"
    ),
    "monitor on_nonfinite, raise": lambda m, x, s: _monitored(
        m, x, s, locate="on_nonfinite", on_nonfinite="raise"
    ),
    "monitor on_nonfinite, dump": lambda m, x, s: _monitored(
        m, x, s, locate="on_nonfinite", on_nonfinite="dump"
    ),
}


def _module_of(location: gradaudit.Location) -> str | None:
    cause = location.cause
    if cause == "batch":
        return location.batch.module if location.batch else None
    if cause in ("weight", "forward"):
        return location.forward_origin.module if location.forward_origin else None
    if cause == "backward":
        return location.backward_origin.module if location.backward_origin else None
    return None


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_cause_is_named_in_each_mode(case: str, mode: str) -> None:
    model, x, spoil = _case(case)
    location = MODES[mode](model, x, spoil)
    cause, module = EXPECTED[case]
    assert location.found
    if case == "sqrt" and mode == "locator, forward hooks only":
        # No backward hooks: the forward pass was finite, so the origin is in backward,
        # and the location says so rather than blaming a module.
        assert location.cause is None
        assert location.origin().startswith("in the backward pass")
        assert "0.weight" in location.poisoned
        return
    assert (location.cause, _module_of(location)) == (cause, module), location.describe()
    if case == "batch":
        assert location.batch is not None
        assert [c.name for c in location.batch.inputs if c.nonfinite] == ["x"]
        assert location.origin().startswith("the batch: x (1 of 64 non-finite)")
        assert location.backward_origin is None or location.cause == "batch"
    if case == "weight":
        assert location.origin_weights == ("ff.weight",)
        assert location.origin().startswith("the weights: ff.weight already held NaN/Inf")
    if mode.startswith("monitor on_nonfinite"):
        assert location.replayed


def test_the_batch_is_not_blamed_on_a_layer_norm_backward() -> None:
    """The issue's case: a NaN in the input batch of a model with a LayerNorm."""
    model, x, spoil = _case("batch")
    location = _by_hand(model, x, spoil, backward=True)
    assert location.backward_origin is not None  # LayerNorm's backward does make one...
    assert location.describe().startswith("origin: the batch")  # ...but it is not the origin


class Keywords(nn.Module):
    """Called as Hugging Face models are: keyword arguments, a dict out with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(
        self, pixels: torch.Tensor, *, labels: torch.Tensor, extra: tuple[torch.Tensor, ...] = ()
    ) -> dict[str, torch.Tensor]:
        out = self.head(self.embed(pixels)).squeeze(-1)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def test_the_batch_is_named_by_argument_and_keyword() -> None:
    model = Keywords()
    labels = torch.randn(3)
    labels[1] = float("inf")
    extra = (torch.zeros(2), torch.full((2,), float("nan")))
    with NanLocator(model) as locator:
        model(torch.randn(3, 4), labels=labels, extra=extra)["loss"].backward()
    location = locator.read()
    assert location.cause == "batch"
    assert location.batch is not None
    bad = [(c.name, c.nonfinite) for c in location.batch.inputs if c.nonfinite]
    assert bad == [("labels", 1), ("extra[1]", 2)]


def test_replay_restores_the_random_state_buffers_and_gradients() -> None:
    """Dropout draws the same masks when replayed, BatchNorm's running stats and the
    parameters' gradients are as the step left them, and training goes on unchanged."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.5)
            self.log = Log()
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Dropout's zeros reach the log: -inf only where the mask dropped.
            return self.head(self.log(self.drop(self.bn(x).abs() + 1.0) * 1.0))

    torch.manual_seed(0)
    model = Net()
    monitor = gradaudit.GradientMonitor(
        model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore", locate="on_nonfinite"
    )
    model(torch.randn(16, 8)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    rng = torch.get_rng_state()
    monitor.step()
    ((_, location),) = monitor.locations
    assert location.replayed
    assert location.forward_origin is not None
    assert location.forward_origin.module == "log"
    assert torch.equal(model.bn.running_mean, stats[0])
    assert torch.equal(model.bn.num_batches_tracked, stats[1])
    assert torch.equal(torch.get_rng_state(), rng)
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=0, equal_nan=True)


def test_replay_draws_the_dropout_masks_of_the_step() -> None:
    torch.manual_seed(0)
    drop = nn.Dropout(0.5)
    model = nn.Sequential(nn.Linear(64, 64), drop, Log(), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(64))
        model[0].bias.fill_(1.0)
    monitor = gradaudit.GradientMonitor(
        model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore", locate="on_nonfinite"
    )
    seen: list[int] = []
    handle = drop.register_forward_hook(lambda m, a, out: seen.append(int((out == 0).sum())))
    model(torch.zeros(4, 64)).sum().backward()
    monitor.step()
    handle.remove()
    ((_, location),) = monitor.locations
    assert location.forward_origin is not None
    bad = location.forward_origin.first_bad_output
    assert bad is not None
    assert len(seen) == 2  # the step and its replay
    assert seen[0] == seen[1] == bad.nonfinite  # the same mask: as many -inf as zeros


def test_every_micro_batch_of_an_accumulated_step_is_replayed() -> None:
    model, x, _ = _case("0/0")
    healthy = torch.randn_like(x)
    monitor = gradaudit.GradientMonitor(
        model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore", locate="on_nonfinite"
    )
    for batch in (x, healthy, healthy):  # the NaN is in the first micro-batch
        model(batch).sum().backward()
    monitor.step()
    ((_, location),) = monitor.locations
    assert location.cause == "forward"
    assert location.forward_origin is not None
    assert location.forward_origin.module == "1"


def test_a_nan_that_does_not_reproduce_arms_the_next_steps() -> None:
    """A NaN put into a gradient by hand is not in the model: replay finds nothing, and
    ``on_nonfinite`` arms the locator for the steps after, as without sync."""
    model, x, _ = _case("0/0")
    healthy = torch.randn_like(x)
    monitor = gradaudit.GradientMonitor(
        model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore", locate="on_nonfinite"
    )
    model(healthy).sum().backward()
    model[2].bias.grad[0] = float("nan")  # type: ignore[index]
    monitor.step()
    assert monitor.locations == ()
    assert monitor._locator is not None
    assert monitor._locator.armed
    model.zero_grad()
    model(x).sum().backward()
    monitor.step()
    monitor.flush()
    assert [(step, loc.cause) for step, loc in monitor.locations if loc.found] == [(1, "forward")]


def test_without_sync_the_location_says_the_weights_were_already_spoiled() -> None:
    """Asynchronous stats arrive after ``optimizer.step()`` applied the NaN: the next step
    is located, and its cause is the spoiled weights, not the first module."""
    model, x, _ = _case("0/0")
    healthy = torch.randn_like(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = gradaudit.GradientMonitor(
        model,
        every=1,
        dump_dir=None,
        on_nonfinite="ignore",
        on_finding="ignore",
        locate="on_nonfinite",
    )
    for batch in (x, healthy, healthy):
        optimizer.zero_grad()
        model(batch).sum().backward()
        monitor.step()
        optimizer.step()
    monitor.flush()
    ((step, location),) = [(s, loc) for s, loc in monitor.locations if loc.found]
    assert step == 2
    assert location.cause == "weight"
    assert len(location.weights) > len(location.origin_weights)
    assert "the optimizer applied an earlier step's NaN/Inf gradient" in location.origin()


def test_a_replayed_ddp_model_runs_no_collective(tmp_path: Any) -> None:
    """Replay runs the module DDP wraps, so a rank replaying alone cannot hang; names carry
    no ``module.`` prefix."""
    with single_rank_group(tmp_path):
        inner, x, _ = _case("0/0")
        model = nn.parallel.DistributedDataParallel(inner)
        monitor = gradaudit.GradientMonitor(
            model, every=1, sync=True, dump_dir=None, on_nonfinite="raise", locate="on_nonfinite"
        )
        model(x).sum().backward()
        with pytest.raises(gradaudit.NonFiniteGradientError) as caught:
            monitor.step()
    assert caught.value.location is not None
    assert caught.value.location.forward_origin is not None
    assert caught.value.location.forward_origin.module == "1"
    assert all(not name.startswith("module.") for name in caught.value.tensors)
