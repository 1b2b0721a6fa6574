"""``--precision`` on the torch-free path reports exactly what the torch path does.

The torch-free scan asks the native kernel for the exponent histograms in the same call as
the rows, as the torch path's collector does; these tests run each command both ways in
every output format (``assert_same_both_ways``: identical stdout, stderr and exit code, and
the torch-free path checked to have run) for every target format, on safetensors files and
zip ``.pt`` checkpoints whose values sit on each format's rounding boundaries, and check in
a fresh interpreter that torch is not imported.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gradaudit.engine import native_rows
from gradaudit.precision.formats import FORMATS, Precision
from tests.cli.test_startup import run_cli
from tests.samples import KERNEL_DTYPES
from tests.scan.test_torch_free import assert_same_both_ways, needs_native
from tests.scan.test_torch_free import invoke_cli as invoke_command
from tests.scan.test_torch_free_commands import write_run

pytestmark = needs_native

TARGETS = [precision.value for precision in Precision]
#: The kernel's dtypes, each a tensor of the file (float64 is binned after rounding).
DTYPES = KERNEL_DTYPES


def _boundaries() -> torch.Tensor:
    """Every format's three rounding boundaries, one float32 step either side, both signs."""
    points = []
    for spec in FORMATS.values():
        for value in (spec.flush_from, spec.normal_from, spec.overflow_from, spec.max):
            exact = torch.tensor(value, dtype=torch.float32)
            points += [
                torch.nextafter(exact, torch.tensor(0.0)),
                exact,
                torch.nextafter(exact, torch.tensor(math.inf)),
            ]
    values = torch.stack(points)
    return torch.cat([values, -values])


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Values over forty binades, the boundaries, NaN/±Inf, zeros, an empty tensor, a scalar
    and integers, in every dtype the kernel takes."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(4000, generator=gen, dtype=torch.float64)
    wide *= torch.pow(2.0, torch.randint(-40, 24, (4000,), generator=gen).double())
    wide[[5, 17]] = math.nan
    wide[100], wide[200] = math.inf, -math.inf
    wide[300:320] = 0.0
    wide[1000 : 1000 + 2 * 3 * 4 * 4] = _boundaries().double()
    tensors: dict[str, torch.Tensor] = {}
    for layer, dtype in enumerate(DTYPES):
        tensors[f"model.layers.{layer}.mlp.down_proj.weight"] = wide.to(dtype)
        tensors[f"model.layers.{layer}.mlp.down_proj.bias"] = (
            torch.randn(16, generator=gen) * 1e-6
        ).to(dtype)
    tensors["model.empty"] = torch.empty(0, 4)
    tensors["model.scalar"] = torch.tensor(70000.0)
    tensors["model.position_ids"] = torch.arange(12)
    return tensors


@pytest.mark.parametrize("target", TARGETS)
def test_safetensors_headroom_is_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    path = tmp_path / "grads.safetensors"
    save_file(_tensors(), str(path))
    report = assert_same_both_ways([str(path), "--precision", target, "--all"], monkeypatch)
    headroom = report["headroom"]
    assert headroom["precision"] == target
    assert len(headroom["tensors"]) == 2 * len(DTYPES) + 2  # every floating tensor, once
    assert headroom["total"]["overflowed"] > 0
    assert headroom["total"]["flushed"] > 0


@pytest.mark.parametrize("target", ["fp16", "fp8_e4m3fn"])
def test_pt_checkpoint_headroom_is_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    path = tmp_path / "model.pt"
    tensors = _tensors(seed=1)
    # Nested, with a small strided view the torch-free reader copies (as the collector does).
    torch.save({"state_dict": tensors, "view": tensors["model.scalar"].expand(3, 2)}, path)
    report = assert_same_both_ways([str(path), "--precision", target], monkeypatch)
    assert report["headroom"]["total"]["overflowed"] > 0


@pytest.mark.slow
def test_batches_several_files_and_a_bad_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More tensors than one native call takes (histograms from several blocks), and a
    broken file between good ones (rows of its tensors that nobody asks for)."""
    gen = torch.Generator().manual_seed(2)
    count = native_rows.NATIVE_BATCH_TENSORS + 300
    many = {f"t.{i}": torch.randn(3, generator=gen) * 10.0 ** (i % 12 - 6) for i in range(count)}
    save_file(many, str(tmp_path / "a.safetensors"))
    (tmp_path / "b.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    save_file(_tensors(seed=3), str(tmp_path / "c.safetensors"))
    args = [str(tmp_path / name) for name in ("a.safetensors", "b.safetensors", "c.safetensors")]
    report = assert_same_both_ways([*args, "--precision", "bf16"], monkeypatch)
    assert len(report["errors"]) == 1
    assert len(report["headroom"]["tensors"]) == count + 2 * len(DTYPES) + 2


def test_trend_headroom_is_the_same_both_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trend's --precision (a table only): the same table from both paths."""
    folder = write_run(tmp_path / "run")
    args = ["trend", str(folder), "--precision", "fp16", "--device", "cpu"]
    chosen, ran = invoke_command(args, monkeypatch, torch_path=False)
    forced, ran_forced = invoke_command(args, monkeypatch, torch_path=True)
    assert (ran, ran_forced) == ([True], [])
    assert chosen.exit_code == forced.exit_code
    assert chosen.stdout == forced.stdout
    assert chosen.stderr == forced.stderr
    assert "fp16" in chosen.stdout


@pytest.mark.slow
def test_scan_and_trend_with_precision_import_no_torch(tmp_path: Path) -> None:
    path = tmp_path / "grads.safetensors"
    save_file(_tensors(), str(path))
    checkpoint = tmp_path / "model.pt"
    torch.save(_tensors(seed=1), checkpoint)
    for target in ("fp16", "bf16", "fp8_e5m2"):
        stdout, heavy, code = run_cli(
            "scan", str(path), "--precision", target, "--format", "json", "--device", "cpu"
        )
        assert "torch" not in heavy, target
        assert code == 1  # NaN planted, and values overflow every target
        assert f'"precision": "{target}"' in stdout
    stdout, heavy, code = run_cli("scan", str(checkpoint), "--precision", "fp16", "--device", "cpu")
    assert "torch" not in heavy
    assert code == 1
    assert "overflow fp16 (Inf)" in stdout
    folder = write_run(tmp_path / "run")
    _, heavy, _ = run_cli("trend", str(folder), "--precision", "bf16", "--device", "cpu")
    assert "torch" not in heavy
    # Still torch where it is needed: another engine counts its histograms with torch ops.
    _, heavy, _ = run_cli("scan", str(path), "--precision", "fp16", "--engine", "eager")
    assert "torch" in heavy
