"""Recognising ``torch.distributed.tensor.DTensor`` without paying for its import."""

from __future__ import annotations

import sys

import torch


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2, tensor parallel).

    Importing ``torch.distributed.tensor`` costs about half a second, and no
    tensor can be a DTensor before something else imported it, so the class is
    looked up only where it is already loaded.
    """
    # torch >= 2.5 exports it from torch.distributed.tensor; 2.4 from ._tensor only (its
    # torch.distributed.tensor package exists there without the class).
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        cls = getattr(sys.modules.get(name), "DTensor", None)
        if cls is not None:
            return isinstance(tensor, cls)
    return False
