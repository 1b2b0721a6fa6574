"""Turning ``--device auto|cpu|cuda[:N]`` into a ``torch.device``, strictly."""

from __future__ import annotations

import torch

from gradaudit.errors import UsageError


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """Resolve a device request; an unavailable device is an error, never a silent CPU run.

    ``auto`` (or ``None``) picks the current CUDA device when CUDA is available
    and the CPU otherwise. ``meta`` is accepted for the library's tests of the
    no-sync guarantee.
    """
    text = str(spec) if isinstance(spec, torch.device) else (spec or "auto").strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {text!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type in ("cpu", "meta"):
        return device
    if device.type != "cuda":
        raise UsageError(f"unsupported device {text!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"device {text!r} requested but CUDA is not available on this machine")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise UsageError(f"device {text!r} requested but only {count} CUDA device(s) exist")
    return torch.device("cuda", index)


def stream_key(device: torch.device) -> int:
    """Which stream work on ``device`` is queued on now: CUDA's current stream id, else 0.

    Reused buffers (scratch, buckets) are kept per stream: a buffer shared by
    two streams could be overwritten by one while the other still reads it.
    """
    if device.type != "cuda":
        return 0
    return int(torch.cuda.current_stream(device).stream_id)
