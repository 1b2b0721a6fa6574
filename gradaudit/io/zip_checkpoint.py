"""A zip ``torch.save`` checkpoint read without torch, when its pickle is plain enough.

``import torch`` costs seconds; a 28 KB ``model.pt`` takes milliseconds to audit. Most
checkpoints hold nothing but tensors in dicts, lists and tuples with a few plain values
(numbers, strings, ``None``), and reading those needs no torch: the tensors' bytes are
zip members stored raw, and ``data.pkl`` only says which member, dtype, offset, shape
and strides each tensor has. So this module reads ``data.pkl`` with an unpickler that
knows a short, explicit list of globals and maps each to something inert defined here:

* ``collections.OrderedDict`` (the state dict itself), the real class: it runs no code
  from the file;
* ``torch._utils._rebuild_tensor_v2`` and ``_rebuild_tensor_v3`` (a tensor over a storage,
  no backward hooks, no metadata), which build a :class:`StoredTensor` record;
* the storage types of the persistent ids, ``torch.FloatStorage`` ... ``torch.BoolStorage``
  (:data:`TYPED_STORAGES`) and ``torch.storage.UntypedStorage`` with a dtype global from
  :data:`DTYPE_SIZES`, which become a dtype name.

Anything else (another global, a tensor subclass or ``nn.Parameter``, a complex or exotic
dtype, a ``torch.Size``, a set, a big-endian file, a storage that does not lie exactly on
its zip member, a view that reaches past its storage) raises :class:`NotTorchFree`: the
caller then reads the file with torch (:mod:`gradaudit.io.torch_pickle`), whose checks
and messages are the one implementation of what is wrong with such a file. Nothing here
decides a file is corrupt that the torch path would read; it only declines to read what
it is not sure of. Nothing named by the file is imported or called.

The container is checked first by the torch path's own code (:func:`inspect_torch_zip`:
CRCs, member kinds) and the pickle under the same budget (:mod:`gradaudit.io.pickle_budget`),
so those refusals are the same words on both paths.
"""

from __future__ import annotations

import collections
import io
import mmap
import os
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradaudit.errors import InputError
from gradaudit.io.files import FileIdentity, open_checked
from gradaudit.io.mapguard import MapGuard, release_and_check, same_file
from gradaudit.io.pickle_budget import budget_problem
from gradaudit.io.torch_zip import Member, TorchZip

__all__ = [
    "DTYPE_SIZES",
    "TYPED_STORAGES",
    "MappedZipCheckpoint",
    "NotTorchFree",
    "StoredStorage",
    "StoredTensor",
]


class NotTorchFree(Exception):
    """The checkpoint holds something only torch reads as it should: read it with torch."""


#: ``torch.<Name>Storage`` globals of a ``_rebuild_tensor_v2`` persistent id -> dtype name.
TYPED_STORAGES: dict[str, str] = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}

#: Dtype names this reader knows, with their sizes in bytes (torch's spelling). Complex
#: dtypes, the fp8 ``fnuz`` and ``e8m0`` formats, fp4 and quantized ones are not here.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
}

#: The pickle opcodes read here: those torch's weights-only loader supports (it refuses a
#: protocol-4 ``FRAME`` that Python's unpickler would read), less ``EMPTY_SET`` and
#: ``SHORT_BINSTRING``, which no ``torch.save`` writes.
TORCH_OPCODES = frozenset(
    {
        "PROTO",
        "STOP",
        "GLOBAL",
        "NEWOBJ",
        "REDUCE",
        "BUILD",
        "APPEND",
        "APPENDS",
        "SETITEM",
        "SETITEMS",
        "MARK",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "NONE",
        "NEWFALSE",
        "NEWTRUE",
        "EMPTY_TUPLE",
        "EMPTY_LIST",
        "EMPTY_DICT",
        "BININT",
        "BININT1",
        "BININT2",
        "BINFLOAT",
        "BINUNICODE",
        "BINPERSID",
        "BINGET",
        "LONG_BINGET",
        "BINPUT",
        "LONG_BINPUT",
        "LONG1",
    }
)

_FLOATING = frozenset({"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


class _Inert:
    """Records the pickle may not modify: ``BUILD`` on one is refused, not applied (a
    frozen dataclass alone would not stop it: ``BUILD`` writes ``__dict__`` directly)."""

    def __setstate__(self, state: object) -> None:
        raise NotTorchFree("state set on a tensor or storage")


@dataclass(frozen=True)
class _StorageType(_Inert):
    """A storage-type global: the dtype of a typed storage, or ``None`` (untyped: bytes)."""

    dtype: str | None


@dataclass(frozen=True)
class _Dtype(_Inert):
    """A ``torch.<dtype>`` global (the dtype argument of ``_rebuild_tensor_v3``)."""

    name: str


@dataclass(frozen=True, eq=False)
class StoredStorage(_Inert):
    """One storage of ``data.pkl``: its zip member ``data/<key>``, its size in bytes, and
    the dtype of a typed storage (``None``: untyped, the tensor names its dtype)."""

    key: str
    nbytes: int
    typed: str | None


@dataclass(frozen=True, eq=False)
class StoredTensor(_Inert):
    """A tensor of ``data.pkl``: a strided view of a storage, by dtype name, in elements.

    The questions :mod:`gradaudit.io.nested` asks of a tensor have the same answers here
    as for the tensor torch would load (:meth:`dim`, :meth:`numel`, :meth:`key` ...).
    """

    storage: StoredStorage
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def is_floating_point(self) -> bool:
        return self.dtype in _FLOATING

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def stored_elements(self) -> int:
        """Elements the storage holds (fewer than :meth:`numel`: an expanded view)."""
        return self.storage.nbytes // self.itemsize

    def key(self) -> tuple[object, ...] | None:
        """What makes two tensors the same data (``nested._tensor_key``'s torch answer)."""
        if not self.numel():
            return None
        return (id(self.storage), self.offset, self.shape, self.stride, self.dtype)

    def span(self) -> int:
        """Elements from the first to one past the last the view reads (0 when empty)."""
        if not self.numel():
            return 0
        return 1 + sum((n - 1) * step for n, step in zip(self.shape, self.stride, strict=True))

    def is_contiguous(self) -> bool:
        """torch's rule: dimensions of size 1 may have any stride."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _check_ints(values: object) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not all(type(v) is int and v >= 0 for v in values):
        raise NotTorchFree("a tensor's size or stride is not a tuple of counts")
    return values


def _rebuild(storage: object, args: tuple[object, ...], dtype: str | None) -> StoredTensor:
    """``args``: offset, size, stride, requires_grad, backward hooks[, metadata]."""
    offset, size, stride, requires_grad, hooks = args[:5]
    metadata = args[5] if len(args) > 5 else None
    if not isinstance(storage, StoredStorage) or type(offset) is not int or offset < 0:
        raise NotTorchFree("a tensor without a plain storage")
    if type(requires_grad) is not bool or hooks not in ({}, None) or metadata not in ({}, None):
        raise NotTorchFree("a tensor with backward hooks or metadata")
    shape, strides = _check_ints(size), _check_ints(stride)
    if dtype is None or dtype not in DTYPE_SIZES or len(shape) != len(strides):
        raise NotTorchFree("a tensor of an unknown dtype or rank")
    return StoredTensor(storage, dtype, offset, shape, strides)


def _rebuild_v2(storage: object, *args: object) -> StoredTensor:
    """``torch._utils._rebuild_tensor_v2``: the dtype is the typed storage's."""
    if not isinstance(storage, StoredStorage) or len(args) not in (5, 6):
        raise NotTorchFree("an unexpected _rebuild_tensor_v2 call")
    return _rebuild(storage, args, storage.typed)


def _rebuild_v3(storage: object, *args: object) -> StoredTensor:
    """``torch._utils._rebuild_tensor_v3``: the dtype is an argument, the storage untyped."""
    if not isinstance(storage, StoredStorage) or len(args) not in (6, 7):
        raise NotTorchFree("an unexpected _rebuild_tensor_v3 call")
    dtype = args[5]
    if not isinstance(dtype, _Dtype) or storage.typed is not None:
        raise NotTorchFree("an unexpected _rebuild_tensor_v3 call")
    return _rebuild(storage, (*args[:5], *args[6:]), dtype.name)


_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    **{("torch", name): _StorageType(dtype) for name, dtype in TYPED_STORAGES.items()},
    **{("torch", name): _Dtype(name) for name in DTYPE_SIZES},
}

#: Values a checkpoint may hold besides tensors and the containers.
_PLAIN = (str, int, float, bool, bytes, type(None))


class _Unpickler(pickle.Unpickler):
    """Knows :data:`_GLOBALS`; a storage's persistent id becomes a :class:`StoredStorage`."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, StoredStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise NotTorchFree(f"global {module}.{name}")
        return found

    def persistent_load(self, pid: object) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise NotTorchFree("an unknown persistent id")
        _, kind, key, location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str):
            raise NotTorchFree("an unknown storage type")
        if not isinstance(location, str) or not (location == "cpu" or location.startswith("cuda")):
            raise NotTorchFree("a storage on an unknown device")
        if type(numel) is not int or numel < 0:
            raise NotTorchFree("a storage of no size")
        nbytes = numel if kind.dtype is None else numel * DTYPE_SIZES[kind.dtype]
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = StoredStorage(key, nbytes, kind.dtype)
        elif storage.nbytes != nbytes or storage.typed != kind.dtype:
            raise NotTorchFree("one storage declared twice, differently")
        return storage


def _unpickle(data: bytes) -> tuple[object, dict[str, StoredStorage]]:
    unpickler = _Unpickler(data)
    try:
        root = unpickler.load()
    except NotTorchFree:
        raise
    except Exception as error:  # noqa: BLE001 - hostile bytes: torch's loader words the error
        raise NotTorchFree(f"unpickling failed ({type(error).__name__})") from None
    return root, unpickler.storages


def _check_plain(root: object) -> list[StoredTensor]:
    """Every tensor of the structure; anything but plain values, containers and tensors
    raises :class:`NotTorchFree` (each container once: a pickle may be cyclic)."""
    tensors: list[StoredTensor] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is StoredTensor:
            tensors.append(value)  # type: ignore[arg-type]
        elif kind in (dict, collections.OrderedDict, list, tuple):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, dict):
                if not all(type(k) in _PLAIN for k in value):
                    raise NotTorchFree("a dict key that is not a plain value")
                stack.extend(value.values())
            else:
                stack.extend(value)  # type: ignore[arg-type]
        elif kind not in _PLAIN:
            raise NotTorchFree(f"a {kind.__name__} value")
    return tensors


def _check_view(tensor: StoredTensor) -> None:
    """The bounds torch checks when it sets a tensor on its storage; declined, not judged."""
    if (tensor.offset + tensor.span()) * tensor.itemsize > tensor.storage.nbytes:
        raise NotTorchFree("a view past the end of its storage")


@dataclass(frozen=True)
class _Map:
    mapping: mmap.mmap | None
    address: int


class MappedZipCheckpoint:
    """One zip checkpoint whose ``data.pkl`` this module reads: its structure, then a
    guarded map of the file for the tensors' bytes (as :class:`MappedSafetensors`).

    Raises :class:`InputError` for what the torch path refuses with the same words before
    torch reads anything (the container, the pickle budget), :class:`NotTorchFree` for
    the rest of what it does not read.
    """

    def __init__(self, path: str, archive: TorchZip, identity: FileIdentity | None) -> None:
        self.path = path
        self._archive = archive
        self._identity = identity
        data = self._member_bytes(archive.records["data.pkl"])
        opcodes: set[str] = set()
        problem = budget_problem(data, seen=opcodes)
        if problem is not None:
            raise InputError(path, problem)
        if not opcodes <= TORCH_OPCODES:
            raise NotTorchFree(f"pickle opcodes {sorted(opcodes - TORCH_OPCODES)}")
        byteorder = archive.records.get("byteorder")
        if byteorder is None or self._member_bytes(byteorder) != b"little":
            raise NotTorchFree("not a little-endian checkpoint")
        #: The unpickled structure: dicts, lists, tuples, plain values and StoredTensors.
        self.root, storages = _unpickle(data)
        self.tensors = _check_plain(self.root)
        self._members: dict[int, Member] = {}
        for storage in storages.values():
            member = archive.records.get(f"data/{storage.key}")
            if member is None or member.size != storage.nbytes:
                raise NotTorchFree("a storage that is not exactly its zip member")
            self._members[id(storage)] = member
        for tensor in self.tensors:
            _check_view(tensor)
        self._guard: MapGuard | None = None
        self._map: _Map | None = None

    def _member_bytes(self, member: Member) -> bytes:
        handle, _ = open_checked(self.path)
        with handle:
            handle.seek(member.offset)
            return handle.read(member.size)

    def _mapped(self) -> _Map:
        if self._map is not None:
            return self._map
        handle, size = open_checked(self.path)
        try:
            same_file(self.path, self._identity, os.fstat(handle.fileno()))
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except (OSError, ValueError) as error:
            raise InputError(self.path, f"cannot map the file for reading ({error})") from None
        finally:
            handle.close()
        address = 0
        if mapping is not None:
            address = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
            self._guard = MapGuard(address, size, owner=mapping)
        self._map = _Map(mapping, address)
        return self._map

    def data(self, tensor: StoredTensor, small: int) -> tuple[int, object]:
        """``(address, keep)`` of the tensor's elements in C order: where they lie in the
        map when they are contiguous and aligned, else in a copy (``keep`` holds the bytes
        alive). A strided view of more than ``small`` elements raises :class:`NotTorchFree`:
        the torch path reduces those with torch's own kernels, not the native one."""
        count = tensor.numel()
        if not count:
            return 0, None
        mapped = self._mapped()
        assert mapped.mapping is not None  # a tensor with elements: the file is not empty
        itemsize = tensor.itemsize
        start = self._members[id(tensor.storage)].offset + tensor.offset * itemsize
        if tensor.is_contiguous():
            if start % itemsize == 0:
                return mapped.address + start, mapped.mapping
            raw = np.frombuffer(mapped.mapping, np.uint8, count * itemsize, start)
            copy = raw.copy()
            return int(copy.ctypes.data), copy
        if count > small:
            raise NotTorchFree("a large strided view")
        # Opaque elements of the dtype's size (numpy has no bfloat16 or fp8), copied in
        # C order as torch's ``contiguous()`` copies them; any alignment will do.
        base = np.frombuffer(mapped.mapping, np.uint8, tensor.span() * itemsize, start)
        view = np.lib.stride_tricks.as_strided(
            base.view(np.dtype(f"V{itemsize}")),
            shape=tensor.shape,
            strides=tuple(s * itemsize for s in tensor.stride),
            writeable=False,
        )
        copy = np.ascontiguousarray(view)
        return int(copy.ctypes.data), copy

    def check_unchanged(self) -> None:
        """Raise :class:`InputError` if the file changed while it was read (as the torch
        path's ``TorchPickleSource.check_unchanged``)."""
        guard, self._guard = self._guard, None
        release_and_check(self.path, guard, self._identity)
