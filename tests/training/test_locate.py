"""NanLocator on real failure mechanisms: the reported origin is where each one happens."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradaudit.training.locate import NanLocator
from tests.torch_features import requires_set_stance, requires_torch_2_6


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class MaskedSoftmax(nn.Module):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[0] = True  # the first query may attend to nothing
        return scores.masked_fill(mask, float("-inf")).softmax(dim=-1)


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def _net(middle: nn.Module, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), middle, nn.Linear(width, 2))


def _step(model: nn.Module, x: torch.Tensor) -> NanLocator:
    locator = NanLocator(model)
    with locator:
        model(x).sum().backward()
    return locator


def test_log_of_zero_is_located_at_the_log() -> None:
    model = _net(Log())
    x = torch.randn(4, 8)
    location = _step(model, x).read()
    assert location.forward is not None
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"
    assert not location.forward_origin.inputs_nonfinite
    assert location.forward.module == "2"  # nothing before it went non-finite
    assert location.poisoned  # the NaN reaches the parameter gradients
    assert "3.weight" in location.poisoned


def test_division_by_a_vanishing_norm() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), Normalize(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    x[1] = 0.0  # a zero row: its norm vanishes, 0/0
    location = _step(model, x).read()
    assert location.forward_origin is not None
    assert location.forward_origin.module == "1"
    bad = location.forward_origin.first_bad_output
    assert bad is not None
    assert bad.nonfinite == 8
    assert bad.numel == 32


def test_fp16_overflow_in_a_matmul_under_autocast() -> None:
    torch.manual_seed(0)
    big = nn.Linear(64, 64)
    with torch.no_grad():
        big.weight.fill_(4000.0)  # 64 inputs in (0, 1): sums > 65504
    model = nn.Sequential(nn.Linear(64, 64), nn.Sigmoid(), big, nn.Linear(64, 2))
    x = torch.randn(4, 64) * 4
    locator = NanLocator(model)
    with locator, torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert out.dtype == torch.float16  # the matmul really ran in half precision
    location = locator.read()
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"


def test_softmax_over_all_minus_inf() -> None:
    model = _net(MaskedSoftmax())
    location = _step(model, torch.randn(4, 8)).read()
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"
    bad = location.forward_origin.first_bad_output
    assert bad is not None
    assert bad.nonfinite == 8


def test_backward_origin_is_the_module_whose_gradient_blew_up() -> None:
    # sqrt(0) = 0 is finite forward; its derivative 1/(2*sqrt(0)) is not.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), Square(), Sqrt(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    x[1] = 0.0  # a zero row reaches the sqrt as exact zeros
    location = _step(model, x).read()
    assert location.forward is None
    assert location.backward is not None
    assert location.backward.module == "2"
    origin = location.backward_origin
    assert origin is not None
    assert origin.module == "2"
    assert not origin.inputs_nonfinite
    assert origin.outputs_nonfinite
    assert origin.first_bad_output is not None
    assert origin.first_bad_output.role == "grad_input"
    assert "0.weight" in location.poisoned
    assert "3.weight" not in location.poisoned


def test_nonfinite_input_is_not_an_origin() -> None:
    model = _net(nn.Identity())
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    location = _step(model, x).read()
    assert location.forward is not None
    assert location.forward.inputs_nonfinite
    assert location.forward_origin is None
    assert "already non-finite" in location.describe()


class Embedded(nn.Module):
    """Token ids in (they need no gradient), a dict out (as a Hugging Face ModelOutput)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.embed(ids))}


@requires_torch_2_6
def test_torch_says_nothing_about_the_locators_own_hooks() -> None:
    """torch warns that a module returning a dict gets no backward hook call, and that the
    embedding's hook fires on its outputs' gradients: about the locator's hooks, not the
    user's code. Silenced while armed, and the filters are as they were after."""
    model = Embedded()
    ids = torch.randint(0, 10, (3,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        with NanLocator(model) as locator:
            model(ids)["logits"].sum().backward()
        assert warnings.filters == before
        # Not armed: torch's own full backward hook warnings are shown again.
        handle = model.embed.register_full_backward_hook(lambda *args: None)
        model(ids)["logits"].sum().backward()
        handle.remove()
    messages = [str(w.message) for w in caught]
    assert not locator.read().found
    assert len(messages) == 1, messages
    assert messages[0].startswith("Full backward hook is firing")


def test_healthy_step_finds_nothing_and_hooks_are_removed() -> None:
    model = _net(nn.Identity())
    locator = _step(model, torch.randn(4, 8))
    location = locator.read()
    assert not location.found
    assert location.calls == 2 * 5  # 5 modules (4 + root), forward and backward
    assert not locator.armed
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def test_report_gives_the_poisoned_gradients() -> None:
    import gradaudit

    model = _net(Log())
    locator = _step(model, torch.randn(4, 8))
    report = gradaudit.collect_module(model).materialize()
    location = locator.read(report)
    assert set(location.poisoned) == {t.name for t in report.tensors if t.nonfinite}


def test_buffer_grows_beyond_capacity() -> None:
    model = _net(Log())
    locator = NanLocator(model, capacity=3)
    with locator:
        model(torch.randn(4, 8)).sum().backward()
    location = locator.read()
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"


def test_forward_only() -> None:
    model = _net(Log())
    locator = NanLocator(model, backward=False)
    with locator:
        model(torch.randn(4, 8)).sum().backward()
    location = locator.read()
    assert location.backward is None
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"


@requires_set_stance
def test_compiled_model_runs_eagerly_while_armed() -> None:
    model = _net(Log())
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(x)  # compiled once, unarmed
        locator = NanLocator(model)
        with locator:
            compiled(x).sum().backward()
        location = locator.read()
        assert location.forward_origin is not None
        assert location.forward_origin.module == "2"
        assert compiled(x).isnan().any()  # disarmed: compiled again, still works


@pytest.mark.parametrize("capacity", [0, -1])
def test_bad_capacity(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        NanLocator(nn.Linear(2, 2), capacity=capacity)


def _train(monitor_model: nn.Module, monitor: object, bad_steps: set[int], steps: int) -> None:
    import gradaudit

    assert isinstance(monitor, gradaudit.GradientMonitor)
    for step in range(steps):
        x = torch.rand(4, 8) + 0.5
        if step in bad_steps:
            x[0] = -1.0  # ReLU gives exact zeros, the log makes -inf
        monitor_model.zero_grad()
        monitor_model(x).sum().backward()
        monitor.step()
    monitor.flush()


def _log_net() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Log(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(8))
        model[0].bias.zero_()
    return model


def test_monitor_in_sync_mode_locates_the_nan_step_itself() -> None:
    import gradaudit

    model = _log_net()
    monitor = gradaudit.GradientMonitor(
        model, every=1, sync=True, dump_dir=None, on_nonfinite="ignore", locate="on_nonfinite"
    )
    _train(model, monitor, bad_steps={3, 4, 6}, steps=8)
    # Each NaN step is replayed under the locator in its own monitor.step() call.
    assert [(step, loc.found) for step, loc in monitor.locations] == [
        (3, True),
        (4, True),
        (6, True),
    ]
    location = monitor.locations[0][1]
    assert location.replayed
    assert location.cause == "forward"
    assert location.forward_origin is not None
    assert location.forward_origin.module == "2"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_monitor_without_sync_locates_the_step_after_a_nan_was_seen() -> None:
    import gradaudit

    model = _log_net()
    monitor = gradaudit.GradientMonitor(
        model, every=1, dump_dir=None, on_nonfinite="ignore", locate="on_nonfinite"
    )
    _train(model, monitor, bad_steps={3, 4, 6}, steps=8)
    # Step 3's stats arrive at call 4: armed for 5 (clean), 6 is located; 7's stats arrive
    # with flush(), nothing armed after.
    assert [(step, loc.found) for step, loc in monitor.locations] == [(5, False), (6, True)]
    assert not any(loc.replayed for _, loc in monitor.locations)


def test_monitor_locates_on_a_schedule() -> None:
    import gradaudit

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Log(), nn.Linear(8, 2))
    monitor = gradaudit.GradientMonitor(
        model, every=100, dump_dir=None, locate="always", locate_every=2, on_nonfinite="ignore"
    )
    _train(model, monitor, bad_steps=set(), steps=5)
    assert [step for step, _ in monitor.locations] == [0, 2, 4]
    with pytest.raises(ValueError, match=r"nn\.Module"):
        gradaudit.GradientMonitor(list(model.parameters()), locate="always")
    with pytest.raises(ValueError, match="locate must be"):
        gradaudit.GradientMonitor(model, locate="sometimes")  # type: ignore[arg-type]
