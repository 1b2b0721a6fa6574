"""Replicated gradients compared across ranks (or two ranks' dumps): the first that disagrees.

After DDP's all-reduce every rank holds the same gradient bits; a rank whose bits differ has
a bug (a missed all-reduce, a non-deterministic kernel, a replica that silently diverged).
Comparing the tensors themselves would cost a second full read and a transfer of every
gradient, so each rank compares a *digest* per tensor instead: the stats the engine already
computed in its one pass (the counts, the peak and the sum of squares), compared bit for bit.
Equal gradients give equal digests on ranks that run the same engine the same way (same
kernel path, same thread count: the float64 sum of squares is summed in a thread-dependent
order); different gradients give different digests unless the change leaves every count, the
peak and the sum of squares' bits unchanged (elements swapped, a sign flipped, a change below
the sum's last bit). fairseq compares one global norm across ranks with a 1e-6 tolerance;
this names the tensor.

:func:`first_divergence` is the one judge of digests: the monitor gives it the rows gathered
from every rank (:mod:`gradaudit.training.replicas`), ``compare`` the stats of its two sides
(:mod:`gradaudit.comparison.checks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ReplicaCheck", "ReplicaDivergence", "first_divergence"]


@dataclass(frozen=True)
class ReplicaDivergence:
    """Digests of replicated tensors that are not the same on every rank."""

    #: The first tensor (in parameter order) whose digest is not the same on every rank.
    tensor: str
    #: The ranks whose digest of :attr:`tensor` differs from the reference's.
    ranks: tuple[int, ...]
    #: The ranks that share the reference digest: the largest group (rank 0's on a tie).
    reference: tuple[int, ...]
    #: Every tensor whose digests differ, in parameter order (:attr:`tensor` first).
    tensors: tuple[str, ...]

    def describe(self) -> str:
        """One line: the first tensor, who differs from whom, and how many tensors differ."""
        ranks = ", ".join(map(str, self.ranks))
        reference = ", ".join(map(str, self.reference))
        more = len(self.tensors) - 1
        text = (
            f"replicated gradient {self.tensor} differs on rank{'s' if len(self.ranks) > 1 else ''}"
            f" {ranks} from rank{'s' if len(self.reference) > 1 else ''} {reference}"
        )
        return text + (f" (and {more} more tensor{'s' if more != 1 else ''})" if more else "")


@dataclass(frozen=True)
class ReplicaCheck:
    """One collected step's cross-rank check of replicated gradients."""

    #: The ranks compared (the size of the replicas' process group).
    world_size: int
    #: The tensors compared on every rank (every parameter of the model, with or without a
    #: gradient: a gradient present on one rank and absent on another also differs).
    compared: int
    #: The first disagreement, or ``None`` when every digest agrees.
    divergence: ReplicaDivergence | None = None

    @property
    def agree(self) -> bool:
        return self.divergence is None


def first_divergence(names: Sequence[str], digests: np.ndarray) -> ReplicaDivergence | None:
    """The first of ``names`` whose digest is not bit-identical on every rank, or ``None``.

    ``digests`` is ``[ranks, len(names), ...]`` of any dtype; entries are compared by their
    bytes (``-0.0`` differs from ``0.0``; a NaN equals the same NaN). The reference digest of
    the first differing tensor is the one most ranks hold (rank 0's on a tie); the other ranks
    are the ones that differ.
    """
    world = digests.shape[0]
    raw = np.ascontiguousarray(digests).view(np.uint8).reshape(world, len(names), -1)
    differs = (raw != raw[0]).any(axis=2).any(axis=0)
    where = np.flatnonzero(differs)
    if not len(where):
        return None
    first = int(where[0])
    keys = [raw[rank, first].tobytes() for rank in range(world)]
    groups: dict[bytes, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    # dicts keep first-seen order, so on a tie max() keeps rank 0's group
    reference = max(groups.values(), key=len)
    return ReplicaDivergence(
        tensor=names[first],
        ranks=tuple(rank for rank in range(world) if rank not in reference),
        reference=tuple(reference),
        tensors=tuple(names[i] for i in where.tolist()),
    )
