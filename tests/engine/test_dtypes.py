"""NaN cannot hide in a dtype: complex and every fp8 variant are audited; the rest is a finding.

Complex tensors against a float64 reference computed from their parts in
plain Python; the fp8 variants the native kernel does not know go to the eager
kernel; what still cannot be read is a ``skipped`` finding (a warning, or a
failure with ``--fail-on skipped``), never a silent OK.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit import ExitCode, Thresholds, audit
from gradaudit.cli import app
from gradaudit.engine import native
from gradaudit.engine.dtypes import AUDITED_DTYPES, COMPLEX_DTYPES, FLOAT8_DTYPES
from gradaudit.engine.stats import StatsCollector
from gradaudit.policy import FindingKind, Severity
from gradaudit.results.row import HostRow
from tests.conftest import runner
from tests.reference import Reference
from tests.torch_features import has_dtype, requires_dtype

CPU_ENGINES = ["eager", "native"] if native.available() else ["eager"]


def complex_reference(tensor: torch.Tensor) -> Reference:
    """Stats of a complex tensor from its parts: NaN in either part counts, |z| by hypot."""
    pairs = torch.view_as_real(tensor.detach().to(torch.complex128)).reshape(-1, 2).tolist()
    nan = sum(1 for re, im in pairs if math.isnan(re) or math.isnan(im))
    inf = sum(
        1
        for re, im in pairs
        if not (math.isnan(re) or math.isnan(im)) and (math.isinf(re) or math.isinf(im))
    )
    finite = [(re, im) for re, im in pairs if math.isfinite(re) and math.isfinite(im)]
    max_abs = max((math.hypot(re, im) for re, im in finite), default=0.0)
    norm = 0.0
    if max_abs > 0:
        scaled = math.fsum((re / max_abs) ** 2 + (im / max_abs) ** 2 for re, im in finite)
        norm = max_abs * math.sqrt(scaled)
    zeros = sum(1 for re, im in pairs if re == 0.0 and im == 0.0)
    return Reference(nan=nan, pos_inf=inf, neg_inf=0, zeros=zeros, max_abs=max_abs, norm=norm)


def row_of(tensor: torch.Tensor, engine: str, chunk: int = 1 << 20) -> HostRow:
    row = StatsCollector(chunk, engine=engine).row(tensor)
    return HostRow.from_values(row.cpu().tolist())


def assert_complex_matches(tensor: torch.Tensor, got: Any) -> None:
    ref = complex_reference(tensor)
    counts = (got.nan, got.pos_inf, got.neg_inf, got.zeros)
    assert counts == (ref.nan, ref.pos_inf, ref.neg_inf, ref.zeros)
    assert got.max_abs == pytest.approx(ref.max_abs, rel=1e-12, abs=0.0)
    assert got.norm == pytest.approx(ref.norm, rel=1e-6, abs=0.0)


SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0]


@st.composite
def complex_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(sorted(COMPLEX_DTYPES, key=str)))
    numel = draw(st.integers(0, 40))
    top = {torch.complex32: 3e4, torch.complex64: 1e38, torch.complex128: 1e300}[dtype]
    magnitude = draw(st.sampled_from([1e-3, 1.0, top]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    parts = torch.randn(numel, 2, generator=gen, dtype=torch.float64) * magnitude
    for _ in range(draw(st.integers(0, min(numel, 5)))):
        index = draw(st.integers(0, numel - 1))
        parts[index, draw(st.integers(0, 1))] = draw(st.sampled_from(SPECIALS))
    return torch.view_as_complex(parts).to(dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@settings(derandomize=True, max_examples=120, deadline=None)
@given(tensor=complex_tensors(), chunk=st.sampled_from([1, 3, 16, 1 << 20]))
def test_complex_matches_the_float64_reference(tensor: torch.Tensor, chunk: int) -> None:
    for engine in CPU_ENGINES:
        assert_complex_matches(tensor, row_of(tensor, engine, chunk))


@pytest.mark.parametrize("dtype", sorted(COMPLEX_DTYPES, key=str))
def test_nan_in_the_imaginary_part_only(dtype: torch.dtype) -> None:
    values = torch.tensor([complex(1.0, 2.0), complex(3.0, math.nan), complex(0.0, 0.0)])
    report = audit({"z": values.to(dtype)})
    (stats,) = report.tensors
    assert (stats.nan, stats.zeros, stats.dtype) == (1, 1, str(dtype).removeprefix("torch."))
    assert stats.norm == pytest.approx(math.sqrt(5.0), rel=1e-6)
    assert [f.kind for f in report.findings] == [FindingKind.NAN]


def test_complex_modulus_does_not_overflow_the_parts_dtype() -> None:
    # |3e38 + 3e38i| = 4.24e38 exceeds float32; it is still finite, not an Inf.
    values = torch.tensor([complex(3e38, 3e38), complex(0.0, -math.inf)], dtype=torch.complex64)
    for engine in CPU_ENGINES:
        got = row_of(values, engine)
        assert (got.nan, got.pos_inf, got.neg_inf) == (0, 1, 0)
        assert got.max_abs == pytest.approx(math.hypot(3e38, 3e38), rel=1e-7)


def test_large_complex_tensors_are_chunked_and_bucketed_alike() -> None:
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(300_001, dtype=torch.complex64, generator=gen)
    big[12345] = complex(1.0, math.nan)
    small = torch.randn(7, 3, dtype=torch.complex128, generator=gen).t()  # strided
    report = audit({"big": big, "small": small}, chunk_elements=4096)
    for stats, tensor in zip(report.tensors, (big, small), strict=True):
        assert_complex_matches(tensor, stats)


@pytest.mark.parametrize("dtype", sorted(FLOAT8_DTYPES, key=str))
def test_every_fp8_variant_counts_its_nan(dtype: torch.dtype) -> None:
    # Every bit pattern: the reference is torch's own float64 conversion of each byte.
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    wide = values.to(torch.float64)
    report = audit({"w": values})
    (stats,) = report.tensors
    assert stats.nan == int(wide.isnan().sum()) >= 1
    assert stats.pos_inf + stats.neg_inf == int(wide.isinf().sum())
    finite = wide[wide.isfinite()]
    assert stats.max_abs == float(finite.abs().max())
    assert stats.norm == pytest.approx(math.sqrt(math.fsum(v * v for v in finite.tolist())))


def test_the_fp8_variants_torch_has_are_all_audited() -> None:
    names = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    present = {getattr(torch, n) for n in names if hasattr(torch, n)}
    assert present <= FLOAT8_DTYPES <= AUDITED_DTYPES
    assert len(present) == sum(has_dtype(n) for n in names)


# --- through files ---------------------------------------------------------------------


def safetensors_bytes(dtype: str, shape: list[int], data: bytes) -> bytes:
    header = json.dumps({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    ("dtype", "data"),
    [
        pytest.param(  # 1, NaN, 2
            "F8_E8M0", bytes([127, 255, 128]), marks=requires_dtype("float8_e8m0fnu")
        ),
        ("F8_E4M3FNUZ", bytes([0x40, 0x80])),  # 1, NaN (the "negative zero" pattern)
        ("F8_E5M2FNUZ", bytes([0x40, 0x80])),
        ("F8_E4M3", bytes([0x38, 0x7F])),  # 1, NaN
        ("C64", struct.pack("<4f", 1.0, 0.0, 2.0, math.nan)),  # NaN in the imaginary part
    ],
)
def test_nan_in_a_file_of_each_dtype_fails_the_scan(
    tmp_path: Path, dtype: str, data: bytes
) -> None:
    path = tmp_path / "grads.safetensors"
    width = 8 if dtype == "C64" else 1
    path.write_bytes(safetensors_bytes(dtype, [len(data) // width], data))
    result = runner.invoke(app, ["scan", str(path), "--no-config", "-f", "json"])
    assert result.exit_code == ExitCode.FINDINGS, result.output
    document = json.loads(result.stdout)
    (tensor,) = document["tensors"]
    assert tensor["nan"] == 1
    assert document["skipped"] == []


def test_complex_in_a_torch_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "grads.pt"
    torch.save({"z": torch.tensor([complex(1.0, math.nan), 2j], dtype=torch.complex128)}, path)
    result = runner.invoke(app, ["scan", str(path), "--no-config"])
    assert result.exit_code == ExitCode.FINDINGS
    assert "1 failing finding (nan)" in result.stdout


# --- what still cannot be read ---------------------------------------------------------


def unreadable() -> dict[str, torch.Tensor]:
    """A packed fp4 tensor (no conversion exists), a sparse one with a NaN, an int, a float."""
    return {
        "fp4": torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "sparse": torch.tensor([[0.0, math.nan]]).to_sparse(),
        "step": torch.tensor(3),
        "w": torch.ones(2),
    }


@requires_dtype("float4_e2m1fn_x2")
def test_unread_floating_point_data_is_a_skipped_finding() -> None:
    report = audit(unreadable())
    assert [t.name for t in report.tensors] == ["w"]
    assert {s.name: s.unaudited for s in report.skipped} == {
        "fp4": True,
        "sparse": True,
        "step": False,  # an integer cannot hold a NaN
    }
    skipped = [f for f in report.findings if f.kind is FindingKind.SKIPPED]
    assert [(f.tensor, f.severity) for f in skipped] == [
        ("fp4", Severity.WARNING),
        ("sparse", Severity.WARNING),
    ]
    assert skipped[1].message == "sparse_coo tensors are not audited"
    gated = audit(unreadable(), thresholds=Thresholds(fail_on=frozenset({FindingKind.SKIPPED})))
    assert sum(f.failing for f in gated.findings) == 2


@requires_dtype("float4_e2m1fn_x2")
def test_the_verdict_says_what_was_not_audited(tmp_path: Path) -> None:
    path = tmp_path / "grads.pt"
    torch.save(unreadable(), path)
    warned = runner.invoke(app, ["scan", str(path), "--no-config"], env={"COLUMNS": "200"})
    assert warned.exit_code == ExitCode.OK
    assert "OK: no failing findings (2 warnings, 2 tensors not audited)" in warned.stdout
    gated = runner.invoke(app, ["scan", str(path), "--no-config", "--fail-on", "skipped"])
    assert gated.exit_code == ExitCode.FINDINGS
    assert "FAIL: 2 failing findings (skipped)" in gated.stdout
    markdown = runner.invoke(app, ["scan", str(path), "--no-config", "-f", "markdown"])
    assert "- ⚠️ `fp4`: dtype float4\\_e2m1fn\\_x2 is not supported" in markdown.stdout
    github = runner.invoke(app, ["scan", str(path), "--no-config", "-f", "github"])
    assert "::warning file=" in github.stdout
    assert "title=gradaudit%3A skipped in sparse::" in github.stdout
    document = json.loads(
        runner.invoke(app, ["scan", str(path), "--no-config", "-f", "json"]).stdout
    )
    entries = {s["name"]: s for s in document["skipped"]}
    assert entries["step"]["unaudited"] is False
    assert entries["step"]["findings"] == []
    assert entries["fp4"]["findings"][0]["kind"] == "skipped"
    assert entries["fp4"]["findings"][0]["severity"] == "warning"


def test_our_dtype_codes_are_the_safetensors_librarys(tmp_path: Path) -> None:
    """Written by our writer, read back by the safetensors library: the same dtypes."""
    from safetensors.torch import load_file

    from gradaudit.io.safetensors_writer import write_safetensors

    tensors = {
        str(dtype): torch.tensor([1.0, 2.0]).to(dtype)
        for dtype in sorted(FLOAT8_DTYPES | {torch.complex64}, key=str)
    }
    path = write_safetensors(tmp_path / "all.safetensors", list(tensors.items()))
    loaded = load_file(str(path))
    assert {name: t.dtype for name, t in loaded.items()} == {
        name: t.dtype for name, t in tensors.items()
    }
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8))
