"""Whether this process is one rank of a ``torchrun`` job: read from the environment, no torch.

The CLI asks before it decides whether a scan can run without torch
(:mod:`gradaudit.scan.torch_free`); the distributed scan itself is
:mod:`gradaudit.scan.distributed`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gradaudit.errors import UsageError


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a job started by ``torchrun`` (read from the environment)."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The job this process belongs to, or ``None`` when it runs alone.

    ``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (and the
    rendezvous address) for every worker. A world of one is a plain run.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank = int(env["RANK"])
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise UsageError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be integers "
            f"(got RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r})"
        ) from None
    if world_size <= 1:
        return None
    if not 0 <= rank < world_size or local_rank < 0:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    return TorchrunEnv(rank=rank, world_size=world_size, local_rank=local_rank)
