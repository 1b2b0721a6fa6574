"""Readers: files in, named tensors out, behind one :class:`TensorSource` protocol.

The reader is chosen by the file's name, never by its content alone, so a file is never
parsed as something more powerful than its name says (a ``.safetensors`` file is never
unpickled); when the content disagrees with the name, the reader says what it looks like.
"""

from __future__ import annotations

from pathlib import Path

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Select, SourceItem, TensorSource
from gradaudit.io.dcp import DcpSource, is_dcp_directory
from gradaudit.io.deepspeed import DeepSpeedSource, is_deepspeed_checkpoint
from gradaudit.io.discover import KNOWN_SUFFIXES, expand_inputs, input_kind
from gradaudit.io.files import check_regular_file
from gradaudit.io.hf_checkpoint import TrainerCheckpointSource, is_trainer_checkpoint
from gradaudit.io.safetensors_source import SafetensorsSource
from gradaudit.io.sharded import ShardedSource
from gradaudit.io.sniff import sniff
from gradaudit.io.torch_pickle import TorchPickleSource

__all__ = [
    "KNOWN_SUFFIXES",
    "Excluded",
    "Select",
    "SourceItem",
    "TensorSource",
    "expand_inputs",
    "open_source",
]


def open_source(path: str | Path) -> TensorSource:
    """The reader for the file ``path``, chosen by its name; raises :class:`InputError`.

    ``.safetensors``, ``*.safetensors.index.json`` (a sharded checkpoint), the PyTorch
    pickle extensions ``.pt``, ``.pth``, ``.bin``, ``.ckpt`` and ``torch.distributed.checkpoint``
    directories (a ``.metadata`` file and ``*.distcp`` data) and ``transformers`` Trainer
    checkpoint directories (``trainer_state.json`` beside the model) and DeepSpeed ZeRO 1/2
    checkpoint directories (``mp_rank_00_model_states.pt`` and the optimizer partitions) are
    read. Directories are expanded by :func:`expand_inputs` first.
    """
    text = str(path)
    if is_dcp_directory(text):
        return DcpSource(text)
    if is_trainer_checkpoint(text):
        return TrainerCheckpointSource(text)
    if is_deepspeed_checkpoint(text):
        return DeepSpeedSource(text)
    check_regular_file(text)
    kind = input_kind(text)
    if kind == "index":
        return ShardedSource(text)
    if kind == "safetensors":
        return SafetensorsSource(text)
    if kind == "pickle":
        return TorchPickleSource(text)
    looks = sniff(text).description
    hint = f"; it looks like {looks}" if looks else ""
    if text.lower().endswith(".index.json"):
        hint = "; only safetensors indexes are read: pass the shard files or their directory"
    raise InputError(
        text, f"unsupported file type: gradaudit reads {', '.join(KNOWN_SUFFIXES)} files{hint}"
    )
