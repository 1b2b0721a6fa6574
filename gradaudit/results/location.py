"""What a :class:`~gradaudit.NanLocator` found: where the first NaN/Inf of a step came from.

Here, not in :mod:`gradaudit.training.locate` (the hooks that fill them): a
:class:`~gradaudit.NonFiniteGradientError` carries a :class:`Location`, and the errors sit
below the training stage. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Cause", "Location", "ModuleEvent", "TensorCount"]

Phase = Literal["forward", "backward"]
#: How a counted tensor relates to its module: forward ``input``/``output``; in backward
#: ``grad_output`` (flowing in, from later layers) and ``grad_input`` (flowing out).
Role = Literal["input", "output", "grad_output", "grad_input", "parameter_grad"]
#: Where the first NaN/Inf of a step came from (:attr:`Location.cause`): the model's inputs,
#: a parameter that already held it, an op of a module's forward, an op of the backward.
Cause = Literal["batch", "weight", "forward", "backward"]
#: Names listed before "and N more".
_SHOWN = 5


@dataclass(frozen=True)
class TensorCount:
    """Non-finite elements of one tensor a module took or gave."""

    role: Role
    #: Position among the module's flattened inputs or outputs (tuples, lists, dicts).
    index: int
    nonfinite: int
    numel: int
    #: The argument it was passed as (``x``, ``input_ids``, ``batch['pixels']``), for the
    #: inputs of a top-level call (the batch); ``None`` elsewhere.
    name: str | None = None

    def label(self) -> str:
        return self.name if self.name is not None else f"{self.role}[{self.index}]"


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
    def first_bad_input(self) -> TensorCount | None:
        return next((c for c in self.inputs if c.nonfinite), None)

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
    """Where NaN/Inf first appeared in one located step; :attr:`cause` and :meth:`origin`
    say where it came from."""

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
    #: The first top-level forward call (the model called from outside: ``model(batch)``)
    #: whose inputs held NaN/Inf before any module had produced one: the batch.
    batch: ModuleEvent | None = None
    #: Parameters (the weights themselves, not their gradients) holding NaN/Inf, in model
    #: order; looked at only when the forward pass went non-finite.
    weights: tuple[str, ...] = ()
    #: The forward origin's own parameters among :attr:`weights`.
    origin_weights: tuple[str, ...] = ()
    #: Whether the step was located by replaying its forward and backward on the saved batch
    #: (``GradientMonitor(locate=...)`` with ``sync=True``), not while it first ran.
    replayed: bool = False
    #: Whether backward hooks were on (``NanLocator(backward=True)``).
    backward_hooked: bool = True

    @property
    def found(self) -> bool:
        return self.forward is not None or self.backward is not None or bool(self.poisoned)

    @property
    def cause(self) -> Cause | None:
        """Where the first NaN/Inf came from; ``None`` when not seen (or not found)."""
        if self.batch is not None:
            return "batch"
        if self.forward_origin is not None:
            return "weight" if self.origin_weights else "forward"
        if self.forward is None and self.backward_origin is not None:
            return "backward"
        return None

    def origin(self) -> str:
        """One line: what made the first NaN/Inf of the step."""
        if not self.found:
            return f"no NaN/Inf in {self.calls} module calls"
        if self.batch is not None:
            names = ", ".join(
                f"{c.label()} ({c.nonfinite} of {c.numel} non-finite)"
                for c in self.batch.inputs
                if c.nonfinite
            )
            return f"the batch: {names}, passed to {self.batch.module}"
        if self.forward_origin is not None:
            if self.origin_weights:
                spread = (
                    f"; {len(self.weights)} parameters hold NaN/Inf (the optimizer applied an "
                    "earlier step's NaN/Inf gradient?)"
                    if len(self.weights) > len(self.origin_weights)
                    else ""
                )
                return (
                    f"the weights: {_names(self.origin_weights)} already held NaN/Inf, used "
                    f"by {self.forward_origin.module} (forward){spread}"
                )
            return f"{self.forward_origin.module} (forward)"
        if self.forward is not None:
            return (
                f"before {self.forward.module}: its inputs were already non-finite "
                "(a functional op outside any module)"
            )
        if self.backward_origin is not None:
            return f"{self.backward_origin.module} (backward)"
        if not self.backward_hooked:
            return (
                "in the backward pass (the forward pass was finite; backward hooks are off: "
                "NanLocator(backward=True) names the module)"
            )
        return "in the backward pass, outside any module's backward (a functional op)"

    def describe(self) -> str:
        """A few lines for a person: origin first, then how far it spread."""
        if not self.found:
            return self.origin()
        lines = ["origin: " + self.origin()]
        for event in (self.forward, self.backward):
            if event is not None:
                lines.append("first " + event.describe())
        if self.poisoned:
            lines.append(f"poisoned gradients ({len(self.poisoned)}): {_names(self.poisoned)}")
        if self.replayed:
            lines.append("(located by replaying the step's forward and backward on its batch)")
        return "\n".join(lines)


def _names(names: tuple[str, ...]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more
