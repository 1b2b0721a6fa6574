"""PyTorch pickles end to end through ``scan_paths``: numbers, names, formats, refusals."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import ExitCode, exit_code, scan_paths
from gradaudit.errors import InputError
from gradaudit.io.torch_pickle import TorchPickleSource, _load_failure
from tests.hostile import good_checkpoint
from tests.reference import reference_stats
from tests.torch_features import requires_torch_2_6


def by_name(report: Any) -> dict[str, Any]:
    return {t.name: t for t in report.tensors}


@pytest.mark.parametrize(
    "save",
    [
        pytest.param({}, id="zip"),
        pytest.param({"_use_new_zipfile_serialization": False}, id="legacy"),
    ],
)
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt"])
def test_numbers_match_a_float64_reference(
    tmp_path: Path, save: dict[str, Any], suffix: str
) -> None:
    torch.manual_seed(1)
    tensors = {
        "f32": torch.randn(33, 17) * 1e3,
        "f16": (torch.randn(100) * 300).half(),
        "bf16": torch.randn(64).bfloat16(),
        "f64": torch.randn(10, dtype=torch.float64) * 1e200,
        "odd": torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 2.5]),
    }
    path = tmp_path / f"grads{suffix}"
    torch.save({"model": tensors, "epoch": 3}, path, **save)

    report = scan_paths([path], device="cpu", chunk_elements=256)

    found = by_name(report)
    assert set(found) == {f"model.{name}" for name in tensors}
    for name, tensor in tensors.items():
        stats, expected = found[f"model.{name}"], reference_stats(tensor)
        assert stats.source == str(path)
        assert (stats.nan, stats.pos_inf, stats.neg_inf, stats.zeros) == (
            expected.nan,
            expected.pos_inf,
            expected.neg_inf,
            expected.zeros,
        )
        assert stats.max_abs == pytest.approx(expected.max_abs, rel=1e-12)
        assert stats.norm == pytest.approx(expected.norm, rel=1e-6)
    assert [s.name for s in report.skipped] == ["epoch"]
    assert report.files[0].tensors == len(tensors)


def saved_on_cuda(path: Path) -> Path:
    """A checkpoint whose storages say ``cuda:0``, as if saved on a GPU (rewritten data.pkl)."""
    torch.save({"w": torch.arange(4.0)}, tmp := path.with_suffix(".cpu"))
    with zipfile.ZipFile(tmp) as source, zipfile.ZipFile(path, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/data.pkl"):
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            target.writestr(info.filename, data)
    tmp.unlink()
    return path


@requires_torch_2_6
def test_checkpoint_saved_on_a_gpu_is_audited_without_one(tmp_path: Path) -> None:
    path = saved_on_cuda(tmp_path / "gpu.pt")
    if not torch.cuda.is_available():  # what a plain torch.load does on this machine
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)
    report = scan_paths([path], device="cpu")
    assert [(t.name, t.norm) for t in report.tensors] == [("w", pytest.approx(14**0.5))]
    assert not report.errors


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where ``path`` is memory-mapped in this process (Linux)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_zip_tensors_are_memory_mapped_views_of_the_file(tmp_path: Path) -> None:
    zipped, legacy = tmp_path / "zip.pt", tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(1 << 16)}, zipped)
    torch.save({"w": torch.ones(1 << 16)}, legacy, _use_new_zipfile_serialization=False)
    for path, mapped in ((zipped, True), (legacy, False)):
        (item,) = list(TorchPickleSource(str(path)).items())
        assert isinstance(item, tuple)
        pointer = item[1].data_ptr()
        inside = any(start <= pointer < end for start, end in mapped_ranges(path))
        assert inside is mapped, path.name


def test_the_input_file_is_never_modified(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.tensor([math.nan, 1.0])}, path)
    path.chmod(0o444)
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    report = scan_paths([path], device="cpu")
    assert exit_code(report) is ExitCode.FINDINGS
    assert path.read_bytes() == before
    assert path.stat().st_mtime_ns == mtime


@requires_torch_2_6
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensors_do_not_block_the_storage_check(tmp_path: Path) -> None:
    # Quantized tensors cannot be rebuilt on "meta"; the file is still audited, the
    # quantized tensor as the float values it stands for.
    path = tmp_path / "quantized.pt"
    quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    torch.save({"q": quantized, "w": torch.ones(3)}, path)
    report = scan_paths([path], device="cpu")
    assert [t.name for t in report.tensors] == ["q", "w"]
    assert report.tensors[0].dtype == "float32"
    assert not report.skipped
    assert not report.errors


def test_select_leaves_tensors_out_and_counts_them(tmp_path: Path) -> None:
    path = good_checkpoint(tmp_path)
    report = scan_paths([path], device="cpu", exclude=["model.*"])
    assert report.tensors == ()
    assert report.summary.excluded == 1
    assert report.files[0].excluded == 1
    assert [s.name for s in report.skipped] == ["step"]


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (EOFError(), "file is truncated or corrupt (the pickle ends early)"),
        (RuntimeError("unexpected EOF, expected 40 more bytes"), "truncated or corrupt"),
        (RuntimeError("Invalid magic number; corrupt file?"), "invalid magic number"),
        (MemoryError(), "not enough memory to load it"),
        (
            RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central"),
            "corrupt zip checkpoint (failed finding central)",
        ),
        (
            RuntimeError(
                "Cannot use ``weights_only=True`` with files saved in the legacy .tar format. "
                "Re-running with weights_only=False will likely succeed."
            ),
            "pre-1.6 .tar format",
        ),
        (KeyError(5), "cannot load this PyTorch checkpoint (KeyError: 5)"),
        (
            ValueError("bad thing. Use weights_only=False to load it"),
            "cannot load this PyTorch checkpoint (ValueError: bad thing)",
        ),
    ],
)
def test_load_failures_become_one_line_without_torchs_advice(
    error: Exception, message: str
) -> None:
    text = _load_failure(error)
    assert message in text
    assert "weights_only" not in text
    assert "\n" not in text


@requires_torch_2_6
def test_a_refused_file_names_the_global_and_torch_never_ran_it(tmp_path: Path) -> None:
    path = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), path)
    with pytest.raises(InputError) as caught:
        list(TorchPickleSource(str(path)).items())
    assert caught.value.cause == (
        'refused as unsafe: the pickle references "torch.nn.modules.linear.Linear", which '
        "PyTorch's weights-only loader does not allow (nothing from the file was run); it "
        "holds a pickled object, not a state dict: save model.state_dict() instead"
    )
