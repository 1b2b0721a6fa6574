"""A DCP checkpoint's ``.metadata`` read without trusting it: a plain pickle, unpickled
under a budget by an unpickler that knows an explicit list of globals.

The metadata classes of ``torch.distributed.checkpoint`` and a few values (dtypes,
``torch.Size``, paths) are each mapped to an inert stand-in defined here (:class:`Record`):
nothing from torch's checkpoint classes, and nothing the file names, is imported or
called. Any other global is refused, named. What the records say (the storage map, each
tensor's chunks) is checked by :mod:`gradaudit.io.dcp`, which reads the data files.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from gradaudit.errors import InputError
from gradaudit.io.files import describe_os_error, open_checked
from gradaudit.io.layouts import METADATA_NAME
from gradaudit.io.pickle_budget import budget_problem

#: A ``.metadata`` larger than this is refused (a 400B-parameter model's is a few MB).
MAX_METADATA_BYTES = 512 << 20

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


class Record:
    """An inert stand-in for a pickled DCP dataclass.

    Its fields are kept in a dict of their own, never in ``__dict__``: a pickled state
    holding a key ``get`` must not replace the method that reads the fields.
    """

    _fields: dict[object, object]

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict | None):
            state = {**(state[0] or {}), **(state[1] or {})}
        fields = dict(state) if isinstance(state, dict) else {"_state": state}
        object.__setattr__(self, "_fields", fields)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("DCP metadata records are read-only")

    def get(self, field: str, default: object = None) -> Any:
        return vars(self).get("_fields", {}).get(field, default)


def _record_class(name: str) -> type[Record]:
    return type(name, (Record,), {})


_RECORDS = {
    (_DCP_METADATA, name): _record_class(name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
    )
}
_RECORDS[(_DCP_FILESYSTEM, "_StorageInfo")] = _record_class("_StorageInfo")


def _as_tuple(*args: object) -> tuple[object, ...]:
    """``torch.Size(seq)`` and friends: the values, as a plain tuple."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], list | tuple) else args


def _as_text(*args: object) -> str:
    """``pathlib.PosixPath(*parts)``, ``torch.serialization._get_layout(name)``: text."""
    return "/".join(str(a) for a in args)


def _as_value(value: object) -> object:
    """An enum member pickled as ``Enum(value)``: its value."""
    return value


_FUNCTIONS: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _as_tuple,
    ("torch.serialization", "_get_layout"): _as_text,
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): _as_value,
    ("pathlib", "PosixPath"): _as_text,
    ("pathlib", "WindowsPath"): _as_text,
    ("pathlib", "PurePosixPath"): _as_text,
    ("pathlib", "PureWindowsPath"): _as_text,
    ("collections", "OrderedDict"): dict,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Knows the globals a DCP ``.metadata`` uses and maps each to something inert here."""

    def find_class(self, module: str, name: str) -> Any:
        record = _RECORDS.get((module, name))
        if record is not None:
            return record
        function = _FUNCTIONS.get((module, name))
        if function is not None:
            return function
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP metadata")

    def persistent_load(self, pid: object) -> Any:
        raise pickle.UnpicklingError("persistent references are not part of DCP metadata")


def read_metadata(directory: str) -> Any:
    """The unpickled ``.metadata`` of ``directory`` (inert records); raises InputError."""
    path = os.path.join(directory, METADATA_NAME)
    handle, size = open_checked(path)
    with handle:
        if size > MAX_METADATA_BYTES:
            raise InputError(directory, f"{METADATA_NAME} is {size} bytes, absurdly large")
        try:
            raw = handle.read(MAX_METADATA_BYTES + 1)
        except OSError as error:
            raise InputError(directory, f"{METADATA_NAME}: {describe_os_error(error)}") from None
    problem = budget_problem(raw)
    if problem is not None:
        raise InputError(directory, f"{METADATA_NAME}: {problem}")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as error:
        raise InputError(
            directory, f"{METADATA_NAME} refused as unsafe or corrupt: {error}"
        ) from None
    except MemoryError:
        raise InputError(directory, f"{METADATA_NAME}: not enough memory to unpickle it") from None
    except Exception as error:  # noqa: BLE001 - hostile bytes: whatever the unpickler raises
        detail = " ".join(str(error).split())[:120]
        raise InputError(
            directory, f"{METADATA_NAME} is truncated or corrupt ({type(error).__name__}: {detail})"
        ) from None
    if type(metadata).__name__ != "Metadata" or not isinstance(metadata, Record):
        raise InputError(directory, f"{METADATA_NAME} does not hold DCP checkpoint metadata")
    return metadata
