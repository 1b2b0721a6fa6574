"""Readers: files in, named tensors out, behind one :class:`TensorSource` protocol."""

from __future__ import annotations

from pathlib import Path

from gradaudit.errors import InputError
from gradaudit.io.base import Excluded, Select, SourceItem, TensorSource
from gradaudit.io.safetensors_header import check_regular_file
from gradaudit.io.safetensors_source import SafetensorsSource

__all__ = ["Excluded", "Select", "SourceItem", "TensorSource", "open_source"]


def open_source(path: str | Path) -> TensorSource:
    """The reader for ``path``, chosen by extension; raises :class:`InputError`."""
    text = str(path)
    check_regular_file(text)
    if text.endswith(".safetensors"):
        return SafetensorsSource(text)
    raise InputError(text, "unsupported file type: expected a .safetensors file")
