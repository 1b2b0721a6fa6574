"""save_gradients: streamed, atomic safetensors dumps that the library and the CLI read."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gradaudit import ExitCode, save_gradients, scan_paths
from gradaudit.cli import app
from gradaudit.io import safetensors_writer
from gradaudit.io.safetensors_header import read_header
from gradaudit.io.safetensors_writer import (
    WRITE_ALIGNMENT,
    _blocks,
    build_header,
    layout_order,
    write_safetensors,
)
from tests.conftest import runner


def load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, NaN included, for any dtype and shape."""
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and flat_a.view(torch.uint8).equal(flat_b.view(torch.uint8))
    )


def awkward_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    specials = torch.randn(4, 6, generator=gen)
    specials[0, 0], specials[1, 1], specials[2, 2] = math.nan, math.inf, -math.inf
    return {
        "transposed": specials.t(),  # non-contiguous
        "strided": torch.randn(8, 5, generator=gen)[::2, 1:],  # non-contiguous, offset
        "scalar_bf16": torch.tensor(3.5, dtype=torch.bfloat16),  # 0-d
        "empty": torch.empty(0, 3),
        "empty_f64": torch.empty(2, 0, dtype=torch.float64),
        "fp8": (torch.randn(7, generator=gen) * 10).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(3, generator=gen).to(torch.float8_e5m2),
        "fp16": torch.randn(5, generator=gen).half(),
        "f64": torch.randn(3, generator=gen, dtype=torch.float64) * 1e200,
        "int_step": torch.tensor([12], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "négatif ∇": torch.randn(2, generator=gen).neg(),
    }


def test_round_trip_every_awkward_tensor(tmp_path: Path) -> None:
    tensors = awkward_tensors()
    path = save_gradients(tensors, tmp_path / "g.safetensors", step=3)
    assert path == tmp_path / "g.safetensors"
    loaded = load(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert same_bytes(loaded[name], tensor), name


def test_passes_the_header_validator_with_metadata(tmp_path: Path) -> None:
    path = save_gradients(
        awkward_tensors(), tmp_path / "g.safetensors", step=42, metadata={"run": "a/b"}
    )
    header = read_header(path)  # raises on any structural problem
    assert header.metadata["step"] == "42"
    assert header.metadata["torch_version"] == torch.__version__
    assert header.metadata["format"] == "pt"
    assert header.metadata["run"] == "a/b"
    assert header.metadata["time"].endswith("+00:00")
    assert (8 + header.header_length) % 8 == 0
    # Larger elements first: every tensor is aligned to its element size.
    sizes = {"F64": 8, "F32": 4, "I64": 8, "F16": 2, "BF16": 2}
    for entry in header.tensors:
        assert entry.begin % sizes.get(entry.dtype, 1) == 0


def test_the_cli_reads_a_dump_of_a_module(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    assert model.bias.grad is not None
    model.bias.grad[0] = math.nan
    path = save_gradients(model, tmp_path / "m.safetensors", step=0)
    assert set(load(path)) == {"weight", "bias"}
    result = runner.invoke(app, ["scan", str(path)], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == ExitCode.FINDINGS
    assert "bias" in result.stdout
    assert result.stderr == ""


def test_parameters_stand_for_their_gradients(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    model(torch.randn(1, 2)).sum().backward()
    assert model.weight.grad is not None
    model.bias.grad = None
    path = save_gradients(model.named_parameters(), tmp_path / "p.safetensors")
    loaded = load(path)
    assert set(loaded) == {"weight"}
    assert loaded["weight"].equal(model.weight.grad)
    bare = load(save_gradients(list(model.parameters()), tmp_path / "b.safetensors"))
    assert set(bare) == {"param.0"}


def test_chunked_writes_are_identical(tmp_path: Path) -> None:
    """Tiny host blocks (3 bytes) give the same file as one block per tensor."""
    tensors = list(awkward_tensors().items())
    small = write_safetensors(tmp_path / "a.safetensors", tensors, chunk_bytes=3)
    large = write_safetensors(tmp_path / "b.safetensors", tensors)
    assert small.read_bytes() == large.read_bytes()


@pytest.mark.parametrize(
    ("alignment", "chunk_bytes"),
    # 3-byte host blocks against a 4 KiB alignment (the same rule, 512x fewer pieces than
    # against 2 MiB: 3-byte blocks of 6 MB took 5 s); then the real 2 MiB.
    [(4096, 3), (WRITE_ALIGNMENT, 1 << 20), (WRITE_ALIGNMENT, 64 << 20)],
)
def test_writes_end_at_multiples_of_the_alignment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alignment: int, chunk_bytes: int
) -> None:
    """Every write but the last ends at a multiple of 2 MiB of the file (so the page cache
    holds it in huge folios), small pieces and large ones alike; the bytes are the format's."""
    gen = torch.Generator().manual_seed(5)
    scale = alignment // 4096  # the sizes below are for a 4 KiB alignment
    tensors = [
        ("small", torch.randn(3, generator=gen)),
        ("large", torch.randn(2_539 * scale, generator=gen)),  # spans several alignments
        ("many", torch.randn(700, 5, generator=gen).t()),  # non-contiguous
        ("half", torch.randn(1_171 * scale + 1, generator=gen).half()),
        ("f64", torch.randn(2, generator=gen, dtype=torch.float64)),
    ]
    writes: list[int] = []
    real_write = os.write

    def record(fd: int, data: bytes) -> int:
        count = real_write(fd, data)
        writes.append(count)
        return count

    monkeypatch.setattr(safetensors_writer, "WRITE_ALIGNMENT", alignment)
    monkeypatch.setattr(os, "write", record)
    path = write_safetensors(tmp_path / "g.safetensors", tensors, chunk_bytes=chunk_bytes)
    monkeypatch.undo()
    ordered = layout_order(tensors)
    header = build_header(ordered, None)
    expected = struct.pack("<Q", len(header)) + header
    expected += b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for _, t in ordered)
    assert path.read_bytes() == expected
    assert len(expected) > 3 * alignment
    ends = [sum(writes[: i + 1]) for i in range(len(writes))]
    assert ends[-1] == len(expected)
    assert all(end % alignment == 0 for end in ends[:-1])


@pytest.mark.parametrize("step", [1, 4, 7, 1000])
def test_blocks_cover_a_tensor_in_row_major_order(step: int) -> None:
    base = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)
    for tensor in (base, base.transpose(0, 2), base[:, ::2, 1:], base.permute(1, 2, 0)):
        pieces = list(_blocks(tensor, step))
        assert all(p.dim() == 1 for p in pieces)
        assert torch.cat(pieces).equal(tensor.reshape(-1))
        if tensor.is_contiguous():
            assert max(p.numel() for p in pieces) <= step


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    save_gradients({"a": torch.ones(2)}, path)
    before = path.read_bytes()

    def explode(tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        write_safetensors(path, [("b", torch.zeros(3))], fetch=explode)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["g.safetensors"]


def test_a_tensor_that_changes_while_written_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="changed from"):
        write_safetensors(
            tmp_path / "g.safetensors",
            [("a", torch.ones(2, 2))],
            fetch=lambda t: t.reshape(-1),
        )
    assert os.listdir(tmp_path) == []


def test_permissions_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        path = save_gradients({"a": torch.ones(1)}, tmp_path / "g.safetensors")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    ("tensors", "kwargs", "error", "match"),
    [
        ({"a": torch.ones(1)}, {"metadata": {"step": "3"}}, ValueError, "written by gradaudit"),
        ({"a": torch.ones(1)}, {"metadata": {"k": 3}}, TypeError, "strings to strings"),
        ({"a": torch.ones(1)}, {"step": 1.5}, TypeError, "step must be an int"),
        ({"a": torch.ones(1)}, {"step": True}, TypeError, "step must be an int"),
        ({"__metadata__": torch.ones(1)}, {}, ValueError, "reserved"),
        ({"\ud800": torch.ones(1)}, {}, ValueError, "not valid Unicode"),
        ({"a": torch.ones(2).to_sparse()}, {}, TypeError, "cannot be written"),
        ({"a": torch.ones(2, dtype=torch.complex128)}, {}, TypeError, "no safetensors spelling"),
    ],
)
def test_bad_inputs_are_refused_before_any_file_exists(
    tmp_path: Path,
    tensors: dict[str, torch.Tensor],
    kwargs: dict[str, object],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        save_gradients(tensors, tmp_path / "g.safetensors", **kwargs)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_duplicate_names_and_wrong_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        save_gradients([("a", torch.ones(1)), ("a", torch.zeros(1))], tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match=r"must be named \*\.safetensors"):
        save_gradients({"a": torch.ones(1)}, tmp_path / "g.pt")
    assert os.listdir(tmp_path) == []


def test_stats_of_a_dump_equal_stats_of_the_tensors(tmp_path: Path) -> None:
    from gradaudit import audit

    tensors = {k: v for k, v in awkward_tensors().items() if v.is_floating_point()}
    path = save_gradients(tensors, tmp_path / "g.safetensors")
    scanned = {t.name: t for t in scan_paths([path], device="cpu").tensors}
    direct = {t.name: t for t in audit(tensors).tensors}
    assert scanned.keys() == direct.keys()
    for name, stats in direct.items():
        assert scanned[name].norm == stats.norm
        assert scanned[name].nan == stats.nan
