"""The torch-free scan (gradaudit.scan.torch_free) reports exactly what the torch path does.

Every comparison runs the same command twice through the CLI, once as it chooses (the
torch-free path, checked to have run) and once with the torch path forced, and asserts
identical stdout, stderr and exit code in every output format. Both paths share the
rows, the batches and the merge rule, so the numbers agree to the last bit whatever the
machine: that equality, not a tolerance, is the property. The subprocess tests look at
``sys.modules`` of a fresh interpreter: whether ``import torch`` happened is what they test.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gradaudit.cli import app
from gradaudit.comparison import files
from gradaudit.engine import native_rows
from gradaudit.scan import collected, torch_free
from gradaudit.trend import builder
from tests.cli.test_startup import run_cli
from tests.conftest import runner
from tests.hostile import CASES, sharded

needs_native = pytest.mark.skipif(
    not native_rows.available(), reason="the torch-free scan needs the native kernel"
)
FORMATS = ["json", "table", "markdown", "github", "junit"]


#: Each command's torch-free entry point, spied on to see that it ran to the end.
ENTRY = {
    "scan": (torch_free, "scan_torch_free"),
    "compare": (files, "compare_paths_torch_free"),
    "trend": (builder, "trend_paths_torch_free"),
}


def invoke_cli(args: list[str], monkeypatch: pytest.MonkeyPatch, *, torch_path: bool) -> Any:
    """Run a command line (``args[0]`` the command) at a fixed width and clock; returns
    (result, torch-free runs that finished)."""
    ran: list[bool] = []
    module, name = ENTRY[args[0]]
    real = getattr(module, name)

    def spy(*a: Any, **k: Any) -> Any:
        result = real(*a, **k)  # raises NeedsTorch before anything is appended
        ran.append(True)
        return result

    clock = SimpleNamespace(perf_counter=lambda: 0.0)
    with monkeypatch.context() as patch:
        patch.setenv("COLUMNS", "100")
        patch.setattr(collected, "time", clock)
        patch.setattr(builder, "time", clock)
        patch.setattr(module, name, spy)
        if torch_path:
            patch.setattr(torch_free, "applies", lambda **_: False)
        result = runner.invoke(app, args)
    return result, ran


def _invoke(args: list[str], monkeypatch: pytest.MonkeyPatch, *, torch_path: bool) -> Any:
    """:func:`invoke_cli` of ``scan ARGS``."""
    return invoke_cli(["scan", *args], monkeypatch, torch_path=torch_path)


Invoke = Callable[..., tuple[Any, list[bool]]]


def assert_same_both_ways(
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    *,
    free: bool | None = True,
    invoke: Invoke = _invoke,
) -> Any:
    """Both paths give the same output in every format; ``free``: the torch-free one ran
    (``None``: either may have, as for a hostile file the torch-free reader may decline).

    ``invoke`` runs one command line both ways (scan's here; compare's and trend's in
    ``test_torch_free_commands.py``). Returns the torch-free run's JSON document.
    """
    for output_format in FORMATS:
        command = [*args, "--format", output_format, "--device", "cpu"]
        chosen, ran = invoke(command, monkeypatch, torch_path=False)
        forced, ran_forced = invoke(command, monkeypatch, torch_path=True)
        if free is not None:
            assert ran == ([True] if free else []), output_format
        assert ran_forced == []
        assert chosen.exit_code == forced.exit_code, (output_format, chosen.stderr)
        assert chosen.stdout == forced.stdout, output_format
        assert chosen.stderr == forced.stderr, output_format
        assert "Traceback" not in chosen.stderr
    result, _ = invoke(
        [*args, "--format", "json", "--device", "cpu"], monkeypatch, torch_path=False
    )
    return json.loads(result.stdout)


def planted(path: Path, dtype: torch.dtype = torch.float32, *, seed: int = 0) -> Path:
    """NaN, +Inf, -Inf, zeros, huge and tiny values, an empty tensor, a scalar, integers."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(3000, generator=gen, dtype=torch.float64)
    wide[[5, 17]] = math.nan
    wide[100] = math.inf
    wide[200] = -math.inf
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": wide.to(dtype),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(64, 48, generator=gen) * 1e3).to(dtype),
        "model.layers.1.mlp.up_proj.weight": torch.zeros(32, 16, dtype=dtype),
        "model.layers.1.input_layernorm.weight": (torch.rand(16, generator=gen) * 1e-9).to(dtype),
        "model.embed_tokens.weight": torch.randn(200, 64, generator=gen).to(dtype),
        "model.empty": torch.empty(0, 4, dtype=dtype),
        "model.scalar": torch.tensor(-2.5, dtype=dtype),
        "model.position_ids": torch.arange(12, dtype=torch.int64),
        "model.mask": torch.tensor([True, False]),
        "model.codes": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def raw_file(path: Path, entries: list[tuple[str, str, list[int], bytes]]) -> Path:
    """A safetensors file written by hand, tensors at exactly the offsets given by order
    (so one can be misaligned: the format does not promise alignment)."""
    header: dict[str, Any] = {}
    data = b""
    for name, dtype, shape, raw in entries:
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


@needs_native
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
def test_every_native_dtype_reports_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    path = planted(tmp_path / "grads.safetensors", dtype)
    report = assert_same_both_ways([str(path), "--all"], monkeypatch)
    assert report["summary"]["nan_tensors"] >= 1 or dtype is torch.float8_e4m3fn
    assert {s["name"] for s in report["skipped"]} == {
        "model.position_ids",
        "model.mask",
        "model.codes",
    }


@needs_native
def test_fixtures_directory_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    fixtures = str(Path(__file__).resolve().parents[2] / "fixtures")
    assert_same_both_ways([fixtures, "--all"], monkeypatch)
    assert_same_both_ways([fixtures, "--include", "*layers.1*", "--exclude", "*bias"], monkeypatch)
    assert_same_both_ways([fixtures, "--kind", "gradients", "--top", "2"], monkeypatch)
    assert_same_both_ways(
        [fixtures, "--exploding-threshold", "10", "--max-global-norm", "5", "--fail-on", "nan"],
        monkeypatch,
    )


@needs_native
def test_sharded_set_bad_files_and_good_ones_in_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = sharded(tmp_path / "sharded")
    good = planted(tmp_path / "good.safetensors", torch.bfloat16)
    bad = [
        str(CASES[name].build(_folder(tmp_path / name)))
        for name in (
            "truncated-safetensors",
            "header-not-json",
            "duplicate-tensor-names",
            "trailing-bytes",
            "missing-file",
            "empty-safetensors",
        )
    ]
    shard_bad = CASES["shard-corrupt"].build(_folder(tmp_path / "shard-bad"))
    report = assert_same_both_ways([str(index), str(good), *bad, str(shard_bad)], monkeypatch)
    assert len(report["errors"]) == len(bad) + 1
    assert [f["tensors"] for f in report["files"][:2]] == [3, 7]


@needs_native
def test_directory_of_shards_and_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    sharded(folder)
    planted(folder / "extra.safetensors")
    assert_same_both_ways([str(tmp_path), "--recursive"], monkeypatch)
    assert_same_both_ways([str(folder), "--exclude", "model.layers.*"], monkeypatch)


@needs_native
def test_many_tiny_tensors_and_batches_past_their_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of thousands of tiny tensors (past a batch's 2048), interleaved with tensors
    large enough to be split between threads and to fill a batch's 64 MiB."""
    gen = torch.Generator().manual_seed(1)
    tensors = {f"lora.{i}.A": torch.randn(8, 4, generator=gen) for i in range(5000)}
    tensors["lora.17.A"][0, 0] = math.nan
    for i in range(5):
        tensors[f"big.{i}"] = torch.randn(4 << 20, generator=gen) * (10.0**i)
    tensors.update({f"tail.{i}.B": torch.randn(4, 8, generator=gen) for i in range(3000)})
    path = tmp_path / "many.safetensors"
    save_file(tensors, str(path))
    assert len(tensors) > native_rows.NATIVE_BATCH_TENSORS
    assert sum(t.numel() * 4 for t in tensors.values()) > native_rows.NATIVE_BATCH_BYTES
    outputs = {}
    for output_format in ("json", "table"):
        command = [str(path), "--format", output_format, "--device", "cpu"]
        chosen, ran = _invoke(command, monkeypatch, torch_path=False)
        forced, _ = _invoke(command, monkeypatch, torch_path=True)
        assert ran == [True]
        assert (chosen.exit_code, chosen.stdout) == (forced.exit_code, forced.stdout)
        outputs[output_format] = chosen.stdout
    report = json.loads(outputs["json"])
    assert report["summary"]["tensors"] == len(tensors)
    assert report["summary"]["nan_tensors"] == 1
    finite = [t.double() for name, t in tensors.items() if name != "lora.17.A"]
    finite.append(tensors["lora.17.A"].double().nan_to_num(0.0))
    expected = math.sqrt(sum(float((t * t).sum()) for t in finite))
    assert report["summary"]["global_norm"] == pytest.approx(expected, rel=1e-12)


@needs_native
def test_misaligned_and_empty_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.array([1.0, -2.0, np.nan, np.inf], dtype=np.float32).tobytes()
    path = raw_file(
        tmp_path / "odd.safetensors",
        [
            ("pad", "U8", [3], b"\1\2\3"),
            ("odd.weight", "F32", [4], values),  # starts 3 bytes into the data: misaligned
            ("none.weight", "F32", [0], b""),
            ("half.weight", "F16", [2], np.array([0.5, 65504], dtype=np.float16).tobytes()),
        ],
    )
    report = assert_same_both_ways([str(path), "--all"], monkeypatch)
    by_name = {t["name"]: t for t in report["tensors"]}
    assert set(by_name) == {"odd.weight", "none.weight", "half.weight"}
    assert (by_name["odd.weight"]["nan"], by_name["odd.weight"]["pos_inf"]) == (1, 1)
    assert by_name["odd.weight"]["norm"] == pytest.approx(math.sqrt(5.0), rel=1e-15)
    assert by_name["none.weight"]["norm"] == 0.0
    assert [s["name"] for s in report["skipped"]] == ["pad"]


@needs_native
def test_dtypes_only_torch_reports_fall_back_to_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """complex64 and the fp8 "fnuz" formats are audited by torch's eager kernel."""
    good = planted(tmp_path / "a.safetensors")
    odd = tmp_path / "b.safetensors"
    save_file(
        {
            "w": torch.randn(6),
            "z": torch.randn(3, dtype=torch.complex64),
            "f": torch.randn(4).to(torch.float8_e4m3fnuz),
        },
        str(odd),
    )
    report = assert_same_both_ways([str(good), str(odd)], monkeypatch, free=False)
    assert report["files"][1]["tensors"] == 3


def test_the_choice_of_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch_free, "gpu_may_exist", lambda: False)
    if native_rows.available():
        assert torch_free.applies(device="auto", engine="auto")
        assert torch_free.applies(device=" CPU ", engine="native")
    assert not torch_free.applies(device="cuda", engine="auto")
    assert not torch_free.applies(device="cpu", engine="eager")
    assert not torch_free.applies(device="cpu", engine="triton")
    assert not torch_free.applies(device="cpu", engine="auto", distributed=True)
    monkeypatch.setattr(torch_free, "gpu_may_exist", lambda: True)
    assert not torch_free.applies(device="auto", engine="auto")
    assert torch_free.applies(device="cpu", engine="auto") == native_rows.available()
    monkeypatch.setattr(native_rows, "_module", None)  # not built
    assert not torch_free.applies(device="cpu", engine="auto")

    from gradaudit.io import expand_inputs

    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")
    assert torch_free.takes(expand_inputs([tmp_path / "a.safetensors", tmp_path / "x.safetensors"]))
    assert not torch_free.takes(expand_inputs([tmp_path / "a.safetensors", tmp_path / "x.txt"]))
    assert torch_free.takes(expand_inputs([tmp_path]))  # a.safetensors and b.pt
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    assert not torch_free.takes(expand_inputs([tmp_path / "dcp"]))  # a DCP checkpoint: torch
    assert torch_free.takes(expand_inputs([sharded(tmp_path / "s")]))
    assert torch_free.takes(expand_inputs([tmp_path / "a.safetensors", tmp_path / "b.pt"]))


def test_without_the_native_kernel_the_torch_path_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = planted(tmp_path / "grads.safetensors")
    monkeypatch.setattr(native_rows, "_module", None)
    result, ran = _invoke(
        [str(path), "--format", "json", "--device", "cpu"], monkeypatch, torch_path=False
    )
    assert ran == []
    assert json.loads(result.stdout)["engine"] == "eager"


@pytest.mark.slow
@needs_native
def test_scan_of_safetensors_imports_no_torch(tmp_path: Path) -> None:
    path = planted(tmp_path / "grads.safetensors")
    stdout, heavy, code = run_cli("scan", str(path), "--format", "json", "--device", "cpu")
    assert code == 1  # NaN and Inf planted
    assert "torch" not in heavy
    report = json.loads(stdout)
    assert report["engine"] == "native"
    assert report["summary"]["nan_tensors"] == 1
    _, heavy, _ = run_cli("scan", str(path), "--engine", "eager")
    assert "torch" in heavy


@pytest.mark.slow
def test_thread_count_without_torch_is_torchs(tmp_path: Path) -> None:
    """Without torch the native kernel splits its calls between as many threads as torch
    would use: compared with torch in a fresh interpreter, with the environment variables
    torch reads set (malformed ones included, which OpenMP ignores) and with the process
    pinned to one CPU (``taskset -c 0``: torch starts one thread). Unpinned and without
    them the count is the machine's physical cores, which this test leaves alone: CI may
    run on another CPU (docs/performance.md gives where the two can differ; only the last
    bits of a norm would)."""
    code = (
        "import os, sys\n"
        "first = min(os.sched_getaffinity(0))\n"
        "if sys.argv[1] == 'pinned': os.sched_setaffinity(0, {first})\n"
        "from gradaudit.engine.native_rows import torch_default_threads as t\n"
        "guess = t()\nimport torch\nprint(guess, torch.get_num_threads())"
    )
    cases = [
        {"OMP_NUM_THREADS": "1"},
        {"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "64"},
        {"MKL_NUM_THREADS": "1x"},
        {"OMP_NUM_THREADS": "1x"},
        {"OMP_NUM_THREADS": "1e1"},
        {"OMP_NUM_THREADS": "0"},
        {"OMP_NUM_THREADS": "1,2"},
        {},
    ]
    for env in cases:
        for pinning in ("pinned", "free") if env != {} else ("pinned",):
            environ = {
                k: v
                for k, v in os.environ.items()
                if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
            }
            done = subprocess.run(
                [sys.executable, "-c", code, pinning],
                capture_output=True,
                text=True,
                env={**environ, **env},
                check=True,
                timeout=120,
            )
            guess, real = done.stdout.split()
            assert guess == real, (env, pinning)


def test_the_host_half_of_the_engine_imports_no_torch() -> None:
    """What the torch-free scan loads: the readers' package, the host half, the row."""
    code = (
        "import sys\n"
        "import gradaudit.io, gradaudit.io.safetensors_map, gradaudit.io.sharded\n"
        "import gradaudit.scan.torch_free, gradaudit.scan.collected, gradaudit.results.row\n"
        "import gradaudit.engine.native_rows, gradaudit.scan.torchrun\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"
