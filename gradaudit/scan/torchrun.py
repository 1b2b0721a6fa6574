"""Whether this process is one rank of a ``torchrun`` job: read from the environment, no torch.

The CLI asks before it decides whether a scan can run without torch
(:mod:`gradaudit.scan.torch_free`); the distributed scan itself is
:mod:`gradaudit.scan.distributed`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gradaudit.errors import UsageError


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in a job started by ``torchrun`` (read from the environment)."""

    rank: int
    world_size: int
    local_rank: int


#: Programs that start each rank of a job themselves: ``torchrun`` and the launchers built
#: on torch's elastic agent (by file name, or as ``python -m`` modules).
LAUNCHER_PROGRAMS = frozenset({"torchrun", "deepspeed", "accelerate"})
LAUNCHER_MODULES = frozenset(
    {"torch.distributed.run", "torch.distributed.launch", "deepspeed.launcher.launch"}
)


def parent_command(pid: int | None = None) -> list[str] | None:
    """The argv of this process's parent (Linux ``/proc``), or ``None`` when unknown."""
    parent = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as handle:
            raw = handle.read(64 * 1024)
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def launched_as_rank(argv: Sequence[str] | None) -> bool:
    """Whether a parent running ``argv`` started this process as a rank of its job.

    A ``gradaudit scan`` run *from inside* a training job (a subprocess of one rank)
    inherits that rank's ``RANK``/``WORLD_SIZE``; joining would wait forever for ranks that
    never come. Only a launcher's direct child joins by itself: the parent's program
    (``torchrun``, or ``python /path/torchrun``) or its ``python -m`` module says so, never
    a word elsewhere in its arguments. Where the parent cannot be read (no ``/proc``), it
    is assumed to be one, as before.
    """
    if argv is None:
        return True
    head = argv[:2]
    if any(os.path.basename(arg) in LAUNCHER_PROGRAMS for arg in head):
        return True
    for index, arg in enumerate(argv[:4]):
        if arg == "-m":
            return index + 1 < len(argv) and argv[index + 1] in LAUNCHER_MODULES
    return False


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
