"""What the in-memory API takes (``audit``, ``collect_async``, ``compare``'s sides): a
mapping of names to tensors or an iterable of ``(name, tensor)`` pairs, split into a
column of names and a column of tensors.

Apart from :class:`~gradaudit.scan.pending.PendingStats`, which queues the columns: how a
caller's input becomes them, checked and fast for a monitor's every step, is this
module's job.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

#: What ``audit`` and ``collect_async`` accept: a mapping of names to tensors
#: (a state dict) or an iterable of ``(name, tensor)`` pairs.
TensorInput = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _named(tensors: TensorInput) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tensors, Mapping):
        yield from tensors.items()
        return
    for item in tensors:
        name, tensor = item
        yield str(name), tensor


def _split(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor]]:
    """The names (``str()`` of each) and the tensors of ``(name, tensor)`` pairs, as
    :func:`_named` gives them, in C loops where every item is a pair: a Python step per
    item was ~0.3 us a tensor on each of a monitor's steps (issue 28 item 9)."""
    items = list(tensors)
    try:
        pairs = set(map(len, items)) == {2}
    except TypeError:  # an item with no length: _named says what is wrong
        pairs = False
    if not pairs:
        named = list(_named(items))
        return [name for name, _ in named], [tensor for _, tensor in named]
    firsts, values = zip(*items, strict=True)
    # Names are nearly always str already: one type check in C, not a str() call each.
    names = list(firsts) if set(map(type, firsts)) == {str} else list(map(str, firsts))
    return names, list(values)


def names_and_tensors(tensors: TensorInput) -> tuple[list[str], list[torch.Tensor]]:
    """The names and the tensors of ``tensors``, as two lists in the same order."""
    if isinstance(tensors, Mapping):
        return list(tensors.keys()), list(tensors.values())
    return _split(tensors)
