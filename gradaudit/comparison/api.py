"""Host vs seed gradient intensity, and A vs B per parameter: the torch path.

Both sides are collected into ONE :class:`~gradaudit.scan.pending.PendingStats`, each
tensor labelled with its side (``"host"`` / ``"seed"``) as its ``source``, and
materialised once: a single device->host read for both sides together. Everything
after the reading is :mod:`gradaudit.comparison.files` (which imports no torch, and
serves the torch-free path of ``gradaudit compare`` too). Never prints, never exits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gradaudit.comparison.files import Side, build_comparison, compare_files
from gradaudit.engine.kernels import Engine
from gradaudit.engine.options import FROM_FILES, IN_MEMORY, EngineOptions, choose
from gradaudit.errors import InputError
from gradaudit.policy import Thresholds
from gradaudit.results.comparison import (
    HOST,
    SEED,
    ComparePolicy,
    Comparison,
    DualGradientStats,
)
from gradaudit.scan.pending import PendingStats
from gradaudit.scan.tensor_input import TensorInput

#: One side of an in-memory comparison: what ``audit`` accepts, or a module whose
#: parameters' ``.grad`` are compared (parameters without a gradient are left out).
CompareInput = TensorInput | torch.nn.Module


def _named(side: CompareInput) -> TensorInput:
    # A module is checked first: nn.Sequential is iterable, over its submodules.
    if isinstance(side, torch.nn.Module):
        return ((name, p.grad) for name, p in side.named_parameters() if p.grad is not None)
    return side


def compare(
    a: CompareInput,
    b: CompareInput,
    *,
    thresholds: Thresholds | None = None,
    policy: ComparePolicy | None = None,
    device: torch.device | str | None = None,
    chunk_elements: int | None = None,
    engine: Engine | str = Engine.AUTO,
    options: EngineOptions | None = None,
) -> Comparison:
    """Compare in-memory gradients: ``a`` is the host (A), ``b`` the seed (B).

    One device->host read for both sides. A side without any floating-point
    element raises :class:`InputError` (exit code 3); every other edge case is a
    defined result (see :class:`DualGradientStats`).
    """
    options = choose(options, EngineOptions(device, chunk_elements, engine), IN_MEMORY)
    pending = PendingStats(options=options)
    sides = (Side(HOST), Side(SEED))
    for side, tensors in zip(sides, (a, b), strict=True):
        pending.add_file(side.label)
        pending.add_all(_named(tensors), source=side.label)
    comparison = build_comparison(pending, sides, [], thresholds, policy)
    if comparison.errors:
        raise InputError(None, comparison.errors[0].message)
    return comparison


def dual_stats(
    host: CompareInput,
    seed: CompareInput,
    *,
    thresholds: Thresholds | None = None,
    device: torch.device | str | None = None,
    chunk_elements: int | None = None,
    options: EngineOptions | None = None,
) -> DualGradientStats:
    """Host and seed gradient norms, parameter counts and ratios, from one device->host read."""
    options = choose(options, EngineOptions(device, chunk_elements), IN_MEMORY)
    return compare(host, seed, thresholds=thresholds, options=options).dual


def compare_paths(
    host_path: str | Path,
    seed_path: str | Path | None = None,
    *,
    host_prefix: str | None = None,
    seed_prefix: str | None = None,
    thresholds: Thresholds | None = None,
    policy: ComparePolicy | None = None,
    device: torch.device | str | None = "auto",
    chunk_elements: int | None = None,
    engine: Engine | str = Engine.AUTO,
    options: EngineOptions | None = None,
) -> Comparison:
    """Compare two dumps, or the two prefixes of one dump (``seed_path=None``).

    With one file each tensor goes to the side whose prefix it starts with (the
    longer prefix wins, so ``host_prefix=""`` means "everything that is not the
    seed"); tensors matching neither are listed as skipped. With two files a
    prefix selects that file's side. A file that cannot be read, or a side left
    with nothing to audit, is recorded in ``errors`` (exit code 3) and the rest
    is still reported.
    """
    keywords = EngineOptions(device, chunk_elements, engine)
    pending = PendingStats(options=choose(options, keywords, FROM_FILES))
    return compare_files(
        pending,
        host_path,
        seed_path,
        host_prefix=host_prefix,
        seed_prefix=seed_prefix,
        thresholds=thresholds,
        policy=policy,
    )


__all__ = [
    "CompareInput",
    "compare",
    "compare_paths",
    "dual_stats",
]
