"""The torch-free reader of zip checkpoints runs nothing from the file and declines, never
guesses: whatever it does not know raises NotTorchFree (the scan then uses torch)."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gradaudit.io import zip_checkpoint
from gradaudit.io.files import FileIdentity
from gradaudit.io.torch_zip import inspect_torch_zip
from gradaudit.io.zip_checkpoint import MappedZipCheckpoint, NotTorchFree, StoredTensor
from tests.hostile import data_pkl, patch_member

CALLED: list[object] = []


def _record(*args: object) -> None:
    CALLED.append(args)


class _Calls:
    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return _record, ("ran",)


def _open(path: Path) -> MappedZipCheckpoint:
    return MappedZipCheckpoint(
        str(path), inspect_torch_zip(str(path)), FileIdentity.of(path.stat())
    )


def test_a_state_dict_becomes_stored_tensors(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    base = torch.arange(24.0).reshape(4, 6)
    torch.save({"w": base[1:], "t": base.t(), "b": torch.ones(3, dtype=torch.bfloat16)}, path)
    source = _open(path)
    root = source.root
    assert isinstance(root, dict)
    w, t, b = root["w"], root["t"], root["b"]
    assert isinstance(w, StoredTensor)
    assert (w.dtype, w.offset, w.shape, w.stride, w.is_contiguous()) == (
        "float32",
        6,
        (3, 6),
        (6, 1),
        True,
    )
    assert w.storage is t.storage  # one storage, shared
    assert (t.shape, t.stride, t.is_contiguous()) == ((6, 4), (1, 6), False)
    assert (b.dtype, b.itemsize, b.numel()) == ("bfloat16", 2, 3)
    # the strided view's bytes, in C order, equal torch's contiguous copy
    pointer, keep = source.data(t, 1 << 16)
    assert isinstance(keep, np.ndarray)
    assert keep.tobytes() == base.t().contiguous().numpy().tobytes()
    assert pointer == keep.ctypes.data
    source.check_unchanged()


def test_globals_are_never_called_or_imported(tmp_path: Path) -> None:
    path = tmp_path / "calls.pt"
    torch.save({"w": torch.ones(2), "x": _Calls()}, path)
    CALLED.clear()
    with pytest.raises(NotTorchFree, match=r"global tests\.io\.test_zip_checkpoint\._record"):
        _open(path)
    assert CALLED == []


def test_state_set_on_a_tensor_is_refused() -> None:
    tensor = StoredTensor(zip_checkpoint.StoredStorage("0", 8, "float32"), "float32", 0, (2,), (1,))
    with pytest.raises(NotTorchFree):
        tensor.__setstate__({"offset": 5})
    assert tensor.offset == 0


def test_opcodes_torch_does_not_read_are_declined(tmp_path: Path) -> None:
    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4)
    with pytest.raises(NotTorchFree, match="FRAME"):
        _open(path)


def test_a_view_past_its_storage_is_declined(tmp_path: Path) -> None:
    path = tmp_path / "past.pt"
    torch.save({"w": torch.arange(12.0)}, path)
    name = data_pkl(path)
    with zipfile.ZipFile(path) as archive:
        pickled = archive.read(name)
    # the shape (12,) -> (13,): BININT1 12 appears as the storage size and the shape
    shape = pickle.BININT1 + bytes([12])
    assert pickled.count(shape) == 2
    head, _, tail = pickled.rpartition(shape)
    patch_member(path, name, head + pickle.BININT1 + bytes([13]) + tail)
    with pytest.raises(NotTorchFree, match="past the end"):
        _open(path)
