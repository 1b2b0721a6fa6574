"""Gradient dumps: the files ``gradaudit scan`` reads, written from a live training loop."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeAlias, cast

import torch

from gradaudit import __version__
from gradaudit.engine.dtensor import is_dtensor
from gradaudit.io.safetensors_writer import build_header, layout_order, write_safetensors
from gradaudit.training.gradients import ParametersInput, named_gradients

__all__ = ["DUMP_SUFFIX", "RESERVED_METADATA", "DumpInput", "dump_metadata", "save_gradients"]

#: What :func:`save_gradients` accepts: a module or parameters (their gradients are
#: written), or named tensors (written as given; an ``nn.Parameter`` among them
#: stands for its gradient).
DumpInput: TypeAlias = ParametersInput | Iterable[tuple[str, torch.Tensor]]

#: The CLI reads dumps by this suffix.
DUMP_SUFFIX = ".safetensors"

#: Metadata keys :func:`save_gradients` writes itself; callers cannot override them.
RESERVED_METADATA = frozenset(
    {"format", "gradaudit_content", "gradaudit_version", "step", "time", "torch_version"}
)


def save_gradients(
    model_or_tensors: DumpInput,
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a safetensors gradient dump that ``gradaudit scan`` reads; return its path.

    * A module (or an iterable of parameters) writes the gradients of its
      parameters, by ``named_parameters()`` name; parameters without a gradient
      are left out. A mapping or iterable of ``(name, tensor)`` pairs writes the
      tensors as given, except that an ``nn.Parameter`` stands for its gradient.
    * ``__metadata__`` records ``step`` (when given), ``time`` (UTC, ISO 8601),
      ``torch_version``, ``gradaudit_version``, ``gradaudit_content: gradients``
      (so ``scan`` reads the dump as gradients) and ``format: pt``, plus
      ``metadata`` (strings to strings; the keys above are reserved).
    * Atomic: a crash never leaves a truncated file under ``path``.
    * Bounded host memory: tensors are moved to the host one at a time, in
      blocks of at most 64 MiB, whatever the device.
    * ``DTensor`` gradients are gathered one tensor at a time over their mesh
      (``full_tensor()``, a collective: call on every rank) and global rank 0
      writes the whole tensors; the other ranks write nothing.
    """
    target = Path(path)
    if not target.name.endswith(DUMP_SUFFIX):
        raise ValueError(f"{target}: a gradient dump must be named *{DUMP_SUFFIX}")
    tensors = dump_items(model_or_tensors)
    meta = dump_metadata(step, metadata)
    if not any(is_dtensor(tensor) for _, tensor in tensors):
        return write_safetensors(target, tensors, metadata=meta)

    import torch.distributed as dist

    for name, tensor in tensors:
        if is_dtensor(tensor) and 0 not in tensor.device_mesh.mesh.flatten().tolist():  # type: ignore[attr-defined]
            raise ValueError(f"tensor {name!r}: rank 0, which writes the dump, is not in its mesh")
    ordered = layout_order(tensors)
    build_header(ordered, meta)  # every rank refuses a bad input before any collective
    if dist.get_rank() == 0:
        return write_safetensors(target, tensors, metadata=meta, fetch=_whole)
    for _, tensor in ordered:
        _whole(tensor)  # take part in the gathers, in the writer's order
    return target


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    if is_dtensor(tensor):
        whole: torch.Tensor = tensor.full_tensor()  # type: ignore[attr-defined]
        return whole
    return tensor


def dump_items(model_or_tensors: DumpInput) -> list[tuple[str, torch.Tensor]]:
    """The named tensors a dump of ``model_or_tensors`` holds (see :func:`save_gradients`)."""
    if isinstance(model_or_tensors, torch.nn.Module):
        return named_gradients(model_or_tensors)
    source = model_or_tensors
    items = list(source.items() if isinstance(source, Mapping) else source)
    if all(isinstance(item, torch.Tensor) for item in items):
        return named_gradients(cast(list[torch.Tensor], items))  # bare parameters
    named: list[tuple[str, torch.Tensor]] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(
                "expected a module, parameters, or (name, tensor) pairs; "
                f"got an item of type {type(item).__name__}"
            )
        name, tensor = item
        if isinstance(tensor, torch.nn.Parameter):
            if tensor.grad is None:
                continue
            tensor = tensor.grad
        named.append((name, tensor))
    return named


def dump_metadata(step: int | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``__metadata__`` of a dump: what made it and when, then the caller's strings."""
    meta = {
        "format": "pt",
        # What the file holds, so `gradaudit scan` reads it as gradients (gradaudit.roles).
        "gradaudit_content": "gradients",
        "gradaudit_version": __version__,
        "torch_version": torch.__version__,
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
    }
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int; got {step!r}")
        meta["step"] = str(step)
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map strings to strings; got {key!r}: {value!r}")
        if key in RESERVED_METADATA:
            raise ValueError(f"metadata key {key!r} is written by gradaudit itself")
        meta[key] = value
    return meta
