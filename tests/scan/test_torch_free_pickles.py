"""Zip ``torch.save`` checkpoints: the torch-free scan reports exactly what the torch path does.

The differential suite of :mod:`gradaudit.io.zip_checkpoint` through the CLI: real files
written by ``torch.save``, each scanned twice (the path the CLI chooses, and the torch path
forced) in every output format, with identical stdout, stderr and exit code asserted by
``assert_same_both_ways``, which also asserts which path ran: torch-free for what the
restricted reader takes, the torch path (a ``NeedsTorch`` fallback) for the rest. Hostile
files give the same exit 3 and message either way, never a traceback.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
import torch

from gradaudit.io import zip_checkpoint
from tests.cli.test_startup import run_cli
from tests.hostile import CASES, TORCH_2_6_CASES, data_pkl, patch_member
from tests.samples import KERNEL_DTYPES
from tests.scan.test_torch_free import assert_same_both_ways, needs_native
from tests.torch_features import requires_torch_2_6

pytestmark = needs_native


def _planted(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values with NaN, +Inf, -Inf and zeros where the dtype holds them."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(500, generator=gen, dtype=torch.float64) * 3
    if dtype.is_floating_point:
        wide[[3, 77]] = math.nan
        wide[100], wide[200] = math.inf, -math.inf
        wide[300:310] = 0.0
        return wide.to(dtype)
    if dtype is torch.bool:
        return wide > 0
    return wide.abs().to(dtype)


DTYPES = [
    *KERNEL_DTYPES,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _save(path: Path, obj: object) -> str:
    torch.save(obj, path)
    return str(path)


def test_every_dtype_in_a_flat_state_dict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = collections.OrderedDict(
        (f"layers.{i}.{str(dtype).removeprefix('torch.')}", _planted(dtype, i))
        for i, dtype in enumerate(DTYPES)
    )
    path = _save(tmp_path / "model.pt", state)
    report = assert_same_both_ways([path, "--all"], monkeypatch)
    assert report["summary"]["nan_tensors"] >= 5
    assert len(report["skipped"]) == 6  # the integer and boolean tensors, with torch's words


@pytest.mark.slow
def test_nested_containers_plain_values_views_and_shared_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(40, 30, generator=gen)
    tied = torch.randn(8, 4, generator=gen)
    obj = {
        "model": collections.OrderedDict(
            [
                ("embed.weight", tied),
                ("head.weight", tied),  # tied: audited once
                ("offset_view", base[5:]),  # a storage offset
                ("transposed", base.t()),  # non-contiguous, copied like torch's contiguous()
                ("every_other", base[:, ::2]),
                ("same_storage_other_view", base[0]),
                ("expanded", torch.zeros(1).expand(1000)),  # skipped: an expanded view
                ("empty", torch.empty(0, 7)),
                ("scalar", torch.tensor(-2.5)),
                ("big_values", torch.full((16,), 1e30)),
            ]
        ),
        "ema": [torch.randn(3, generator=gen), (torch.ones(2), "label", None)],
        "config": {"lr": 0.1, "name": "run-7", "flag": True, "nothing": None, 3: "int key"},
        "epoch": 12,
        "steps": [1, 2, 3],
    }
    path = _save(tmp_path / "train.pth", obj)
    report = assert_same_both_ways([path, "--all"], monkeypatch)
    reasons = {s["name"]: s["reason"] for s in report["skipped"]}
    assert "same data as" in reasons["model.head.weight"]
    assert "expanded view" in reasons["model.expanded"]
    for extra in (["--include", "model.*"], ["--exclude", "*weight"], ["--kind", "weights"]):
        assert_same_both_ways([path, *extra], monkeypatch)


@pytest.mark.slow
def test_lightning_checkpoint_without_optimizer_estimates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    plain_sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: nothing to estimate
    model(torch.randn(3, 6)).sum().backward()
    plain_sgd.step()
    ckpt = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(math.inf)}},
        "optimizer_states": [plain_sgd.state_dict()],
        "lr_schedulers": [],
        "hyper_parameters": {"hidden": 4, "lr": 0.1},
    }
    path = _save(tmp_path / "epoch=3.ckpt", ckpt)
    report = assert_same_both_ways([path], monkeypatch)
    reasons = [s["reason"] for s in report["skipped"]]
    assert any(reason.startswith("Lightning loop progress") for reason in reasons)
    assert any(reason.startswith("Lightning callback state") for reason in reasons)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd-momentum"])
def test_optimizer_state_falls_back_to_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    """Gradient estimates need torch's reductions (the derived rows): the torch path runs."""
    model = torch.nn.Linear(5, 3)
    opt = (
        torch.optim.Adam(model.parameters())
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    path = _save(tmp_path / "optimizer.pt", opt.state_dict())
    assert_same_both_ways([path], monkeypatch, free=False)
    both = _save(tmp_path / "both.pt", {"model": model.state_dict(), "optim": opt.state_dict()})
    assert_same_both_ways([both], monkeypatch, free=False)


@pytest.mark.parametrize(
    "value",
    [
        torch.nn.Parameter(torch.ones(3)),  # _rebuild_parameter
        torch.ones(2, dtype=torch.complex64),  # a dtype the native kernel does not take
        torch.Size([2, 3]),  # a global the reader does not know
        torch.randn(300, 300).t(),  # strided and large: torch's kernels reduce it
        {1, 2},  # a set
    ],
    ids=["parameter", "complex", "torch-size", "large-strided", "set"],
)
def test_what_the_reader_declines_takes_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: object
) -> None:
    path = _save(tmp_path / "odd.pt", {"w": torch.ones(4), "odd": value})
    assert_same_both_ways([path], monkeypatch, free=False)


def test_a_declined_file_sends_the_whole_run_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = _save(tmp_path / "good.pt", {"w": torch.ones(4)})
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(4)}, legacy, _use_new_zipfile_serialization=False)
    assert_same_both_ways([good, str(legacy)], monkeypatch, free=False)


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=requires_torch_2_6) if name in TORCH_2_6_CASES else name
        for name in [
            "empty-pt",
            "truncated-zip-checkpoint",
            "truncated-legacy-checkpoint",
            "safetensors-named-pt",
            "unsafe-open-zip",
            "unsafe-exec-zip",
            "unsafe-open-protocol-4",
            "plain-pickle",
            "pickled-module",
            "custom-class",
            "torchscript",
            "zip-crc-mismatch",
            "zip-compressed-member",
            "zip-storage-larger-than-member",
            "pickle-protocol-4",
        ]
    ],
)
def test_hostile_checkpoints_same_error_either_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    path = CASES[case].build(_folder(tmp_path / "case"))
    good = _save(tmp_path / "good.pt", {"w": torch.ones(4)})
    report = assert_same_both_ways([str(path)], monkeypatch, free=None)
    assert CASES[case].cause in report["errors"][0]["message"]
    assert_same_both_ways([str(path), good], monkeypatch, free=None)  # the other is still read


def _patched(tmp_path: Path, old: bytes, new: bytes) -> Path:
    path = tmp_path / "patched.pt"
    torch.save({"w": torch.arange(12.0).reshape(3, 4)}, path)
    name = data_pkl(path)
    import zipfile

    with zipfile.ZipFile(path) as archive:
        pickled = archive.read(name)
    assert pickled.count(old) >= 1
    return patch_member(path, name, pickled.replace(old, new, 1))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"_rebuild_tensor_v2", b"_rebuild_tensor_vX"),  # an unknown global
        (b"FloatStorage", b"LongsStorage"),  # an unknown storage type
        (b"little", b"little"),  # unchanged: a control
    ],
)
def test_patched_globals_fall_back_or_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: bytes, new: bytes
) -> None:
    if old == b"little":
        path = tmp_path / "control.pt"
        torch.save({"w": torch.arange(12.0).reshape(3, 4)}, path)
    else:
        path = _patched(tmp_path, old, new)
    assert_same_both_ways([str(path)], monkeypatch, free=old == b"little")


def test_big_endian_checkpoint_takes_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    name = next(n for n in _names(path) if n.endswith("/byteorder"))
    patch_member(path, name, b"big\0\0\0")
    assert_same_both_ways([str(path)], monkeypatch, free=None)


def _names(path: Path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return archive.namelist()


@pytest.mark.slow
def test_scan_of_a_small_pt_imports_no_torch(tmp_path: Path) -> None:
    path = _save(tmp_path / "small.pt", {"w": torch.tensor([1.0, math.nan]), "step": 3})
    stdout, heavy, code = run_cli("scan", path, "--format", "json", "--device", "cpu")
    assert "torch" not in heavy
    assert "pydantic" not in heavy  # plain option values (gradaudit/cli/coercion.py)
    assert code == 1
    assert '"nan_tensors": 1' in stdout
    _, heavy, _ = run_cli("scan", path, "--engine", "eager")
    assert "torch" in heavy
    assert zip_checkpoint.NotTorchFree.__name__ == "NotTorchFree"
