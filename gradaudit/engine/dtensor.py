"""Recognising ``torch.distributed.tensor.DTensor`` without paying for its import."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable

import torch


def dtensor_class() -> type | None:
    """The ``DTensor`` class where it is already imported, else ``None`` (no tensor can be
    one then): importing ``torch.distributed.tensor`` costs about half a second."""
    # torch >= 2.5 exports it from torch.distributed.tensor; 2.4 from ._tensor only (its
    # torch.distributed.tensor package exists there without the class).
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls: type | None = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return cls
    return None


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2, tensor parallel); see :func:`dtensor_class`."""
    cls = dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def any_dtensor(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a ``DTensor``: the class looked up once, not per tensor
    (a training loop asks about every gradient at every collected step)."""
    cls = dtensor_class()
    # map in C: a generator's Python step per tensor was ~0.1 us a gradient (issue 28).
    return cls is not None and any(map(isinstance, tensors, itertools.repeat(cls)))
