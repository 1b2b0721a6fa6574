"""Optimizer state in a loaded checkpoint: which entries are ``torch.optim`` state, the
parameter each belongs to, the role its structure says each tensor has, and how to read
a gradient estimate from it.

**Optimizer state -> parameter.** ``torch.optim`` keys its state by parameter index. When
the index can be tied to a parameter name without guessing, the tensor's name gets it in
parentheses: ``optimizer.state.3.exp_avg (encoder.weight)``. The rules, strictest first:

1. the param group lists ``param_names`` (``torch.optim`` does since PyTorch 2.5 when the
   optimizer was built from ``named_parameters()``): those names, exactly;
2. otherwise only by position, and only when nothing else is possible: a single param
   group whose ``params`` are ``0..n-1``, exactly one flat state dict elsewhere in the
   checkpoint with exactly ``n`` floating-point tensors, and every optimizer state entry
   holding a tensor of exactly its parameter's shape. Several param groups (which may list
   parameters in any order), a second state dict (an EMA copy) or any shape mismatch means
   no annotation rather than a plausible wrong one.

Apart from the walk that names every tensor (:mod:`gradaudit.io.nested`): what an
optimizer's state dict looks like, and what each optimizer's keys and hyperparameters
mean, is this module's job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gradaudit.io.checkpoint_tree import (
    Node,
    Tensor,
    child_name,
    children,
    is_floating,
    is_tensor,
    plan,
)
from gradaudit.io.files import plain_number
from gradaudit.policy import Role
from gradaudit.results.roles import EstimateBasis, TensorHint
from gradaudit.roles import OPTIMIZER_STATE_ROLES, container_hint


@dataclass(frozen=True)
class Optimizers:
    """What :func:`find_optimizers` learnt: state entries by id, and their parameters."""

    entry_ids: frozenset[int] = frozenset()
    params: Mapping[int, str] = field(default_factory=dict)
    #: State entry id -> (its param group, the entry), for roles and gradient estimates.
    entries: Mapping[int, tuple[dict[object, object], dict[object, object]]] = field(
        default_factory=dict
    )


def _optimizer_groups(value: object) -> list[object] | None:
    """The ``param_groups`` of a ``torch.optim`` state dict, or None if ``value`` is not one."""
    if not isinstance(value, dict):
        return None
    state, groups = value.get("state"), value.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        return None
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return None
    return groups


def _floating_tensors(value: dict[object, object]) -> list[tuple[str, Tensor]] | None:
    """The floating-point tensors of a flat state dict (text keys, tensor values), else None."""
    pairs = [(k, v) for k, v in value.items() if isinstance(k, str) and is_tensor(v)]
    if not pairs or len(pairs) != len(value):
        return None
    floats = [(k, v) for k, v in pairs if is_floating(v)]
    return floats or None


def _names_from_groups(groups: list[object]) -> dict[object, str]:
    """Rule 1: ``param_names`` listed next to ``params`` in each group."""
    mapping: dict[object, str] = {}
    for group in groups:
        if not isinstance(group, dict):
            continue
        params, names = group.get("params"), group.get("param_names")
        if (
            isinstance(params, list)
            and isinstance(names, list)
            and len(names) == len(params)
            and all(isinstance(n, str) for n in names)
        ):
            for index, name in zip(params, names, strict=True):
                if isinstance(index, int | str):
                    mapping[index] = name
    return mapping


def _names_by_position(
    state: dict[object, object],
    groups: list[object],
    models: list[tuple[str | None, list[tuple[str, Tensor]]]],
) -> dict[object, str]:
    """Rule 2: position in the only state dict, when counts and every shape agree."""
    if len(groups) != 1 or len(models) != 1 or not isinstance(groups[0], dict):
        return {}
    model_name, tensors = models[0]
    if groups[0].get("params") != list(range(len(tensors))):
        return {}
    checked = 0
    for index, entry in state.items():
        if type(index) is not int or not 0 <= index < len(tensors):
            return {}
        non_scalar = [t for _, t in children(entry) if is_tensor(t) and t.dim() > 0]
        if not non_scalar:
            continue
        if not any(t.shape == tensors[index][1].shape for t in non_scalar):
            return {}
        checked += 1
    if not checked:
        return {}
    return {i: child_name(model_name, key) for i, (key, _) in enumerate(tensors)}


def find_optimizers(root: object, bearing: set[int]) -> Optimizers:
    """Find ``torch.optim`` state dicts; tie their entries to parameter names where unambiguous."""
    optimizers: list[tuple[dict[object, object], list[object]]] = []
    flat: list[tuple[str | None, int, list[tuple[str, Tensor]]]] = []
    seen: set[int] = set()
    for node in plan(root, bearing):
        value = node.value
        if not isinstance(value, dict) or id(value) in seen:
            continue
        seen.add(id(value))
        groups = _optimizer_groups(value)
        if groups is not None:
            optimizers.append((value, groups))
            continue
        floats = _floating_tensors(value)
        if floats is not None:
            flat.append((node.name, id(value), floats))
    entry_ids = {
        id(entry)
        for optimizer, _ in optimizers
        for entry in _state(optimizer).values()
        if isinstance(entry, dict)
    }
    # A flat dict inside an optimizer's state is one parameter's state, not a model.
    models = [(name, floats) for name, ident, floats in flat if ident not in entry_ids]
    params: dict[int, str] = {}
    entries: dict[int, tuple[dict[object, object], dict[object, object]]] = {}
    for optimizer, groups in optimizers:
        state = _state(optimizer)
        names = _names_from_groups(groups) or _names_by_position(state, groups, models)
        group_of: dict[object, dict[object, object]] = {}
        for group in groups:
            if isinstance(group, dict) and isinstance(group.get("params"), list):
                for index in group["params"]:
                    if isinstance(index, int | str):
                        group_of.setdefault(index, group)
        for index, entry in state.items():
            if isinstance(entry, dict) and isinstance(index, int | str):
                entries[id(entry)] = (group_of.get(index, {}), entry)
            if isinstance(entry, dict) and isinstance(index, int | str) and index in names:
                params[id(entry)] = names[index]
    return Optimizers(frozenset(entry_ids), params, entries)


def _estimate_basis(
    key: str, tensor: Tensor, group: dict[object, object], entry: dict[object, object]
) -> EstimateBasis | None:
    """How to read a gradient estimate from the state tensor ``entry[key]``, if one can be.

    Hyperparameters come from the parameter's group (plain numbers only: a tensor beta
    is left alone rather than read); the step from the entry, a number or a 0-d tensor
    whose value travels with the one host read.
    """
    step_value = entry.get("step")
    step = plain_number(step_value)
    step_tensor = step_value if is_tensor(step_value) and step_value.numel() == 1 else None
    betas = group.get("betas")
    beta1 = beta2 = None
    if isinstance(betas, list | tuple) and len(betas) == 2:
        beta1, beta2 = plain_number(betas[0]), plain_number(betas[1])
    if key == "exp_avg_sq" and beta2 is not None:
        return EstimateBasis("ema_sq", decay=beta2, step=step, step_tensor=step_tensor)
    if key == "square_avg":
        decay = plain_number(group.get("alpha", group.get("rho")))
        if decay is not None:
            return EstimateBasis("ema_sq", decay=decay, step=step, step_tensor=step_tensor)
    if key == "sum":
        initial = plain_number(group.get("initial_accumulator_value")) or 0.0
        return EstimateBasis(
            "sum_sq",
            initial=initial,
            scale=float(tensor.numel()),
            step=step,
            step_tensor=step_tensor,
        )
    if key == "row_var":
        columns = entry.get("col_var")
        if is_tensor(columns) and columns.dim() >= 1:
            return EstimateBasis(
                "mean_sq", scale=float(columns.shape[-1]), step=step, step_tensor=step_tensor
            )
    if key == "variance":
        return EstimateBasis("mean_sq", step=step, step_tensor=step_tensor)
    if key == "exp_avg" and beta1 is not None:
        return EstimateBasis("ema", decay=beta1, step=step, step_tensor=step_tensor)
    if key == "momentum_buffer" and "alpha" not in group:
        momentum = plain_number(group.get("momentum"))
        if momentum:
            dampening = plain_number(group.get("dampening")) or 0.0
            return EstimateBasis(
                "momentum", decay=momentum, dampening=dampening, step=step, step_tensor=step_tensor
            )
    return None


def role_hint(node: Node, tensor: Tensor, optimizers: Optimizers) -> TensorHint | None:
    """What the structure around a tensor says it is (see :mod:`gradaudit.roles`)."""
    name = node.name or ""
    if node.entry is not None:
        key = name.rsplit(".", 1)[-1]
        group, entry = optimizers.entries.get(node.entry, ({}, {}))
        role = OPTIMIZER_STATE_ROLES.get(key, Role.UNKNOWN)
        what = "a known" if key in OPTIMIZER_STATE_ROLES else "an unknown"
        return TensorHint(
            role,
            f"torch.optim state, {what} key {key!r}",
            node.param,
            _estimate_basis(key, tensor, group, entry),
        )
    by_container = container_hint(name)
    if by_container is not None:
        return by_container
    if optimizers.entry_ids:
        return TensorHint(Role.WEIGHT, "beside optimizer state (a training checkpoint's model)")
    return None


def _state(optimizer: dict[object, object]) -> dict[object, object]:
    state = optimizer["state"]
    return state if isinstance(state, dict) else {}
