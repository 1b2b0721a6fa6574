"""The structure of a loaded checkpoint: containers, their children, names by path, and a
depth-first plan of the walk that enters each tensor-bearing container once.

Shared by the walk that names every tensor (:mod:`gradaudit.io.nested`) and the search
for optimizer state in the same structure (:mod:`gradaudit.io.optimizer_state`), so both
see one tree. The tensors are ``torch.Tensor`` objects or the
:class:`~gradaudit.io.zip_checkpoint.StoredTensor` records of the torch-free reader; torch
is never imported here (a ``torch.Tensor`` can only exist once it is, so it is looked up
in ``sys.modules``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from gradaudit.io.zip_checkpoint import StoredTensor

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


def is_floating(tensor: Tensor) -> bool:
    if type(tensor) is StoredTensor:
        return tensor.is_floating_point
    return bool(tensor.dtype.is_floating_point)


def is_container(value: object) -> bool:
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


def child_name(parent: str | None, key: object) -> str:
    text = _key_text(key)
    return text if parent is None else f"{parent}.{text}"


def children(value: object) -> list[tuple[object, object]]:
    """``(key, child)`` pairs of a container, in their stored order."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list | tuple):
        return list(enumerate(value))
    return []


def tensor_bearing(root: object) -> set[int]:
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
            if any(is_tensor(child) or id(child) in bearing for _, child in children(value)):
                bearing.add(id(value))
            continue
        if not is_container(value) or id(value) in entered:
            continue
        entered.add(id(value))
        stack.append((value, True))
        stack.extend((child, False) for _, child in children(value) if is_container(child))
    return bearing


@dataclass(frozen=True)
class Node:
    name: str | None  # None for the root
    value: object
    depth: int
    #: The parameter an optimizer state entry belongs to, inherited by what it holds.
    param: str | None = None
    #: Whether this node sits directly in an optimizer's per-parameter state entry.
    in_optimizer_entry: bool = False
    #: The id of that state entry (to find its param group and step), when it does.
    entry: int | None = None


def plan(
    root: object,
    bearing: set[int],
    entry_ids: frozenset[int] = frozenset(),
    params: Mapping[int, str] | None = None,
) -> Iterator[Node]:
    """Visit the root and the children of every tensor-bearing container, depth first, in order.

    Tensor-free containers and leaves are yielded but not entered; a container reached a
    second time is yielded again (the caller reports it) but not entered again.
    ``entry_ids`` are the optimizer state entries and ``params`` their parameters
    (:func:`gradaudit.io.optimizer_state.find_optimizers`), which the nodes below inherit.
    """
    params = params or {}
    entered: set[int] = set()
    stack = [Node(None, root, 0)]
    while stack:
        node = stack.pop()
        yield node
        value = node.value
        if not is_container(value) or id(value) in entered or node.depth >= MAX_DEPTH:
            continue
        if node.name is not None and id(value) not in bearing:
            continue
        entered.add(id(value))
        is_entry = id(value) in entry_ids
        param = params.get(id(value), node.param)
        entry = id(value) if is_entry else None
        stack.extend(
            reversed(
                [
                    Node(child_name(node.name, key), child, node.depth + 1, param, is_entry, entry)
                    for key, child in children(value)
                ]
            )
        )
