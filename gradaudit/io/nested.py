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

An optimizer state tensor's name gets its parameter in parentheses where the checkpoint
ties the two without guessing (``optimizer.state.3.exp_avg (encoder.weight)``; the rules
and each tensor's role hint: :mod:`gradaudit.io.optimizer_state`). ``--include``/
``--exclude`` patterns are matched against the path name, without the parenthesised
parameter. The tree itself (containers, children, the walk's plan) is
:mod:`gradaudit.io.checkpoint_tree`.

**Without torch.** The same walk serves the structure :mod:`gradaudit.io.zip_checkpoint`
unpickles without torch, whose tensors are :class:`~gradaudit.io.zip_checkpoint.StoredTensor`
records: every question asked of a tensor
(:func:`~gradaudit.io.checkpoint_tree.is_tensor`, :func:`_tensor_key`,
:func:`_stored_elements` ...) has the same answer for both, so the names, skips and hints
of both scan paths are one implementation. This module never imports torch: a
``torch.Tensor`` can only exist once torch is imported, so it is looked up in
``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from gradaudit.io.base import Excluded, Select, SourceItem
from gradaudit.io.checkpoint_tree import (
    MAX_DEPTH,
    Node,
    Tensor,
    is_container,
    is_tensor,
    plan,
    tensor_bearing,
)
from gradaudit.io.files import show
from gradaudit.io.optimizer_state import find_optimizers, role_hint
from gradaudit.io.zip_checkpoint import StoredTensor
from gradaudit.results import Skipped
from gradaudit.results.roles import TensorHint

#: The name of a tensor saved on its own (``torch.save(tensor, path)``).
ROOT_NAME = "<root>"


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
        if key in root and is_container(root[key]) and key != "callbacks"
    }
    callbacks = root.get("callbacks")
    if isinstance(callbacks, dict):
        # A callback that holds only scalars keeps scores and counters (ModelCheckpoint's
        # kth_value, EarlyStopping's best_score); one that holds real tensors (an EMA or
        # weight-averaging callback's copy of the model) is model state and is walked.
        scalar_only = {
            key: value
            for key, value in callbacks.items()
            if is_container(value) and all(t.dim() == 0 for t in iter_tensors(value))
        }
        if len(scalar_only) == len(callbacks):
            found[id(callbacks)] = LIGHTNING_BOOKKEEPING["callbacks"]
        else:
            found.update({id(v): LIGHTNING_BOOKKEEPING["callbacks"] for v in scalar_only.values()})
    return found


def _describe(value: object) -> str:
    """A short description of a value that is not audited, for its skip reason."""
    if isinstance(value, dict):
        return f"dict of {len(value)} {'entry' if len(value) == 1 else 'entries'}"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)} value{'' if len(value) == 1 else 's'}"
    return f"{type(value).__name__} value"


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
    node: Node, tensor: Tensor, seen: dict[tuple[object, ...], str]
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
    bearing = tensor_bearing(obj)
    bookkeeping = _bookkeeping(obj)
    bearing -= bookkeeping.keys()  # listed, never entered: nothing in them is judged
    names = _Names()
    containers: dict[int, str] = {}
    tensors: dict[tuple[object, ...], str] = {}
    optimizers = find_optimizers(obj, bearing)
    for node in plan(obj, bearing, optimizers.entry_ids, optimizers.params):
        value = node.value
        name = ROOT_NAME if node.name is None else node.name
        container_reason = None
        if is_container(value):
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
                hint = role_hint(node, value, optimizers)
                if hint is not None:
                    hints[shown] = hint
            yield shown, value
        else:
            yield Skipped(shown, f"{_describe(value)}, not a tensor; not audited", source)


def iter_tensors(obj: object) -> Iterator[Tensor]:
    """Every tensor object in a loaded checkpoint (meta ones included), each container once."""
    for node in plan(obj, tensor_bearing(obj)):
        if is_tensor(node.value):
            yield node.value
