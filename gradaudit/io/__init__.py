"""Readers: files in, named tensors out, behind one :class:`TensorSource` protocol.

The reader is chosen by the file's name, never by its content alone, so a file is never
parsed as something more powerful than its name says (a ``.safetensors`` file is never
unpickled); when the content disagrees with the name, the reader says what it looks like.
"""

from __future__ import annotations

from pathlib import Path

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Select, SourceItem, TensorSource
from gradaudit.io.safetensors_header import check_regular_file
from gradaudit.io.safetensors_source import SafetensorsSource
from gradaudit.io.sniff import sniff
from gradaudit.io.torch_pickle import PICKLE_EXTENSIONS, TorchPickleSource

__all__ = ["Excluded", "Select", "SourceItem", "TensorSource", "open_source"]


def open_source(path: str | Path) -> TensorSource:
    """The reader for the file ``path``, chosen by its name; raises :class:`InputError`.

    ``.safetensors`` and the PyTorch pickle extensions ``.pt``, ``.pth``, ``.bin``,
    ``.ckpt`` are read.
    """
    text = str(path)
    check_regular_file(text)
    name = text.lower()
    if name.endswith(".safetensors"):
        return SafetensorsSource(text)
    if name.endswith(PICKLE_EXTENSIONS):
        return TorchPickleSource(text)
    looks = sniff(text).description
    hint = f"; it looks like {looks}" if looks else ""
    raise InputError(
        text, f"unsupported file type: gradaudit reads .safetensors, .pt, .pth, .bin, .ckpt{hint}"
    )
