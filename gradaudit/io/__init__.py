"""Readers: files in, named tensors out, behind one :class:`TensorSource` protocol.

The reader is chosen by the file's name, never by its content alone, so a file is never
parsed as something more powerful than its name says (a ``.safetensors`` file is never
unpickled); when the content disagrees with the name, the reader says what it looks like.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradaudit.errors import InputError
from gradaudit.io.discover import KNOWN_SUFFIXES, expand_inputs, input_kind
from gradaudit.io.files import check_regular_file
from gradaudit.io.layouts import is_dcp_directory, is_deepspeed_checkpoint, is_trainer_checkpoint
from gradaudit.io.sniff import describe_zip, sniff
from gradaudit.io.trainer_state import TrainerStateSource

if TYPE_CHECKING:
    from gradaudit.io.base import Excluded, Select, SourceItem, TensorSource

__all__ = [
    "KNOWN_SUFFIXES",
    "Excluded",
    "Select",
    "SourceItem",
    "TensorSource",
    "expand_inputs",
    "open_source",
]


if not TYPE_CHECKING:  # mypy sees the names above; nothing else resolves here

    def __getattr__(name: str) -> Any:
        """The protocol's names (:mod:`gradaudit.io.base`, which needs torch) on first use.

        Importing this package, :func:`expand_inputs` and the header readers need no torch:
        the torch-free scan (:mod:`gradaudit.scan.torch_free`) and the CLI's start-up use them.
        """
        if name in ("Excluded", "Select", "SourceItem", "TensorSource"):
            from gradaudit.io import base

            return getattr(base, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_source(path: str | Path) -> TensorSource:
    """The reader for the file ``path``, chosen by its name; raises :class:`InputError`.

    ``.safetensors``, ``*.safetensors.index.json`` (a sharded checkpoint), the PyTorch
    pickle extensions ``.pt``, ``.pth``, ``.bin``, ``.ckpt`` and ``torch.distributed.checkpoint``
    directories (a ``.metadata`` file and ``*.distcp`` data) and ``transformers`` Trainer
    checkpoint directories (``trainer_state.json`` beside the model) and DeepSpeed ZeRO 1/2
    checkpoint directories (``mp_rank_00_model_states.pt`` and the optimizer partitions) are
    read. Directories are expanded by :func:`expand_inputs` first.
    """
    # The readers need torch: imported here, when a file is opened.
    text = str(path)
    if is_dcp_directory(text):
        from gradaudit.io.dcp import DcpSource

        return DcpSource(text)
    if is_trainer_checkpoint(text):
        from gradaudit.io.hf_checkpoint import TrainerCheckpointSource

        return TrainerCheckpointSource(text)
    if is_deepspeed_checkpoint(text):
        from gradaudit.io.deepspeed import DeepSpeedSource

        return DeepSpeedSource(text)
    check_regular_file(text)
    kind = input_kind(text)
    if kind == "index":
        from gradaudit.io.sharded import ShardedSource

        return ShardedSource(text)
    if kind == "safetensors":
        from gradaudit.io.safetensors_source import SafetensorsSource

        return SafetensorsSource(text)
    if kind == "trainer_state":
        return TrainerStateSource(text)
    if kind == "pickle":
        from gradaudit.io.torch_pickle import TorchPickleSource

        return TorchPickleSource(text)
    sniffed = sniff(text)
    looks = describe_zip(text) if sniffed.kind == "zip" else sniffed.description
    hint = f"; it looks like {looks}" if looks else ""
    if text.lower().endswith(".index.json"):
        hint = "; only safetensors indexes are read: pass the shard files or their directory"
    raise InputError(
        text, f"unsupported file type: gradaudit reads {', '.join(KNOWN_SUFFIXES)} files{hint}"
    )
