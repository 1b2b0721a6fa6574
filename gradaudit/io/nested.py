"""Walk a loaded training checkpoint and name every tensor by its path.

``torch.save`` files are rarely flat state dicts. A training checkpoint looks like
``{"model": state_dict, "optimizer": {"state": {0: {"exp_avg": ...}}, "param_groups": [...]},
"step": 7}``; Lightning nests the optimizer in a list, EMA copies add a second state dict.
This module turns any such structure of dicts, lists and tuples into ``(name, tensor)``
pairs named by their path (``model.encoder.weight``, ``optimizer.state.0.exp_avg_sq``) and
accounts for everything else as :class:`~gradaudit.results.Skipped`:

* a value that is not a tensor (``"step": 7``) is skipped with its type; a whole list or
  dict without any tensor beneath it (``param_groups``) is skipped as one entry rather than
  value by value, so a 500-parameter ``params`` list does not drown the report;
* a tensor the engine cannot audit safely (a tensor subclass, a ``meta`` tensor with no data)
  is skipped with the reason; dtype and layout are left to the engine, which skips them too;
* the same tensor reached twice (tied weights, a dict referenced from two places) is
  audited once, so it does not count twice in the global norm;
* an optimizer's per-parameter ``step`` counter (a 0-d tensor in ``torch.optim``) is
  skipped: it is a count, not a gradient statistic, and would otherwise be "exploding" after
  100 steps.

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

``--include``/``--exclude`` patterns are matched against the path name, without the
parenthesised parameter.

**Without torch.** The same walk serves the structure :mod:`gradaudit.io.zip_checkpoint`
unpickles without torch, whose tensors are :class:`~gradaudit.io.zip_checkpoint.StoredTensor`
records: every question asked of a tensor here (:func:`is_tensor`, :func:`_tensor_key`,
:func:`_stored_elements` ...) has the same answer for both, so the names, skips and hints
of both scan paths are one implementation. This module never imports torch: a
``torch.Tensor`` can only exist once torch is imported, so it is looked up in
``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from gradaudit.io.base import Excluded, Select, SourceItem
from gradaudit.io.files import plain_number, show
from gradaudit.io.zip_checkpoint import StoredTensor
from gradaudit.policy import Role
from gradaudit.results import Skipped
from gradaudit.results.roles import EstimateBasis, TensorHint
from gradaudit.roles import OPTIMIZER_STATE_ROLES, container_hint

#: The name of a tensor saved on its own (``torch.save(tensor, path)``).
ROOT_NAME = "<root>"

#: Containers nested deeper than this are skipped rather than walked: a hostile pickle can
#: nest lists a million deep, and no real checkpoint comes close.
MAX_DEPTH = 64

#: A ``torch.Tensor`` or a :class:`StoredTensor` (annotated loosely: torch is not imported).
Tensor = Any


def is_tensor(value: object) -> TypeGuard[Tensor]:
    """Whether ``value`` is a tensor: a :class:`StoredTensor`, or a ``torch.Tensor`` once
    torch is imported (none can exist before)."""
    if type(value) is StoredTensor:
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_floating(tensor: Tensor) -> bool:
    if type(tensor) is StoredTensor:
        return tensor.is_floating_point
    return bool(tensor.dtype.is_floating_point)


def _hides_values(tensor: Tensor) -> bool:
    """:func:`gradaudit.engine.dtypes.hides_values` of the tensor's dtype."""
    if type(tensor) is StoredTensor:
        return tensor.is_floating_point  # it knows no complex dtype
    from gradaudit.engine.dtypes import hides_values  # torch is imported already here

    return hides_values(tensor.dtype)


#: Keys a Lightning checkpoint stores its trainer's bookkeeping under: callback state
#: (``ModelCheckpoint``'s ``kth_value`` is ``inf`` until a top-k exists, ``EarlyStopping``'s
#: ``best_score`` starts at ``±inf``), loop progress, schedulers and hyper-parameters. Not
#: model or optimizer state, so never judged as a weight or gradient: listed as skipped.
LIGHTNING_BOOKKEEPING = {
    "callbacks": "Lightning callback state (best-k scores and paths, early-stopping counters)",
    "loops": "Lightning loop progress (epoch and batch counters)",
    "lr_schedulers": "Lightning learning-rate scheduler state",
    "hyper_parameters": "Lightning hyper-parameters",
    "datamodule_hyper_parameters": "Lightning data-module hyper-parameters",
}


def _bookkeeping(root: object) -> dict[int, str]:
    """Container id -> why it is bookkeeping, for the trainer state of a Lightning checkpoint.

    A Lightning checkpoint is a dict with ``pytorch-lightning_version`` (every version since
    1.0 writes it) or with ``state_dict`` beside ``loops``/``callbacks``.
    """
    if not isinstance(root, dict):
        return {}
    lightning = "pytorch-lightning_version" in root or (
        "state_dict" in root and ("loops" in root or "callbacks" in root)
    )
    if not lightning:
        return {}
    found = {
        id(root[key]): what
        for key, what in LIGHTNING_BOOKKEEPING.items()
        if key in root and _is_container(root[key]) and key != "callbacks"
    }
    callbacks = root.get("callbacks")
    if isinstance(callbacks, dict):
        # A callback that holds only scalars keeps scores and counters (ModelCheckpoint's
        # kth_value, EarlyStopping's best_score); one that holds real tensors (an EMA or
        # weight-averaging callback's copy of the model) is model state and is walked.
        scalar_only = {
            key: value
            for key, value in callbacks.items()
            if _is_container(value) and all(t.dim() == 0 for t in iter_tensors(value))
        }
        if len(scalar_only) == len(callbacks):
            found[id(callbacks)] = LIGHTNING_BOOKKEEPING["callbacks"]
        else:
            found.update({id(v): LIGHTNING_BOOKKEEPING["callbacks"] for v in scalar_only.values()})
    return found


def _is_container(value: object) -> bool:
    # torch.Size is a tuple of ints: a value, not a structure to walk.
    if isinstance(value, dict | list):
        return True
    if not isinstance(value, tuple):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not isinstance(value, torch.Size)


def _key_text(key: object) -> str:
    """A path component for a dict key; keys that are not text or numbers get their type."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool | int | float) or key is None:
        return str(key)
    return f"<{type(key).__name__}>"


def _child_name(parent: str | None, key: object) -> str:
    text = _key_text(key)
    return text if parent is None else f"{parent}.{text}"


def _children(value: object) -> list[tuple[object, object]]:
    """``(key, child)`` pairs of a container, in their stored order."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list | tuple):
        return list(enumerate(value))
    return []


def _describe(value: object) -> str:
    """A short description of a value that is not audited, for its skip reason."""
    if isinstance(value, dict):
        return f"dict of {len(value)} {'entry' if len(value) == 1 else 'entries'}"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)} value{'' if len(value) == 1 else 's'}"
    return f"{type(value).__name__} value"


def _tensor_bearing(root: object) -> set[int]:
    """Ids of the containers with at least one tensor somewhere beneath them.

    Iterative post-order walk: a hostile pickle may nest deeper than Python's recursion
    limit, and may be cyclic (a list that contains itself), so every container is entered
    once.
    """
    bearing: set[int] = set()
    entered: set[int] = set()
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        value, leaving = stack.pop()
        if leaving:
            if any(is_tensor(child) or id(child) in bearing for _, child in _children(value)):
                bearing.add(id(value))
            continue
        if not _is_container(value) or id(value) in entered:
            continue
        entered.add(id(value))
        stack.append((value, True))
        stack.extend((child, False) for _, child in _children(value) if _is_container(child))
    return bearing


@dataclass(frozen=True)
class _Node:
    name: str | None  # None for the root
    value: object
    depth: int
    #: The parameter an optimizer state entry belongs to, inherited by what it holds.
    param: str | None = None
    #: Whether this node sits directly in an optimizer's per-parameter state entry.
    in_optimizer_entry: bool = False
    #: The id of that state entry (to find its param group and step), when it does.
    entry: int | None = None


@dataclass(frozen=True)
class _Optimizers:
    """What :func:`_find_optimizers` learnt: state entries by id, and their parameters."""

    entry_ids: frozenset[int] = frozenset()
    params: Mapping[int, str] = field(default_factory=dict)
    #: State entry id -> (its param group, the entry), for roles and gradient estimates.
    entries: Mapping[int, tuple[dict[object, object], dict[object, object]]] = field(
        default_factory=dict
    )


def _plan(
    root: object, bearing: set[int], optimizers: _Optimizers | None = None
) -> Iterator[_Node]:
    """Visit the root and the children of every tensor-bearing container, depth first, in order.

    Tensor-free containers and leaves are yielded but not entered; a container reached a
    second time is yielded again (the caller reports it) but not entered again.
    """
    optimizers = optimizers or _Optimizers()
    entered: set[int] = set()
    stack = [_Node(None, root, 0)]
    while stack:
        node = stack.pop()
        yield node
        value = node.value
        if not _is_container(value) or id(value) in entered or node.depth >= MAX_DEPTH:
            continue
        if node.name is not None and id(value) not in bearing:
            continue
        entered.add(id(value))
        is_entry = id(value) in optimizers.entry_ids
        param = optimizers.params.get(id(value), node.param)
        entry = id(value) if is_entry else None
        stack.extend(
            reversed(
                [
                    _Node(
                        _child_name(node.name, key), child, node.depth + 1, param, is_entry, entry
                    )
                    for key, child in _children(value)
                ]
            )
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
    floats = [(k, v) for k, v in pairs if _is_floating(v)]
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
        non_scalar = [t for _, t in _children(entry) if is_tensor(t) and t.dim() > 0]
        if not non_scalar:
            continue
        if not any(t.shape == tensors[index][1].shape for t in non_scalar):
            return {}
        checked += 1
    if not checked:
        return {}
    return {i: _child_name(model_name, key) for i, (key, _) in enumerate(tensors)}


def _find_optimizers(root: object, bearing: set[int]) -> _Optimizers:
    """Find ``torch.optim`` state dicts; tie their entries to parameter names where unambiguous."""
    optimizers: list[tuple[dict[object, object], list[object]]] = []
    flat: list[tuple[str | None, int, list[tuple[str, Tensor]]]] = []
    seen: set[int] = set()
    for node in _plan(root, bearing):
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
    return _Optimizers(frozenset(entry_ids), params, entries)


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


def _role_hint(node: _Node, tensor: Tensor, optimizers: _Optimizers) -> TensorHint | None:
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


class _Names:
    """Hands out names, making a repeated one unique: ``{"a.b": x, "a": {"b": y}}`` gives
    ``a.b`` and ``a.b#2``, so two tensors never share a row or each other's findings."""

    def __init__(self) -> None:
        self._used: set[str] = set()

    def unique(self, name: str) -> str:
        candidate, n = name, 1
        while candidate in self._used:
            n += 1
            candidate = f"{name}#{n}"
        self._used.add(candidate)
        return candidate


def _tensor_key(tensor: Tensor) -> tuple[object, ...] | None:
    """What makes two tensor objects the same data, or None when that cannot be told cheaply."""
    if type(tensor) is StoredTensor:
        return tensor.key()
    torch = sys.modules["torch"]
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.numel() == 0:
        return None
    if tensor.device.type == "meta":
        return None
    pointer = tensor.untyped_storage().data_ptr()
    if pointer == 0:
        return None
    return (
        tensor.device,
        pointer,
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _stored_elements(tensor: Tensor) -> int | None:
    """How many elements the tensor's storage holds, where that can be told cheaply."""
    if type(tensor) is StoredTensor:
        return tensor.stored_elements()
    torch = sys.modules["torch"]
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        return None
    try:
        return int(tensor.untyped_storage().nbytes()) // max(int(tensor.element_size()), 1)
    except (RuntimeError, NotImplementedError):  # a storage-less subclass
        return None


def expanded_view(tensor: Tensor) -> str | None:
    """What is wrong with a tensor that has more elements than its storage holds, or None.

    ``torch.zeros(1).expand(2**40)`` is 1.5 KB on disk: reducing it would read (or copy)
    2**40 elements. Its values are the storage's, repeated. Every reader that loads
    tensors from a pickle asks this before handing one on (a checkpoint's tensors are
    skipped, a DCP chunk is refused: the metadata promised stored elements).
    """
    stored = _stored_elements(tensor)
    if stored is None or tensor.numel() <= stored:
        return None
    return f"an expanded view: {tensor.numel():,} elements over {stored:,} stored (a zero stride)"


def _tensor_skip_reason(
    node: _Node, tensor: Tensor, seen: dict[tuple[object, ...], str]
) -> str | None:
    """Why a tensor is not audited here (dtype and layout are left to the engine)."""
    if type(tensor) is not StoredTensor:
        torch = sys.modules["torch"]
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return f"tensor subclass {type(tensor).__name__}; not audited"
        if tensor.device.type == "meta":
            return "meta tensor (it holds no data); not audited"
    if node.in_optimizer_entry and tensor.dim() == 0 and (node.name or "").endswith(".step"):
        return "optimizer step counter; not audited"
    expanded = expanded_view(tensor)
    if expanded is not None:
        return f"{expanded}; not audited"
    key = _tensor_key(tensor)
    if key is not None and key in seen:
        return f"same data as {show(seen[key])} (tied or shared); audited once"
    return None


def walk_checkpoint(
    obj: object,
    source: str,
    select: Select | None = None,
    hints: dict[str, TensorHint] | None = None,
) -> Iterator[SourceItem]:
    """Yield every tensor of a loaded checkpoint by path name, and account for the rest.

    ``source`` labels the :class:`Skipped` entries; ``select`` sees the path name (without
    an optimizer annotation) and rejected names come out as :class:`Excluded`. ``hints``,
    when given, receives what the structure says about each yielded tensor (its role,
    its parameter, how to read a gradient estimate from it) before the tensor is yielded.
    """
    bearing = _tensor_bearing(obj)
    bookkeeping = _bookkeeping(obj)
    bearing -= bookkeeping.keys()  # listed, never entered: nothing in them is judged
    names = _Names()
    containers: dict[int, str] = {}
    tensors: dict[tuple[object, ...], str] = {}
    optimizers = _find_optimizers(obj, bearing)
    for node in _plan(obj, bearing, optimizers):
        value = node.value
        name = ROOT_NAME if node.name is None else node.name
        container_reason = None
        if _is_container(value):
            first = containers.setdefault(id(value), name)
            if first != name:
                container_reason = f"the same object as {show(first)}; listed once"
            elif id(value) in bookkeeping:
                container_reason = f"{bookkeeping[id(value)]}, not model state; not audited"
            elif node.name is not None and id(value) not in bearing:
                container_reason = f"{_describe(value)}, no tensor; not audited"
            elif node.depth >= MAX_DEPTH:
                container_reason = f"nested deeper than {MAX_DEPTH} levels; not searched"
            else:
                continue  # walked into: its contents speak for it
        if select is not None and not select(name):
            yield Excluded(name)
            continue
        shown = names.unique(name if node.param is None else f"{name} ({node.param})")
        if container_reason is not None:
            yield Skipped(shown, container_reason, source)
        elif is_tensor(value):
            reason = _tensor_skip_reason(node, value, tensors)
            if reason is not None:
                # A subclass or an expanded view is skipped with its values unread (a
                # ``skipped`` finding); the others hold no data of their own (meta, a step
                # counter, a tensor already audited).
                unread = reason.startswith(("tensor subclass", "an expanded view")) and (
                    _hides_values(value)
                )
                yield Skipped(shown, reason, source, unread)
                continue
            key = _tensor_key(value)
            if key is not None:
                tensors[key] = shown
            if type(value) is not StoredTensor and value.is_quantized:
                # Judged as the values it stands for: a NaN or Inf scale makes every value
                # NaN/Inf, which the integer codes alone would hide.
                value = value.dequantize()
            if hints is not None:
                hint = _role_hint(node, value, optimizers)
                if hint is not None:
                    hints[shown] = hint
            yield shown, value
        else:
            yield Skipped(shown, f"{_describe(value)}, not a tensor; not audited", source)


def iter_tensors(obj: object) -> Iterator[Tensor]:
    """Every tensor object in a loaded checkpoint (meta ones included), each container once."""
    for node in _plan(obj, _tensor_bearing(obj)):
        if is_tensor(node.value):
            yield node.value
