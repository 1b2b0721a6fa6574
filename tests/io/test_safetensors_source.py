"""Reading safetensors data through our own memory map: offsets, alignment, a changed file."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from gradaudit import scan_paths
from gradaudit.errors import InputError
from gradaudit.io.safetensors_source import SafetensorsSource
from tests.hostile import raw_safetensors
from tests.reference import reference_stats


def misaligned_dump(path: Path, values: dict[str, torch.Tensor], pad: int) -> Path:
    """A valid file whose data section starts ``pad`` bytes off a 4-byte boundary."""
    header: dict[str, object] = {}
    data = b""
    for name, tensor in values.items():
        raw = tensor.numpy().tobytes()
        dtype = {torch.float32: "F32", torch.float64: "F64"}[tensor.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header)
    text += " " * ((pad - 8 - len(text)) % 4)  # (8 + len(header)) % 4 == pad % 4
    return raw_safetensors(path, text, data)


@pytest.mark.parametrize("pad", [1, 2, 3])
def test_misaligned_tensors_are_read_exactly(tmp_path: Path, pad: int) -> None:
    gen = torch.Generator().manual_seed(pad)
    values = {
        "a": torch.randn(37, generator=gen),
        "b": torch.randn(5, 3, generator=gen, dtype=torch.float64) * 1e200,
        "c": torch.tensor([math.nan, math.inf, 0.0, -2.0]),
    }
    path = misaligned_dump(tmp_path / "odd.safetensors", values, pad)
    source = SafetensorsSource(str(path))
    assert (8 + source.header.header_length) % 4 == pad % 4
    read = dict(source.items())
    for name, tensor in values.items():
        assert torch.equal(read[name].nan_to_num(), tensor.nan_to_num())
    report = scan_paths([path], device="cpu")
    for stats in report.tensors:
        ref = reference_stats(values[stats.name])
        assert (stats.nan, stats.pos_inf, stats.zeros) == (ref.nan, ref.pos_inf, ref.zeros)
        assert stats.norm == pytest.approx(ref.norm, rel=1e-12)


def test_tensors_are_views_of_the_file_and_cannot_write_to_it(tmp_path: Path) -> None:
    path = misaligned_dump(tmp_path / "w.safetensors", {"w": torch.ones(1024)}, 0)
    before = path.read_bytes()
    source = SafetensorsSource(str(path))
    ((_, tensor),) = list(source.items())
    tensor.fill_(7.0)  # a private copy-on-write page, never the file
    assert path.read_bytes() == before


def test_a_file_that_changed_after_its_header_was_read_is_refused(tmp_path: Path) -> None:
    path = misaligned_dump(tmp_path / "grow.safetensors", {"w": torch.ones(16)}, 0)
    source = SafetensorsSource(str(path))
    with open(path, "ab") as handle:
        handle.write(b"\0" * 64)
    with pytest.raises(InputError, match="changed size while being read"):
        list(source.items())
    os.truncate(path, 10)
    with pytest.raises(InputError, match="changed size while being read"):
        list(source.items())
