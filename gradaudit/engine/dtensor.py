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
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
