"""What a path looks like, from its name and ``stat`` alone: the checkpoint layouts the
readers take, without importing the readers.

Directory expansion (:mod:`gradaudit.io.discover`), the progress bar's byte count and the
torch-free scan (:mod:`gradaudit.scan.torch_free`) need these answers; the readers that
load such checkpoints need torch. Each reader module re-exports its own names from here.
"""

from __future__ import annotations

import os
import re
import stat

#: ``torch.save`` file endings (read by :mod:`gradaudit.io.torch_pickle`).
PICKLE_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt")

#: The metadata file's name inside a DCP directory (:mod:`gradaudit.io.dcp`).
METADATA_NAME = ".metadata"
#: The data files' ending (``__0_0.distcp``).
DATA_SUFFIX = ".distcp"

#: DeepSpeed's model states file (:mod:`gradaudit.io.deepspeed`).
MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(?:[a-z0-9]+_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")

#: The file that marks a Trainer checkpoint directory (:mod:`gradaudit.io.hf_checkpoint`).
TRAINER_STATE = "trainer_state.json"
#: Model files, in the order they are looked for (the first present is read).
MODEL_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")


def is_file(path: str) -> bool:
    """Whether ``path`` is a regular file (symlinks followed; ``stat`` only)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_dcp_directory(path: str) -> bool:
    """Whether ``path`` is a directory holding a DCP ``.metadata`` file (``stat`` only)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode) and os.path.lexists(
            os.path.join(path, METADATA_NAME)
        )
    except (OSError, ValueError):
        return False


def optim_files(directory: str) -> list[tuple[int, str]]:
    """``(rank, file name)`` of the ZeRO optimizer partitions in ``directory``, by rank."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _OPTIM.match(n))]
    return sorted(found)


def is_deepspeed_checkpoint(path: str) -> bool:
    """A directory with DeepSpeed's model states and at least one ZeRO optimizer partition."""
    return is_file(os.path.join(path, MODEL_STATES)) and bool(optim_files(path))


def is_trainer_checkpoint(path: str) -> bool:
    """A directory with ``trainer_state.json`` and a model file (``stat`` only)."""
    return is_file(os.path.join(path, TRAINER_STATE)) and any(
        is_file(os.path.join(path, name)) for name in MODEL_FILES
    )
