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
``torch.compiler.set_stance("force_eager")``: the armed step runs eagerly (and
is located exactly); steps outside it stay compiled. A stance the caller set
themselves is replaced by ``"default"`` when the locator disarms.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from gradaudit.results import Report

__all__ = ["Location", "ModuleEvent", "NanLocator", "TensorCount"]

Phase = Literal["forward", "backward"]
#: How a counted tensor relates to its module: forward ``input``/``output``; in backward
#: ``grad_output`` (flowing in, from later layers) and ``grad_input`` (flowing out).
Role = Literal["input", "output", "grad_output", "grad_input", "parameter_grad"]

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


@dataclass(frozen=True)
class TensorCount:
    """Non-finite elements of one tensor a module took or gave."""

    role: Role
    #: Position among the module's flattened inputs or outputs (tuples, lists, dicts).
    index: int
    nonfinite: int
    numel: int


@dataclass(frozen=True)
class ModuleEvent:
    """One call of one module in one phase, with the counts of what went in and out."""

    module: str
    phase: Phase
    #: Position in execution order among this phase's calls (0 = first).
    order: int
    inputs: tuple[TensorCount, ...]
    outputs: tuple[TensorCount, ...]

    @property
    def inputs_nonfinite(self) -> bool:
        return any(c.nonfinite for c in self.inputs)

    @property
    def outputs_nonfinite(self) -> bool:
        return any(c.nonfinite for c in self.outputs)

    @property
    def first_bad_output(self) -> TensorCount | None:
        return next((c for c in self.outputs if c.nonfinite), None)

    def describe(self) -> str:
        bad = self.first_bad_output
        what = "output" if self.phase == "forward" else "grad_input"
        detail = (
            ""
            if bad is None
            else f" {what}[{bad.index}]: {bad.nonfinite} of {bad.numel} non-finite"
        )
        source = "inputs already non-finite" if self.inputs_nonfinite else "inputs finite: origin"
        return f"{self.phase} #{self.order} {self.module}{detail} ({source})"


@dataclass(frozen=True)
class Location:
    """Where NaN/Inf first appeared in one located step."""

    #: First forward call whose output held NaN/Inf, in execution order.
    forward: ModuleEvent | None
    #: First forward call whose output held NaN/Inf while all its inputs were finite.
    forward_origin: ModuleEvent | None
    #: First backward call whose ``grad_input`` held NaN/Inf.
    backward: ModuleEvent | None
    #: First backward call that turned finite ``grad_output`` into non-finite ``grad_input``.
    backward_origin: ModuleEvent | None
    #: Parameters whose gradient holds NaN/Inf after the step, in model order.
    poisoned: tuple[str, ...]
    #: Module calls recorded (forward and backward).
    calls: int

    @property
    def found(self) -> bool:
        return self.forward is not None or self.backward is not None or bool(self.poisoned)

    def describe(self) -> str:
        """A few lines for a person: origin first, then how far it spread."""
        if not self.found:
            return f"no NaN/Inf in {self.calls} module calls"
        lines = []
        origin = self.forward_origin or self.backward_origin
        if origin is not None:
            lines.append(f"origin: {origin.module} ({origin.phase})")
        elif self.forward is not None:
            lines.append(
                f"origin: before {self.forward.module}: its inputs were already non-finite "
                "(the model's input, or a functional op outside any module)"
            )
        for event in (self.forward, self.backward):
            if event is not None:
                lines.append("first " + event.describe())
        if self.poisoned:
            shown = ", ".join(self.poisoned[:5])
            more = f" and {len(self.poisoned) - 5} more" if len(self.poisoned) > 5 else ""
            lines.append(f"poisoned gradients ({len(self.poisoned)}): {shown}{more}")
        return "\n".join(lines)


@dataclass
class _Call:
    module: str
    phase: Phase
    inputs: list[tuple[Role, int, int, int]]  # role, index, slot, numel
    outputs: list[tuple[Role, int, int, int]]


def _tensors(value: Any) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Flattened ``(index, tensor)`` of a hook argument; non-float leaves give ``None``."""
    stack: list[Any] = [value]
    index = 0
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            yield index, item if item.is_floating_point() else None
            index += 1
        elif isinstance(item, tuple | list):
            stack[:0] = list(item)
        elif isinstance(item, dict):
            stack[:0] = list(item.values())
        elif item is None:
            yield index, None
            index += 1


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
        self.model = model
        self.backward = backward
        self.capacity = capacity
        self._names = {id(m): (n or ROOT_NAME) for n, m in model.named_modules()}
        self._handles: list[RemovableHandle] = []
        self._buffers: list[torch.Tensor] = []
        self._used = 0
        self._calls: list[_Call] = []
        self._open: list[_Call] = []
        self._grad_slots: list[tuple[str, int]] = []
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
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook))
            if self.backward:
                self._handles.append(module.register_full_backward_hook(self._backward_hook))
        if self.backward:
            for message in _HOOK_WARNINGS:
                # No module= test: torch replays a hook's warning at the caller's
                # backward() line, so it is attributed to the user's module.
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
                self._filters.append(warnings.filters[0])
        self._stance = torch.compiler.set_stance("force_eager")
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

    def _record(self, value: Any, role: Role) -> list[tuple[Role, int, int, int]]:
        counted = []
        with torch.no_grad():
            for index, tensor in _tensors(value):
                if tensor is None or tensor.numel() == 0:
                    continue
                counted.append((role, index, self._count(tensor), tensor.numel()))
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

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        call = _Call(self._names.get(id(module), "?"), "forward", [], [])
        call.inputs = self._record(args, "input")
        self._open.append(call)

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        call = (
            self._open.pop()
            if self._open
            else _Call(self._names.get(id(module), "?"), "forward", [], [])
        )
        call.outputs = self._record(output, "output")
        self._calls.append(call)

    def _backward_hook(self, module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        call = _Call(self._names.get(id(module), "?"), "backward", [], [])
        call.inputs = self._record(grad_output, "grad_output")
        call.outputs = self._record(grad_input, "grad_input")
        self._calls.append(call)

    def _record_gradients(self) -> None:
        for name, param in self.model.named_parameters():
            if param.grad is None or not param.grad.is_floating_point():
                continue
            for _role, _index, slot, _numel in self._record(param.grad, "parameter_grad"):
                self._grad_slots.append((name, slot))

    # -- the one read ---------------------------------------------------------------

    def read(self, report: Report | None = None) -> Location:
        """Copy the counts to the host once and find the first NaN/Inf of the step.

        ``report`` (the per-parameter stats of the same step, e.g. a
        :class:`~gradaudit.MonitorRecord`'s) names the poisoned gradients; without
        it their counts are queued into the same buffer before the read.
        """
        if report is None:
            self._record_gradients()
        used = self._used
        host = torch.cat(self._buffers).to("cpu")[:used].tolist() if used else []
        events = {"forward": 0, "backward": 0}
        forward = forward_origin = backward = backward_origin = None
        for call in self._calls:
            order = events[call.phase]
            events[call.phase] += 1
            ins = tuple(TensorCount(r, i, int(host[s]), n) for r, i, s, n in call.inputs)
            outs = tuple(TensorCount(r, i, int(host[s]), n) for r, i, s, n in call.outputs)
            if not any(c.nonfinite for c in outs):
                continue
            event = ModuleEvent(call.module, call.phase, order, ins, outs)
            if call.phase == "forward":
                forward = forward or event
                if forward_origin is None and not event.inputs_nonfinite:
                    forward_origin = event
            else:
                backward = backward or event
                if backward_origin is None and not event.inputs_nonfinite:
                    backward_origin = event
        if report is not None:
            poisoned = tuple(t.name for t in report.tensors if t.nonfinite)
        else:
            poisoned = tuple(dict.fromkeys(name for name, slot in self._grad_slots if host[slot]))
        return Location(
            forward, forward_origin, backward, backward_origin, poisoned, len(self._calls)
        )
