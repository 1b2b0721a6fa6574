"""``compare`` and ``trend`` on the torch-free path report exactly what the torch path does.

The sibling of ``test_torch_free.py`` (the torch-free scan): each command runs twice
through the CLI, once as it chooses (the torch-free path, checked to have run) and once
with the torch path forced, with identical stdout, stderr and exit code asserted in every
output format. The subprocess tests check that the torch-free runs import no torch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gradaudit.engine import native_rows
from tests.cli.test_startup import run_cli
from tests.samples import KERNEL_DTYPES
from tests.scan.test_torch_free import assert_same_both_ways as both_ways
from tests.scan.test_torch_free import invoke_cli, planted

pytestmark = pytest.mark.skipif(
    not native_rows.available(), reason="the torch-free path needs the native kernel"
)


def assert_same_both_ways(
    args: list[str], monkeypatch: pytest.MonkeyPatch, *, free: bool = True
) -> Any:
    """scan's differential check (every format, both paths) on a compare or trend line."""
    return both_ways(args, monkeypatch, free=free, invoke=invoke_cli)


def _two_sides(path: Path) -> Path:
    """One file holding both sides, their names interleaved (runs split into stretches),
    names of neither side, integer tensors on each side, and one tensor changed 50×."""
    gen = torch.Generator().manual_seed(3)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(12):
        for side in ("host", "seed", "other"):
            scale = 50.0 if (side, layer) == ("seed", 7) else 1.0
            tensors[f"{side}.layers.{layer}.weight"] = torch.randn(8, 4, generator=gen) * scale
    tensors["host.step"] = torch.arange(3)
    tensors["seed.mask"] = torch.tensor([True])
    tensors["seed.layers.3.bias"] = torch.full((5,), math.nan)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_compare_of_two_dumps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = planted(tmp_path / "a.safetensors")
    b = planted(tmp_path / "b.safetensors", seed=1)
    report = assert_same_both_ways(["compare", str(a), str(b), "--all"], monkeypatch)
    assert report["engine"] == "native"
    assert report["parameters"]


def test_compare_of_two_prefixes_in_one_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dump = _two_sides(tmp_path / "both.safetensors")
    args = ["compare", str(dump), "--host-prefix", "host.", "--seed-prefix", "seed."]
    report = assert_same_both_ways([*args, "--all"], monkeypatch)
    assert report["parameters"]
    assert_same_both_ways([*args, "--max-change", "3", "--fail-on-change"], monkeypatch)
    # Prefixes on two files select each file's side.
    other = _two_sides(tmp_path / "again.safetensors")
    assert_same_both_ways(
        ["compare", str(dump), str(other), "--host-prefix", "host.", "--seed-prefix", "seed."],
        monkeypatch,
    )


def test_compare_errors_and_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = planted(tmp_path / "a.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    assert_same_both_ways(["compare", str(a), str(bad)], monkeypatch)
    # Nothing on one side: an input error (3) on both paths.
    assert_same_both_ways(
        ["compare", str(a), "--host-prefix", "model.", "--seed-prefix", "nothing."], monkeypatch
    )
    # A missing file: the torch path, as before.
    assert_same_both_ways(
        ["compare", str(a), str(tmp_path / "gone.safetensors")], monkeypatch, free=False
    )
    # A torch.save file against a safetensors one: torch-free too.
    pickle = tmp_path / "b.pt"
    torch.save({"model.embed_tokens.weight": torch.ones(3)}, pickle)
    assert_same_both_ways(["compare", str(a), str(pickle)], monkeypatch)


def write_run(folder: Path, *, steps: int = 8, nan_at: int | None = 6) -> Path:
    """Dumps of a run whose layer 1 spikes at step 5 and whose layer 2 dies, with a NaN."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        tensors = {}
        for layer in range(3):
            scale = 200.0 if (layer, step) == (1, 5) else 1.0
            if layer == 2 and step >= 3:
                scale = 1e-12
            tensors[f"model.layers.{layer}.mlp.down_proj.weight"] = (
                torch.randn(16, 8, generator=gen) * scale
            )
        if step == nan_at:
            tensors["model.layers.0.mlp.down_proj.weight"][0, 1] = math.nan
            tensors["model.layers.0.mlp.down_proj.weight"][2, 2] = math.inf
        tensors["model.layers.0.step_count"] = torch.tensor([step])
        save_file(
            tensors, str(folder / f"step_{step:04d}.safetensors"), metadata={"step": str(step)}
        )
    return folder


def test_trend_of_a_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_run(tmp_path / "run")
    report = assert_same_both_ways(["trend", str(folder), "--all"], monkeypatch)
    kinds = {finding["kind"] for finding in report["findings"]}
    assert {"nonfinite", "spike", "collapse"} <= kinds
    assert_same_both_ways(["trend", str(folder), "--spike-factor", "3"], monkeypatch)


def test_trend_problems_and_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_run(tmp_path / "run", steps=5, nan_at=None)
    # A corrupt dump, a dump without a step, a step taken twice: problems on both paths.
    (folder / "broken_9.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}x")
    save_file({"w": torch.ones(2)}, str(folder / "nameless.safetensors"))
    save_file({"w": torch.ones(2)}, str(folder / "again.safetensors"), metadata={"step": "2"})
    assert_same_both_ways(["trend", str(folder)], monkeypatch)
    # A torch.save dump in the series: read without torch too.
    torch.save({"w": torch.ones(2)}, folder / "step_7.pt")
    assert_same_both_ways(["trend", str(folder)], monkeypatch)


def _pt(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    torch.save(tensors, path)
    return path


def _pt_of(path: Path, safetensors: Path) -> Path:
    """The tensors of a safetensors file, saved by ``torch.save`` (a plain state dict)."""
    return _pt(path, load_file(str(safetensors)))


def test_compare_of_two_pt_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zip checkpoint reader's differential suite, through compare: two files, two
    prefixes of one file, and every kernel dtype on each side."""
    a = _pt_of(tmp_path / "a.pt", planted(tmp_path / "a.safetensors"))
    b = _pt_of(tmp_path / "b.pth", planted(tmp_path / "b.safetensors", seed=1))
    report = assert_same_both_ways(["compare", str(a), str(b), "--all"], monkeypatch)
    assert report["engine"] == "native"
    assert report["parameters"]
    both = _pt_of(tmp_path / "both.bin", _two_sides(tmp_path / "both.safetensors"))
    args = ["compare", str(both), "--host-prefix", "host.", "--seed-prefix", "seed."]
    assert_same_both_ways([*args, "--all"], monkeypatch)
    assert_same_both_ways([*args, "--max-change", "3", "--fail-on-change"], monkeypatch)
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(40, generator=gen, dtype=torch.float64) * (i + 1) for i in range(6)]
    names = [f"model.layers.{i}.weight" for i in range(len(KERNEL_DTYPES))]
    host = _pt(
        tmp_path / "host.ckpt",
        {name: b.to(dtype) for name, b, dtype in zip(names, base, KERNEL_DTYPES, strict=True)},
    )
    seed = _pt(
        tmp_path / "seed.pt",
        {name: (b * 3).to(dt) for name, b, dt in zip(names, base, KERNEL_DTYPES, strict=True)},
    )
    assert_same_both_ways(["compare", str(host), str(seed), "--all"], monkeypatch)


def test_compare_of_pt_files_the_reader_declines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Optimizer state with estimates, a legacy file, a file that is no checkpoint, a
    corrupt zip: the torch path, or the same input error either way."""
    a = _pt_of(tmp_path / "a.pt", planted(tmp_path / "a.safetensors"))
    model = torch.nn.Linear(5, 3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    adam.step()
    state = _pt(tmp_path / "state.pt", {"model": model.state_dict(), "optim": adam.state_dict()})
    assert_same_both_ways(["compare", str(state), str(state)], monkeypatch, free=False)
    legacy = tmp_path / "legacy.pt"
    torch.save(
        load_file(str(tmp_path / "a.safetensors")), legacy, _use_new_zipfile_serialization=False
    )
    assert_same_both_ways(["compare", str(a), str(legacy)], monkeypatch, free=False)
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    assert_same_both_ways(["compare", str(a), str(text)], monkeypatch, free=False)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(a.read_bytes()[:-200])
    assert_same_both_ways(["compare", str(a), str(truncated)], monkeypatch, free=None)


def _pt_series(folder: Path, **kwargs: Any) -> Path:
    """:func:`write_run` saved by ``torch.save``: the step is in each name only."""
    write_run(folder, **kwargs)
    for dump in sorted(folder.glob("*.safetensors")):
        _pt_of(dump.with_suffix(".pt"), dump)
        dump.unlink()
    return folder


def test_trend_over_pt_step_dumps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _pt_series(tmp_path / "run")
    report = assert_same_both_ways(["trend", str(folder), "--all"], monkeypatch)
    kinds = {finding["kind"] for finding in report["findings"]}
    assert {"nonfinite", "spike", "collapse"} <= kinds
    assert_same_both_ways(["trend", str(folder), "--spike-factor", "3"], monkeypatch)
    # Problems: a dump without a number in its name, a corrupt zip, a step taken twice.
    shutil.copy(folder / "step_0001.pt", folder / "nameless.pt")
    (folder / "step_0099.pt").write_bytes(b"PK\x03\x04" + bytes(60))
    shutil.copy(folder / "step_0001.pt", folder / "again_2.pth")
    report = assert_same_both_ways(["trend", str(folder)], monkeypatch)
    assert len(report["errors"]) == 3


def test_trend_over_pt_dumps_the_reader_declines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One dump only the torch path reads sends the whole series there."""
    folder = _pt_series(tmp_path / "legacy", steps=4, nan_at=None)
    state = torch.load(folder / "step_0001.pt", weights_only=True)
    torch.save(state, folder / "step_0009.pt", _use_new_zipfile_serialization=False)
    assert_same_both_ways(["trend", str(folder)], monkeypatch, free=False)
    folder = _pt_series(tmp_path / "params", steps=4, nan_at=None)
    params = {
        name: torch.nn.Parameter(tensor) if tensor.is_floating_point() else tensor
        for name, tensor in state.items()
    }
    torch.save(params, folder / "step_0009.pt")
    assert_same_both_ways(["trend", str(folder)], monkeypatch, free=False)


@pytest.mark.slow
def test_compare_and_trend_of_safetensors_import_no_torch(tmp_path: Path) -> None:
    a = planted(tmp_path / "a.safetensors")
    b = planted(tmp_path / "b.safetensors", seed=1)
    stdout, heavy, code = run_cli("compare", str(a), str(b), "--format", "json", "--device", "cpu")
    assert "torch" not in heavy
    assert json.loads(stdout)["engine"] == "native"
    assert code == 1  # NaN on both sides
    folder = write_run(tmp_path / "run")
    stdout, heavy, code = run_cli("trend", str(folder), "--format", "json", "--device", "cpu")
    assert "torch" not in heavy
    assert code == 1
    _, heavy, _ = run_cli("compare", str(a), str(b), "--engine", "eager")
    assert "torch" in heavy


@pytest.mark.slow
def test_compare_and_trend_of_pt_files_import_no_torch(tmp_path: Path) -> None:
    a = _pt_of(tmp_path / "a.pt", planted(tmp_path / "a.safetensors"))
    b = _pt_of(tmp_path / "b.pt", planted(tmp_path / "b.safetensors", seed=1))
    stdout, heavy, code = run_cli("compare", str(a), str(b), "--format", "json", "--device", "cpu")
    assert "torch" not in heavy
    assert "pydantic" not in heavy
    assert json.loads(stdout)["engine"] == "native"
    assert code == 1  # NaN on both sides
    folder = _pt_series(tmp_path / "run")
    stdout, heavy, code = run_cli("trend", str(folder), "--format", "json", "--device", "cpu")
    assert "torch" not in heavy
    assert json.loads(stdout)["findings"]
    assert code == 1
    _, heavy, _ = run_cli("trend", str(folder), "--engine", "eager")
    assert "torch" in heavy
