"""Cross-rank consistency of DDP's replicated gradients: one all-gather of digests per audit.

After ``backward()`` DDP has all-reduced every gradient, so every rank of its process group
must hold the same bits. Each rank's digest of a gradient is its stats row (the counts, the
peak, the scale and the float64 sum of squares the engine computed in its one pass over it:
no second read); :func:`gather_digests` all-gathers the ``[parameters, 7]`` float64 rows of
every rank, on the device and without a host read (about 56 bytes per parameter per rank),
and :meth:`GatheredDigests.read` judges them with
:func:`~gradaudit.results.replicas.first_divergence` after the monitor's one host read.

Only DDP's gradients are known to be replicated: the check runs for a
``DistributedDataParallel`` model whose process group has more than one rank, over that
group. Sharded gradients (``DTensor``, FSDP, ``group=`` shards) differ across ranks by design
and are not checked. Collective: every rank calls it, with the same parameters in the same
order (DDP checks that at construction).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradaudit.engine.stats import ROW_WIDTH
from gradaudit.results.replicas import ReplicaCheck, first_divergence
from gradaudit.scan.pending import PendingStats
from gradaudit.training.gradients import unwrap_module

__all__ = [
    "GatheredDigests",
    "gather_digests",
    "model_device",
    "replica_group",
    "replicating_wrapper",
]

#: The digest of a parameter that has no audited gradient on a rank (``None``, or a dtype
#: the engine does not audit): no stats row holds a negative count.
_ABSENT = -1.0


def replica_group(model: object, group: object | None) -> dist.ProcessGroup | None:
    """The process group over which ``model``'s gradients are replicated, or ``None``.

    That is a ``DistributedDataParallel``'s own ``process_group`` when it has more than one
    rank and no ``group=`` says the gradients are shards. Any other model is not known to
    be replicated (the module DDP wraps, parameters, a mapping: pass the DDP wrapper).
    """
    if group is not None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    replicas: dist.ProcessGroup = model.process_group
    return replicas if dist.get_world_size(replicas) > 1 else None


def replicating_wrapper(
    candidates: Iterable[object], parameters: Iterable[torch.Tensor]
) -> torch.nn.parallel.DistributedDataParallel | None:
    """The first ``DistributedDataParallel`` of ``candidates`` that holds every one of
    ``parameters``, or ``None``.

    A framework callback watches the module DDP wraps (the Trainer's ``model``, a
    LightningModule's parameters per optimizer, the model an ``Accelerator`` prepared) while
    the framework keeps the wrapper elsewhere (``trainer.model_wrapped``,
    ``trainer.strategy.model``, ``accelerator._models``): its gradients are replicated when the
    wrapper's all-reduce covers each of them, which is what this checks (by identity).
    """
    wanted = {id(p) for p in parameters}
    wrappers = [c for c in candidates if isinstance(c, torch.nn.parallel.DistributedDataParallel)]
    for wrapper in wrappers:
        if wanted <= {id(p) for p in wrapper.parameters()}:
            return wrapper
    return None


@dataclass(frozen=True)
class GatheredDigests:
    """Every rank's digests of every parameter, on the device until :meth:`read`."""

    names: tuple[str, ...]
    #: ``[ranks, parameters, 7]`` float64, on the device of the gradients.
    rows: torch.Tensor

    def read(self) -> ReplicaCheck:
        """Read the digests back (after the stats rows' read: nothing left to wait for) and
        judge them."""
        host = self.rows.cpu().numpy()
        world = host.shape[0]
        return ReplicaCheck(world, len(self.names), first_divergence(self.names, host))


def gather_digests(
    pending: PendingStats, names: list[str], group: dist.ProcessGroup, device: torch.device
) -> GatheredDigests:
    """All-gather each rank's stats rows of ``names`` over ``group`` (collective).

    ``pending`` holds this rank's audited gradients (a parameter missing from it gets the
    digest of an absent gradient); ``device`` is where the digests travel when it holds
    none (the parameters' device: NCCL gathers CUDA tensors only).
    """
    index = {name: position for position, name in enumerate(names)}
    rows = pending.rows
    local = torch.full((len(names), ROW_WIDTH), _ABSENT, dtype=torch.float64, device=device)
    if rows:
        device = rows[0].device
        local = local.to(device)
        where = [index[entry.name] for entry in pending.entries]
        local[torch.tensor(where, dtype=torch.long, device=device)] = torch.stack(
            [row.to(device) for row in rows]
        )
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    return GatheredDigests(tuple(names), torch.stack(parts))


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the first parameter of ``model`` (the CPU for a model without any)."""
    first = next(unwrap_module(model).parameters(), None)
    return torch.device("cpu") if first is None else first.device
