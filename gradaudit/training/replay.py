"""Locating a step after it ran: keep each forward call's batch, replay it under a
:class:`~gradaudit.training.locate.NanLocator` when the step's gradients turn out
non-finite.

Apart from the locator's hooks (:mod:`gradaudit.training.locate`): what is kept of a
step, and how it is run again as it ran (its random state, its buffers put back), is
this module's job. A monitor with ``locate=...`` and ``sync=True`` keeps one armed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from gradaudit.results.location import Location
from gradaudit.training.gradients import unwrap_module
from gradaudit.training.locate import NanLocator, hook_leaves

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from gradaudit.results import Report

__all__ = ["StepReplay"]


def _tensors(value: Any) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Flattened ``(index, tensor)`` of a hook argument; non-float leaves give ``None``."""
    for index, (_path, tensor) in enumerate(hook_leaves(value, "")):
        yield index, tensor


@dataclass
class _Saved:
    """One forward call of the root, kept to replay it: its arguments, the random state it
    ran with, and the gradients that flowed into its outputs."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: tuple[torch.Tensor, torch.Tensor | None]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and the current CUDA device's (host copies: no sync)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


@contextmanager
def _as_it_ran(
    model: torch.nn.Module, rng: tuple[torch.Tensor, torch.Tensor | None]
) -> Iterator[None]:
    """Run with the random state a step had (dropout draws the same masks), then put the
    random state and the buffers (BatchNorm's running stats) back as they were."""
    now = _rng_state()
    buffers = [(b, b.clone()) for b in model.buffers()]
    _set_rng_state(rng)
    try:
        yield
    finally:
        _set_rng_state(now)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _keep(grads: dict[int, torch.Tensor], index: int, grad: torch.Tensor) -> None:
    grads[index] = grad


class StepReplay:
    """Keeps the batch of each forward call of ``model`` so a step can be located after it ran.

    Two hooks on the root module only, cheap enough to stay armed: the forward pre-hook
    keeps a reference to the arguments (no copy) and the random state; the forward hook
    puts a tensor hook on each output that needs a gradient, which keeps the gradient
    the loss sent into it. :meth:`replay` runs the same forward under an armed
    :class:`NanLocator`, then the same backward (``torch.autograd.grad`` from the kept
    output gradients to the parameters: the parameters' ``.grad`` are left alone), with
    the random state restored and the buffers put back after. Costs the memory of what it
    keeps (the batch and the gradients of the model's outputs, until :meth:`clear`).

    Not kept: forward calls under ``torch.no_grad()`` (evaluation), calls while compiling
    (``torch.compile`` traces hooks once; a compiled model's steps are located by arming the
    locator for the next steps instead), calls made by :meth:`replay` itself.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = unwrap_module(model)
        self._saved: list[_Saved] = []
        self._handles: list[RemovableHandle] = []
        self._replaying = False

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    @property
    def saved(self) -> int:
        """Forward calls kept since the last :meth:`clear`."""
        return len(self._saved)

    def arm(self) -> None:
        if self.armed:
            return
        self._handles.append(self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post_hook))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def clear(self) -> None:
        self._saved = []

    def _pre_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self._replaying or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        self._saved.append(_Saved(tuple(args), dict(kwargs), _rng_state()))

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._replaying or not self._saved or torch.compiler.is_compiling():
            return
        saved = self._saved[-1]
        for index, tensor in _tensors(output):
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(partial(_keep, saved.grads, index))  # type: ignore[no-untyped-call]

    def replay(self, locator: NanLocator, report: Report | None = None) -> Location | None:
        """Run the kept calls again under ``locator``, first to last, until one is located.

        ``None`` when nothing was kept or no replayed call held NaN/Inf (a NaN that does
        not reproduce: a non-deterministic op, a NaN that came from outside the model).
        """
        saved, self._saved = self._saved, []
        params = [p for p in self.model.parameters() if p.requires_grad]
        for entry in saved:
            self._replaying = True
            try:
                with _as_it_ran(self.model, entry.rng), locator:
                    self._run(entry, params)
            finally:
                self._replaying = False
            location = locator.read(report)
            # The report's poisoned gradients alone say nothing about this replay.
            if location.forward or location.backward or (location.found and not locator.backward):
                return replace(location, replayed=True)
        return None

    def _run(self, entry: _Saved, params: list[torch.nn.Parameter]) -> None:
        with torch.enable_grad():
            output = self.model(*entry.args, **entry.kwargs)
            outputs, grads = [], []
            for index, tensor in _tensors(output):
                if index in entry.grads and tensor is not None and tensor.requires_grad:
                    outputs.append(tensor)
                    grads.append(entry.grads[index])
            if outputs and params:
                torch.autograd.grad(outputs, params, grads, allow_unused=True)
