"""Which module produced the first NaN/Inf: forward and backward hooks, one host read per step.

``torch.autograd.detect_anomaly`` checks every backward op's output on the
host (a device sync per op) and fairseq's ``NanDetector`` reads one value per
module. Here every hook only *queues* a count on the device: forward pre-hooks
count the non-finite elements of each module's inputs, forward hooks those of
its outputs, full backward hooks those of the gradients flowing into
(``grad_output``) and out of (``grad_input``) the module. Each count is written
into one int64 slot of a device buffer; which slot belongs to which module,
phase and tensor is known on the host (the hooks run in Python, in execution
order). :meth:`NanLocator.read` copies the buffer to the host once and answers:

* the first module, in execution order, whose forward output went non-finite,
  and whether its inputs already were (the *origin* is the first such module
  whose inputs were all finite: the module where the value was produced);
* the same for the backward pass, with the gradient's input/output index and
  the counts;
* the parameter gradients that hold NaN/Inf (the ones the origin poisoned),
  from per-parameter stats when a report is given, else counted into the same
  buffer, so a context-managed step still costs one read.

Forward hooks run when a module's ``forward`` returns, so a parent completes
after its children: the first non-finite output in that order is the
innermost module that produced it. A value made non-finite by a functional op
between submodules (``torch.log`` in a parent's ``forward``) shows up as the
parent's output with finite inputs, or as a child whose inputs were already
non-finite.

``torch.compile``: hooks inside a compiled region would run once at trace
time, not at every call. While armed, the locator therefore sets
``torch.compiler.set_stance("force_eager")`` (torch >= 2.6; older torch has no
stance, and a compiled model is then not located inside its compiled region): the
armed step runs eagerly (and is located exactly); steps outside it stay compiled.
A stance the caller set themselves is replaced by ``"default"`` when the locator
disarms.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import torch

from gradaudit.results.location import Location, ModuleEvent, Phase, Role, TensorCount
from gradaudit.training.gradients import unwrap_module

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from gradaudit.results import Report

__all__ = ["Location", "ModuleEvent", "NanLocator", "TensorCount"]

#: Slots of the device buffer allocated at once; it grows by this much when full.
DEFAULT_CAPACITY = 4096
#: What torch says about the locator's own full backward hooks, which the user cannot act
#: on: a module whose output is not a tensor or a tuple of them (a Hugging Face
#: ``ModelOutput``, a dict) gets no backward hook call (its forward hooks still count it),
#: and the first module's backward hook fires on its outputs' gradients when its input (the
#: batch, token ids) needs none. Only these two are silenced, and only while armed.
_HOOK_WARNINGS = (
    r"For backward hooks to be called, module output should be a Tensor or a tuple of Tensors",
    r"Full backward hook is firing when gradients are computed with respect to module outputs",
)
#: Name shown for the model itself (the root module has the empty name).
ROOT_NAME = "<model>"


@dataclass
class _Call:
    module: str
    phase: Phase
    inputs: list[tuple[Role, int, int, int, str | None]]  # role, index, slot, numel, name
    outputs: list[tuple[Role, int, int, int, str | None]]
    #: Called from outside any hooked module (``model(batch)``): its inputs are the batch.
    top: bool = False
    #: When its pre-hook and its post-hook ran, on one clock for the whole step.
    start: int = 0
    end: int = 0


def hook_leaves(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Flattened ``(path, tensor)`` of a hook argument, depth first; non-float tensors and
    ``None`` give ``None`` (they hold a position), other leaves are skipped."""
    if isinstance(value, torch.Tensor):
        yield path, value if value.is_floating_point() else None
    elif isinstance(value, tuple | list):
        for position, item in enumerate(value):
            yield from hook_leaves(item, f"{path}[{position}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from hook_leaves(item, f"{path}[{key!r}]")
    elif value is None:
        yield path, None


def _argument_names(module: torch.nn.Module, args: tuple[Any, ...]) -> list[str]:
    """The names ``module.forward`` gives its positional arguments (``args[i]`` where unknown)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = []
    for position in range(len(args)):
        name = f"args[{position}]"
        if position < len(parameters):
            parameter = parameters[position]
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
                name = f"{parameter.name}[{position - parameters.index(parameter)}]"
            elif parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
                name = parameter.name
        elif parameters and parameters[-1].kind is inspect.Parameter.VAR_POSITIONAL:
            name = f"{parameters[-1].name}[{position - len(parameters) + 1}]"
        names.append(name)
    return names


class NanLocator:
    """Hooks on every module of ``model`` that locate the first NaN/Inf of a step.

    ::

        with gradaudit.NanLocator(model) as locator:
            loss = model(batch).loss
            loss.backward()
        print(locator.read().describe())

    ``read()`` is the one host read; call it after ``backward()`` (and before
    ``zero_grad()`` if the poisoned gradients are wanted). ``backward=False``
    installs forward hooks only: full backward hooks cannot wrap a module whose
    output is modified in place (``ReLU(inplace=True)``) and they add work.
    A ``DistributedDataParallel`` or ``torch.compile`` wrapper is looked through: the
    names are the wrapped module's.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        backward: bool = True,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.model = unwrap_module(model)
        self.backward = backward
        self.capacity = capacity
        self._names = {id(m): (n or ROOT_NAME) for n, m in self.model.named_modules()}
        self._handles: list[RemovableHandle] = []
        self._buffers: list[torch.Tensor] = []
        self._used = 0
        self._calls: list[_Call] = []
        self._open: list[_Call] = []
        self._grad_slots: list[tuple[str, int]] = []
        self._clock = 0
        #: Tensors already counted this step: id -> (the tensor, its version, slot).
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self._stance: Any = None
        #: The warning filters :meth:`arm` added (removed by :meth:`disarm`).
        self._filters: list[Any] = []

    # -- arming -----------------------------------------------------------------

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Install the hooks and start a fresh step; armed steps run eagerly under compile."""
        if self.armed:
            self.reset()
            return
        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook))
            if self.backward:
                self._handles.append(module.register_full_backward_hook(self._backward_hook))
        if self.backward:
            for message in _HOOK_WARNINGS:
                # No module= test: torch replays a hook's warning at the caller's
                # backward() line, so it is attributed to the user's module.
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
                self._filters.append(warnings.filters[0])
        # set_stance is torch >= 2.6; before it a compiled region runs its hooks at trace
        # time only (documented), and nothing here can change that.
        set_stance = getattr(torch.compiler, "set_stance", None)
        self._stance = None if set_stance is None else set_stance("force_eager")
        self.reset()

    def disarm(self) -> None:
        """Remove every hook; what was recorded stays readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        filters = cast(list[Any], warnings.filters)  # typed as a Sequence; it is the list
        for entry in self._filters:
            if entry in filters:  # a catch_warnings() may have restored the list meanwhile
                filters.remove(entry)
        self._filters.clear()
        if self._stance is not None:
            torch.compiler.set_stance("default")
            self._stance = None

    def reset(self) -> None:
        """Forget the recorded calls (buffers are kept and overwritten)."""
        self._used = 0
        self._calls = []
        self._open = []
        self._grad_slots = []
        self._seen = {}
        self._clock = 0

    def __enter__(self) -> NanLocator:
        self.arm()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.disarm()

    # -- recording (device work only) ---------------------------------------------

    def _slot(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """The buffer and offset of the next free slot, growing the buffers when full."""
        chunk, offset = divmod(self._used, self.capacity)
        if chunk == len(self._buffers) or self._buffers[chunk].device != device:
            buffer = torch.zeros(self.capacity, dtype=torch.int64, device=device)
            if chunk == len(self._buffers):
                self._buffers.append(buffer)
            else:  # the model moved: start over on the new device
                self._buffers[chunk] = buffer
        self._used += 1
        return self._buffers[chunk], offset

    def _record(
        self, value: Any, role: Role, *, path: str = "", start: int = 0
    ) -> list[tuple[Role, int, int, int, str | None]]:
        """Count every float tensor of ``value``; ``path`` names them (top-level inputs)."""
        counted = []
        with torch.no_grad():
            for index, (name, tensor) in enumerate(hook_leaves(value, path), start):
                if tensor is None or tensor.numel() == 0:
                    continue
                label = name if path or name else None
                counted.append((role, index, self._count(tensor), tensor.numel(), label))
        return counted

    def _count(self, tensor: torch.Tensor) -> int:
        """The slot holding ``tensor``'s non-finite count: queued now, or already counted.

        A module's output is usually the next module's input, and a parent's
        input its first child's: the same tensor object, unchanged (same
        version), is counted once. The weak reference proves it is the same
        object, not a new one at a recycled ``id``.
        """
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            return seen[2]
        slot = self._used
        buffer, offset = self._slot(tensor.device)
        work = tensor if tensor.element_size() > 1 else tensor.float()
        # x - x is 0 for finite x and NaN for NaN and ±Inf; count_nonzero counts NaN.
        # Queued on the device: nothing here reads a value back.
        buffer[offset] = torch.count_nonzero(work - work)
        self._seen[id(tensor)] = (weakref.ref(tensor), tensor._version, slot)
        return slot

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _pre_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        top = not self._open
        call = _Call(self._names.get(id(module), "?"), "forward", [], [], top, self._tick())
        if top:
            # From outside the model: the batch. Named as forward() names its arguments.
            call.inputs = [
                entry
                for name, arg in zip(_argument_names(module, args), args, strict=True)
                for entry in self._record(arg, "input", path=name)
            ]
            call.inputs += [
                entry
                for key, arg in kwargs.items()
                for entry in self._record(arg, "input", path=key)
            ]
        else:
            call.inputs = self._record(args, "input") + self._record(
                kwargs, "input", start=len(args)
            )
        self._open.append(call)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        call = (
            self._open.pop()
            if self._open
            else _Call(self._names.get(id(module), "?"), "forward", [], [])
        )
        call.outputs = self._record(output, "output")
        call.end = self._tick()
        self._calls.append(call)

    def _backward_hook(self, module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        call = _Call(self._names.get(id(module), "?"), "backward", [], [])
        call.inputs = self._record(grad_output, "grad_output")
        call.outputs = self._record(grad_input, "grad_input")
        call.start = call.end = self._tick()
        self._calls.append(call)

    def _record_gradients(self) -> None:
        for name, param in self.model.named_parameters():
            if param.grad is None or not param.grad.is_floating_point():
                continue
            for _role, _index, slot, _numel, _name in self._record(param.grad, "parameter_grad"):
                self._grad_slots.append((name, slot))

    # -- the one read ---------------------------------------------------------------

    def read(self, report: Report | None = None) -> Location:
        """Copy the counts to the host once and find the first NaN/Inf of the step.

        ``report`` (the per-parameter stats of the same step, e.g. a
        :class:`~gradaudit.MonitorRecord`'s) names the poisoned gradients; without
        it their counts are queued into the same buffer before the read. When the
        forward pass went non-finite, a second small read says which parameters (the
        weights themselves) hold NaN/Inf.
        """
        if report is None:
            self._record_gradients()
        used = self._used
        host = torch.cat(self._buffers).to("cpu")[:used].tolist() if used else []
        events = {"forward": 0, "backward": 0}
        forward = forward_origin = backward = backward_origin = None
        tops: list[tuple[int, ModuleEvent]] = []  # top-level calls given NaN/Inf
        first_bad_end: int | None = None  # when a forward output first went non-finite
        for call in self._calls:
            order = events[call.phase]
            events[call.phase] += 1
            event = self._event(call, order, host)
            if call.phase == "forward" and call.top and event.inputs_nonfinite:
                tops.append((call.start, event))
            if not event.outputs_nonfinite:
                continue
            if call.phase == "forward":
                if forward is None:
                    forward, first_bad_end = event, call.end
                if forward_origin is None and not event.inputs_nonfinite:
                    forward_origin = event
            else:
                backward = backward or event
                if backward_origin is None and not event.inputs_nonfinite:
                    backward_origin = event
        # The batch is the origin only if it held NaN/Inf before any module made one.
        # (Calls are listed as they complete; a top-level call's inputs exist at its start.)
        origin_batch = None
        if tops:
            start, event = min(tops, key=lambda pair: pair[0])
            if first_bad_end is None or start < first_bad_end:
                origin_batch = event
        if report is not None:
            poisoned = tuple(t.name for t in report.tensors if t.nonfinite)
        else:
            poisoned = tuple(dict.fromkeys(name for name, slot in self._grad_slots if host[slot]))
        weights: tuple[str, ...] = ()
        origin_weights: tuple[str, ...] = ()
        if forward is not None:
            weights = self._nonfinite_parameters()
            if forward_origin is not None:
                own = self._own_parameters(forward_origin.module)
                origin_weights = tuple(name for name in weights if name in own)
        return Location(
            forward,
            forward_origin,
            backward,
            backward_origin,
            poisoned,
            len(self._calls),
            batch=origin_batch,
            weights=weights,
            origin_weights=origin_weights,
            backward_hooked=self.backward,
        )

    def _event(self, call: _Call, order: int, host: list[int]) -> ModuleEvent:
        return ModuleEvent(
            call.module,
            call.phase,
            order,
            tuple(TensorCount(r, i, int(host[s]), n, label) for r, i, s, n, label in call.inputs),
            tuple(TensorCount(r, i, int(host[s]), n, label) for r, i, s, n, label in call.outputs),
        )

    def _own_parameters(self, module_name: str) -> set[str]:
        """Names of the parameters ``module_name`` holds itself (not its children's)."""
        name = "" if module_name == ROOT_NAME else module_name
        try:
            module = self.model.get_submodule(name)
        except AttributeError:
            return set()
        prefix = f"{name}." if name else ""
        return {prefix + n for n, _ in module.named_parameters(recurse=False)}

    def _nonfinite_parameters(self) -> tuple[str, ...]:
        """The parameters (weights) holding NaN/Inf: a second read, on the failure path only."""
        named = [
            (name, param)
            for name, param in self.model.named_parameters()
            if param.is_floating_point() and param.numel()
        ]
        if not named:
            return ()
        # One flag per parameter on its device, then one read per device (not one per
        # parameter); isfinite's bool temporary instead of a float copy (p - p).
        by_device: dict[torch.device, list[int]] = {}
        for index, (_, param) in enumerate(named):
            by_device.setdefault(param.device, []).append(index)
        bad = [False] * len(named)
        with torch.no_grad():
            for indices in by_device.values():
                flags = torch.stack([~torch.isfinite(named[i][1]).all() for i in indices])
                for index, flag in zip(indices, flags.tolist(), strict=True):
                    bad[index] = bool(flag)
        return tuple(name for (name, _), flag in zip(named, bad, strict=True) if flag)
