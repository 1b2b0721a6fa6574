"""The Triton single-pass kernel against the float64 reference.

On a machine with CUDA the kernel is compiled and runs on the GPU; without
CUDA (CI) it runs through Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set here before the kernel is first built), which
executes the same kernel source with the same integer and float semantics.
What the interpreter cannot tell is speed: that is ``benchmarks/bench_gpu.py``.
"""

from __future__ import annotations

import math
import platform
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit import audit
from gradaudit.engine import triton_kernel
from gradaudit.engine.kernels import Engine
from gradaudit.engine.routes import EngineUnavailable, uses_triton
from gradaudit.engine.stats import SCALE, SSQ, StatsCollector
from gradaudit.results.row import HostRow
from gradaudit.scan.pending import PendingStats
from tests.engine.interpreted import DEVICE  # the interpreter, before a kernel is built
from tests.engine.test_native import flat_tensors
from tests.engine.test_stats import assert_matches_reference
from tests.reference import reference_stats

#: Slow (not in the quick loop): the Triton kernel through its interpreter on the CPU.
pytestmark = pytest.mark.slow

TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

needs_triton = pytest.mark.skipif(
    not triton_kernel.installed(), reason="Triton is not installed on this platform"
)


def test_triton_is_installed_where_the_test_install_provides_it() -> None:
    """The dev extra installs Triton on Linux x86-64 (CI): missing there must fail, not skip."""
    if sys.platform == "linux" and platform.machine() == "x86_64":
        assert triton_kernel.installed()
        assert triton_kernel.runs_on(DEVICE)


def triton_rows(block: torch.Tensor) -> list[HostRow]:
    rows = triton_kernel.TritonKernel()(block.to(DEVICE))
    return [HostRow.from_values(row) for row in rows.cpu().tolist()]


def triton_inputs() -> st.SearchStrategy[torch.Tensor]:
    """Lengths around the kernel's 1024-element steps and 16384-element spans."""
    return flat_tensors(
        TRITON_DTYPES, boundaries=(1023, 1024, 1025, 16383, 16384, 16385, 33_000), longest=40_000
    )


@needs_triton
@settings(derandomize=True, max_examples=60, deadline=None)
@given(tensor=triton_inputs())
def test_triton_matches_float64_reference(tensor: torch.Tensor) -> None:
    (row,) = triton_rows(tensor.reshape(1, -1))
    assert_matches_reference(tensor, row)


@needs_triton
def test_every_float16_and_bfloat16_bit_pattern() -> None:
    """All 65,536 patterns: NaN payloads, both infinities, subnormals, both zeros."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        tensor = bits.view(dtype)
        (row,) = triton_rows(tensor.reshape(1, -1))
        assert_matches_reference(tensor, row)


@needs_triton
@pytest.mark.parametrize(
    "values",
    [
        [3.0e38, -3.0e38, 1.0],  # squares far past float32's range
        [1e-45, -1e-45, 1.2e-38],  # float32 subnormals: kept, never flushed
        [0.0, -0.0, 0.0],
        [math.nan, math.inf, -math.inf],  # no finite element: max 0, norm 0
    ],
)
def test_float32_range_extremes(values: list[float]) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    (row,) = triton_rows(tensor.reshape(1, -1))
    assert_matches_reference(tensor, row)


@needs_triton
@pytest.mark.parametrize("length", [64, 1000, 16384, 40_000])
def test_bucket_rows_are_reduced_one_by_one(length: int) -> None:
    """A block of many rows (a bucket, or rows longer than one program's span)."""
    gen = torch.Generator().manual_seed(length)
    block = torch.randn((5, length), generator=gen)
    block[1, -1] = math.nan
    block[2, 0] = -math.inf
    block[3] = 0.0
    block[4, length // 2] = 7e37
    for row, got in zip(block, triton_rows(block), strict=True):
        assert_matches_reference(row, got)


@needs_triton
@pytest.mark.parametrize(
    "settings",
    [{"STAGES": 3}, {"PROGRAMS_PER_SM": 8}, {"STAGES": 2, "PROGRAMS_PER_SM": 1}],
    ids=["3 stages", "8 programs per SM", "2 stages, 1 program per SM"],
)
def test_the_launch_variants_the_gpu_check_measures_agree_with_the_reference(
    monkeypatch: pytest.MonkeyPatch, settings: dict[str, int]
) -> None:
    """The GPU check's ``launch-shapes`` settings change how a flush is cut into programs
    and how its loop loads, not what it computes: mixed dtypes, views at odd offsets, a
    NaN, an infinity and tensors of several programs, against the float64 reference.
    (The interpreter runs a pipelined loop as a plain one: the check compares the GPU's
    rows with the reference too.)"""
    for name, value in settings.items():
        monkeypatch.setattr(triton_kernel, name, value)
    gen = torch.Generator().manual_seed(7)
    parent = torch.randn(300_000, generator=gen)
    parent[[11, 200_000]] = torch.tensor([math.nan, -math.inf])
    tensors = {
        "long": parent,
        "view": parent[3:150_001],
        "half": torch.randn(70_001, generator=gen).half(),
        "bf16": (torch.randn(40_000, generator=gen) * 1e30).bfloat16()[5:],
        "short": torch.randn(999, generator=gen),
    }
    report = audit({name: t.to(DEVICE) for name, t in tensors.items()}, engine="triton")
    assert report.engine == "triton"
    got = {stats.name: stats for stats in report.tensors}
    for name, tensor in tensors.items():
        assert_matches_reference(tensor, got[name])


@needs_triton
def test_collector_sends_what_triton_takes_and_the_rest_to_eager() -> None:
    """float32/16/bf16 on Triton (whole, bucketed, strided); float64 and fp8 on eager."""
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(70_000, generator=gen)
    big[[5, 40_000]] = torch.tensor([math.nan, math.inf])
    tensors = {
        "big": big,
        "half": torch.randn(3000, generator=gen).half(),
        "bf16": (torch.randn(300, 17, generator=gen) * 1e30).bfloat16(),
        "strided": torch.randn(400, 90, generator=gen).t(),
        "tiny": torch.tensor([0.0, -2.0]),
        "double": torch.tensor([1e300, -1e300, 3.0], dtype=torch.float64),
        "fp8": torch.tensor([1.0, -448.0, 0.0]).to(torch.float8_e4m3fn),
    }
    collector = StatsCollector(engine="triton")
    rows = [collector.row(t.to(DEVICE)) for t in tensors.values()]
    for tensor, values in zip(tensors.values(), torch.stack(rows).cpu().tolist(), strict=True):
        assert_matches_reference(tensor, HostRow.from_values(values))
    assert collector.engine_used == "triton+eager"

    only_triton = StatsCollector(engine="triton")
    only_triton.row(big.to(DEVICE))
    assert only_triton.engine_used == "triton"


@needs_triton
def test_audit_with_triton_equals_eager_and_the_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    tensors = {f"layer{i}.weight": torch.randn(i * 997 + 1, generator=gen) for i in range(40)}
    tensors["layer3.weight"][17] = math.nan
    tensors["layer7.weight"][0] = -math.inf
    with_triton = audit(tensors, engine="triton", device=DEVICE)
    eager = audit(tensors, engine="eager", device=DEVICE)
    assert with_triton.engine == "triton"
    assert [f.tensor for f in with_triton.findings] == [f.tensor for f in eager.findings]
    assert with_triton.findings
    for got, want in zip(with_triton.tensors, eager.tensors, strict=True):
        ref = reference_stats(tensors[got.name])
        assert (got.nan, got.pos_inf, got.neg_inf, got.zeros) == (
            want.nan,
            want.pos_inf,
            want.neg_inf,
            want.zeros,
        )
        assert got.max_abs == want.max_abs == ref.max_abs
        assert got.norm == pytest.approx(ref.norm, rel=1e-12)
    assert with_triton.summary.global_norm == pytest.approx(eager.summary.global_norm, rel=1e-12)


def test_auto_uses_triton_for_cuda_tensors_only() -> None:
    """``auto`` never sends CPU tensors to Triton's interpreter: they are native's."""
    assert uses_triton(Engine.AUTO) == triton_kernel.installed()
    assert uses_triton(Engine.TRITON)
    assert not uses_triton(Engine.EAGER)
    collector = StatsCollector(engine="auto")
    collector.row(torch.randn(20_000))
    assert "triton" not in collector.engine_used


def test_triton_engine_without_triton_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(triton_kernel, "installed", lambda: False)
    assert not uses_triton(Engine.AUTO)
    with pytest.raises(EngineUnavailable, match="Triton is not installed"):
        StatsCollector(engine="triton")


def _broken_kernel() -> object:
    raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


@pytest.fixture(autouse=True)
def _no_recorded_failure() -> Iterator[None]:
    """A compile failure is remembered per process: each test starts and ends without one."""
    triton_kernel.reset_failure()
    yield
    triton_kernel.reset_failure()


@needs_triton
def test_auto_goes_on_with_eager_when_triton_cannot_compile_and_never_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No C compiler for Triton's launcher, say: auto's numbers come from eager instead,
    and the failure is remembered for the process: the next collector does not try again."""
    monkeypatch.setattr("gradaudit.engine.native_rows._module", None)  # auto -> eager on the CPU
    tries: list[int] = []

    def broken() -> object:
        tries.append(1)
        return _broken_kernel()

    monkeypatch.setattr(triton_kernel, "_kernels", broken)
    gen = torch.Generator().manual_seed(2)
    tensor = torch.randn(50_000, generator=gen).half()
    tensor[[3, 40_000]] = torch.tensor([math.nan, -math.inf], dtype=torch.half)
    pieces = {"whole": tensor, "head": tensor[:100], "tail": tensor[1:], "big": tensor.repeat(2)}
    for _ in range(2):
        collector = StatsCollector(engine="auto", chunk_elements=4096)
        collector._routes.devices = frozenset({"cuda", "cpu"})  # as it would for CUDA tensors
        collector._routes.off_cuda = True
        pending = PendingStats(collector=collector)
        pending.add_all({name: piece.to(DEVICE) for name, piece in pieces.items()})
        rows = [collector.row(tensor.to(DEVICE)), *pending.rows]
        for got, values in zip(
            (tensor, *pieces.values()), torch.stack(rows).cpu().tolist(), strict=True
        ):
            assert_matches_reference(got, HostRow.from_values(values))
        assert collector.engine_used == "eager"
    assert len(tries) == 1
    assert triton_kernel.failure() == (
        "RuntimeError: Failed to find C compiler. Please specify via CC environment variable."
    )


@needs_triton
def test_triton_by_name_that_cannot_compile_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(triton_kernel, "_kernels", _broken_kernel)
    collector = StatsCollector(engine="triton")
    with pytest.raises(EngineUnavailable, match=r"could not run \(RuntimeError: Failed to find C"):
        collector.row(torch.ones(10, device=DEVICE))
    # Remembered: asking again fails at once, without compiling.
    with pytest.raises(EngineUnavailable, match="could not run"):
        StatsCollector(engine="triton")


def test_cuda_tensors_never_go_to_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``TRITON_INTERPRET=1`` CUDA tensors go to eager; without it, to the compiled kernel.

    Pure logic on ``torch.device`` objects: checkable without a GPU.
    """
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    monkeypatch.setattr(triton_kernel, "installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_kernel.runs_on(cuda)
    assert triton_kernel.runs_on(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_kernel.runs_on(cuda)
    assert not triton_kernel.runs_on(cpu)
    monkeypatch.setattr(triton_kernel, "installed", lambda: False)
    assert not triton_kernel.runs_on(cuda)


@pytest.mark.parametrize("numel", [1, 1000, 1 << 20, 3 << 24, 1 << 34])
@pytest.mark.parametrize("sms", [1, 108, 132])
def test_spans_are_whole_steps_sized_to_the_tensor(numel: int, sms: int) -> None:
    span = triton_kernel.span_for(numel, sms)
    assert span % triton_kernel.BLOCK == 0
    assert triton_kernel.MIN_SPAN <= span <= triton_kernel.MAX_SPAN
    programs = -(-numel // span)
    # PROGRAMS_PER_SM programs per SM whenever the tensor has the work for them, none wasted.
    per_sm = triton_kernel.PROGRAMS_PER_SM * sms
    assert programs >= min(per_sm, -(-numel // triton_kernel.MAX_SPAN), -(-numel // 1024))
    assert span == triton_kernel.MIN_SPAN or programs <= per_sm or span == triton_kernel.MAX_SPAN


class _CountingKernels:
    """The real kernels, with their launches counted."""

    def __init__(self, kernels: tuple[object, object]) -> None:
        self.kernels = kernels
        self.launches: list[str] = []

    def __call__(self) -> tuple[object, object]:
        rows, merge = self.kernels
        return self._counted(rows, "rows"), self._counted(merge, "merge")

    def _counted(self, kernel: object, name: str) -> object:
        outer = self

        class Launcher:
            def __getitem__(self, grid: object) -> object:
                launch = kernel[grid]  # type: ignore[index]

                def run(*args: object, **kwargs: object) -> object:
                    outer.launches.append(name)
                    return launch(*args, **kwargs)

                return run

        return Launcher()


@needs_triton
def test_one_launch_per_dtype_and_one_merge_per_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed dtypes and sizes, views at unaligned offsets, tensors far apart in memory:
    every row right, from one launch per dtype plus one merge."""
    counting = _CountingKernels(triton_kernel._kernels())
    monkeypatch.setattr(triton_kernel, "_kernels", counting)
    gen = torch.Generator().manual_seed(4)
    tensors = [
        torch.randn(n, generator=gen).to(dtype)
        for n, dtype in [
            (5, torch.float32),
            (40_000, torch.float32),
            (1025, torch.bfloat16),
            (3, torch.float16),
            (70_000, torch.float32),
            (17, torch.bfloat16),
            (2048, torch.float16),
        ]
    ]
    tensors[1][7] = math.nan
    tensors[4][-1] = -math.inf
    tensors[2][0] = 0.0
    tensors[6][5:9] = torch.tensor([math.inf, -math.inf, math.nan, 0.0], dtype=torch.float16)
    parent = torch.randn(4099, generator=gen)
    tensors += [parent[1:], parent[3:4002], parent[2:][::1]]  # 4-, 12- and 8-byte offsets
    pending = PendingStats(engine="triton")
    pending.add_all((str(i), t.to(DEVICE)) for i, t in enumerate(tensors))
    rows = pending.rows
    assert counting.launches == ["rows", "rows", "rows", "merge"]
    assert pending._collector.engine_used == "triton"
    for tensor, values in zip(tensors, torch.stack(list(rows)).cpu().tolist(), strict=True):
        assert_matches_reference(tensor, HostRow.from_values(values))


@needs_triton
def test_a_flush_of_one_program_per_tensor_writes_its_rows_without_a_merge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every tensor shorter than its group's span (a small model, many tiny tensors): each
    program's row is its tensor's stats row, written in place by ``table_rows`` (``DIRECT``),
    and no merge is launched; every row right, in the tickets' order, edges, NaN and ±Inf
    (the exact path) included. One tensor a span longer and the flush merges again."""
    counting = _CountingKernels(triton_kernel._kernels())
    monkeypatch.setattr(triton_kernel, "_kernels", counting)
    gen = torch.Generator().manual_seed(7)
    parent = torch.randn(5000, generator=gen)
    tensors = [
        torch.randn(n, generator=gen).to(dtype)
        for n, dtype in [
            (3, torch.float16),
            (1000, torch.float32),
            (4097, torch.bfloat16),
            (1, torch.bfloat16),
            (triton_kernel.MIN_SPAN, torch.float32),
            (777, torch.float16),
        ]
    ] + [parent[1:], parent[5:4003]]  # misaligned views: heads
    tensors[1][10] = math.nan
    tensors[2][-1] = -math.inf
    tensors[5][:4] = torch.tensor([math.inf, 0.0, -0.0, math.nan], dtype=torch.float16)
    for extra, launches in [([], ["rows"] * 3), ([torch.randn(40_000, generator=gen)], None)]:
        counting.launches.clear()
        pending = PendingStats(engine="triton")
        pending.add_all((str(i), t.to(DEVICE)) for i, t in enumerate(tensors + extra))
        rows = pending.rows
        assert counting.launches == (launches or ["rows", "rows", "rows", "merge"])
        values = torch.stack(list(rows)).cpu().tolist()
        for tensor, row in zip(tensors + extra, values, strict=True):
            assert_matches_reference(tensor, HostRow.from_values(row))


def test_a_flush_is_direct_only_when_every_tensor_is_one_program() -> None:
    # rows count a sentinel per group: 5 tensors in 2 groups are 7 rows.
    assert triton_kernel.is_direct(rows=7, programs=5, groups=2)
    assert not triton_kernel.is_direct(rows=7, programs=6, groups=2)
    assert triton_kernel.is_direct(rows=1, programs=0, groups=1)  # nothing to reduce


@needs_triton
def test_byte_counters_do_not_carry_at_the_longest_span() -> None:
    """Spans sized for one SM grow to MAX_SPAN on any device (the batch is told, not a
    module default that CUDA ignores); every element NaN (or zero) fills each lane's byte
    as far as it goes (MAX_STEPS steps plus both edges), and the counts stay exact.
    ``tests/engine/test_cuda.py`` runs the longest span with the GPU's real SM count."""
    length = 4 * triton_kernel.MAX_SPAN + 3
    assert triton_kernel.span_for(length, 1) == triton_kernel.MAX_SPAN
    nan = torch.full((length + 1,), math.nan, dtype=torch.bfloat16, device=DEVICE)[1:]  # both edges
    zeros = torch.zeros(length, dtype=torch.float16, device=DEVICE)
    # An aligned first tensor: the group's base.
    anchor = torch.ones(8, dtype=torch.bfloat16, device=DEVICE)
    batch = triton_kernel.TritonBatch(DEVICE, sms=1)
    for ticket, tensor in enumerate((anchor, nan, zeros)):
        assert batch.add(tensor, ticket)
    recorded: list[int] = []
    kernels = triton_kernel._kernels()

    class Spans:
        """The real kernels, with each launch's table spans recorded."""

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(base: torch.Tensor, table: torch.Tensor, *args: Any, **kw: Any) -> None:
                # The launch's table is its group's rows, then the later groups'.
                recorded.extend(sorted(set(table[table[:, 2] > 0, 3].tolist())))
                kernels[0][grid](base, table, *args, **kw)

            return launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_kernel, "_kernels", lambda: (Spans(), kernels[1]))
        out, tickets = batch.launch()
    # One span per dtype group, the group's whole size on one SM: the longest.
    assert recorded == [triton_kernel.MAX_SPAN, triton_kernel.MAX_SPAN]
    rows = dict(zip(tickets, out.cpu().tolist(), strict=True))
    got_nan, got_zeros = HostRow.from_values(rows[1]), HostRow.from_values(rows[2])
    assert (got_nan.nan, got_nan.zeros, got_nan.pos_inf, got_nan.neg_inf) == (length, 0, 0, 0)
    assert (got_zeros.nan, got_zeros.zeros, got_zeros.norm) == (0, length, 0.0)


def _batch_rows(tensors: list[torch.Tensor], sms: int = triton_kernel.DEFAULT_SMS) -> list[HostRow]:
    """Each tensor's row from one batch (one launch per dtype), in order."""
    batch = triton_kernel.TritonBatch(DEVICE, sms=sms)
    for ticket, tensor in enumerate(tensors):
        assert batch.add(tensor, ticket)
    out, tickets = batch.launch()
    rows = dict(zip(tickets, out.cpu().tolist(), strict=True))
    return [HostRow.from_values(rows[ticket]) for ticket in range(len(tensors))]


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("neighbour", [0.0, 5.0, math.nan])
@pytest.mark.parametrize("base", ["below", "above"])
def test_views_at_every_offset_read_their_own_elements_only(
    dtype: torch.dtype, neighbour: float, base: str
) -> None:
    """Views at element offsets 0..17 (heads at every misalignment, a bfloat16 word's half
    outside the view at both ends), lengths that end inside a word and inside each tail
    vector, addressed from a base below them (positive offsets) or above them (negative
    offsets, where integer division would truncate the wrong way): zeros, NaN or plain
    values just outside a view must not be counted, and the views' own zeros at their
    edges must be."""
    size = 3 * triton_kernel.STEP + 128
    storage = torch.full((size,), neighbour, dtype=dtype, device=DEVICE)
    anchor = storage[:8] if base == "below" else storage[size - 16 : size - 8]  # aligned
    region = storage[8 : size - 16]
    views = []
    for offset in range(18):
        length = [1, 7, 9, triton_kernel.BLOCK + 3, 2 * triton_kernel.STEP + 5][offset % 5]
        views.append(region[offset : offset + length])
    gen = torch.Generator().manual_seed(5)
    # Views overlap: fill them, then compare each with what it holds at the launch.
    for index, view in enumerate(views):
        values = torch.randn(view.numel(), generator=gen).to(dtype)
        # Zeros and non-zeros at both edges (a lost edge element would read as a zero).
        values[0] = 0.0 if index % 2 else -2.5
        values[-1] = 0.0 if index % 3 else 3.0
        view.copy_(values)
    expected = [view.cpu().clone() for view in views]
    rows = _batch_rows([anchor, *views])[1:]
    for tensor, row in zip(expected, rows, strict=True):
        assert_matches_reference(tensor, row)


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_a_nan_sends_only_its_own_program_to_the_exact_path(dtype: torch.dtype) -> None:
    """A tensor of several programs with one NaN, one -Inf and one +Inf in different
    programs, beside a healthy tensor: the exact path's counts and finite maximum where
    they are, the fast path's elsewhere, merged into the same row the reference gives."""
    gen = torch.Generator().manual_seed(17)
    length = 5 * triton_kernel.MIN_SPAN + 1001
    sick = (torch.randn(length, generator=gen) * 3).to(dtype)
    sick[::97] = 0.0
    sick[triton_kernel.MIN_SPAN + 5] = math.nan
    sick[3 * triton_kernel.MIN_SPAN] = -math.inf
    sick[-1] = math.inf
    sick[2 * triton_kernel.MIN_SPAN + 7] = 60000.0 if dtype == torch.float16 else 1e30
    healthy = (torch.randn(length, generator=gen)).to(dtype)
    rows = _batch_rows([sick.to(DEVICE), healthy.to(DEVICE)])
    assert_matches_reference(sick, rows[0])
    assert_matches_reference(healthy, rows[1])
    assert (rows[0].nan, rows[0].pos_inf, rows[0].neg_inf) == (1, 1, 1)


@pytest.fixture
def float32_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """The variant GPUs with slow float64 run (A10, RTX 4090, ...), through the interpreter."""
    monkeypatch.setattr(triton_kernel, "FP32_ACCUMULATE", True)


@needs_triton
def test_float32_sums_every_float16_and_bfloat16_bit_pattern(float32_sums: None) -> None:
    """Both zeros, subnormals (scaled up), the largest bfloat16 (scaled down), NaN, ±Inf."""
    test_every_float16_and_bfloat16_bit_pattern()


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("scale", [1e-38, 1e-20, 1.0, 1e18, 1e37])
def test_float32_sums_across_the_range(
    dtype: torch.dtype, scale: float, float32_sums: None
) -> None:
    """Each magnitude class alone and mixed: the compensated float32 sums match float64."""
    gen = torch.Generator().manual_seed(int(math.log10(scale)) + 50)
    values = torch.randn(70_001, generator=gen, dtype=torch.float64) * scale
    values[::7] *= 1e30 if dtype == torch.bfloat16 else 1.0
    tensor = values.to(dtype)
    (row,) = triton_rows(tensor.reshape(1, -1))
    assert_matches_reference(tensor, row)
    ref = reference_stats(tensor)
    assert row.norm == pytest.approx(ref.norm, rel=1e-12)


@needs_triton
@pytest.mark.parametrize("magnitude", [3.38e38, 2.0**59.99, 2.0**58.99, 2.0**-63.01, 1e-40])
def test_float32_sums_of_the_largest_bfloat16_do_not_overflow(
    magnitude: float, float32_sums: None
) -> None:
    """Every element at the top of a magnitude class (the largest bfloat16, just under
    2**60 and 2**59, just under 2**-63, a subnormal), at the longest span and from an odd
    offset (a head, 126 body vectors and a two-vector tail: a bfloat16 word-lane of the
    fast path adds two squares per vector, 258 per program): each class's float32 sum
    keeps room for them, so the norm stays finite and exact."""
    length = 4 * triton_kernel.MAX_SPAN + 3
    parent = torch.full((length + 1,), magnitude, dtype=torch.bfloat16)
    parent[1::2] *= -1
    tensor = parent[1:]
    anchor = torch.ones(8, dtype=torch.bfloat16)
    _, row = _batch_rows([anchor.to(DEVICE), tensor.to(DEVICE)], sms=1)
    assert_matches_reference(tensor, row)
    assert row.norm == pytest.approx(reference_stats(tensor).norm, rel=1e-12)


#: docs/gpu.md: float32 tensors through float32 sums, relative error of the sum of squares
#: at most 2**-34 (the rest's terms rounded once) + (2n - 1)**2 * 2**-48 (n = 130 elements
#: per lane, two terms each): 3.0e-10.
FLOAT32_SUMS_BOUND = 2.0**-34 + 259**2 * 2.0**-48


def _float32_cases() -> dict[str, torch.Tensor]:
    """Adversarial float32 data for the float32 sums: every class edge, float32's largest
    values, subnormals, a huge dynamic range, and 10**6 full-mantissa values (each
    square's rest rounded: the most the rounding can add up to)."""
    gen = torch.Generator().manual_seed(34)
    below = math.nextafter
    edges = []
    for edge in (2.0**29, 2.0**-70, 2.0**59, 2.0**-40):
        edges += [below(edge, 0.0), edge, below(edge, math.inf)]
    edges += [3.4028234663852886e38, 3.0e38, 1.17549435e-38, 1e-45, 1.4e-44, 1.0]
    mantissas = 1 + (2 * torch.randint(0, 1 << 22, (10**6,), generator=gen).double() + 1) / 2**23
    log_uniform = torch.exp(torch.rand(200_003, generator=gen, dtype=torch.float64) * 170 - 100)
    return {
        "class edges": torch.tensor(edges * 3000, dtype=torch.float64),
        "near float32 max": torch.full((262_147,), 3.4e38, dtype=torch.float64),
        "subnormals": torch.randint(1, 1 << 23, (100_003,), generator=gen).double() * 2.0**-149,
        "dynamic range": log_uniform * torch.where(torch.rand(200_003, generator=gen) < 0.5, -1, 1),
        "10**6 full mantissas": mantissas,
    }


@needs_triton
@pytest.mark.parametrize("case", list(_float32_cases()))
def test_float32_sums_of_float32_tensors_are_within_the_documented_bound(
    case: str, float32_sums: None
) -> None:
    """Against ``math.fsum`` of the float64 squares (exact), at the longest span (one SM)."""
    tensor = _float32_cases()[case].to(torch.float32)
    assert torch.isfinite(tensor).all()
    (row,) = _batch_rows([tensor.to(DEVICE)], sms=1)
    values = row.norm**2
    exact = math.fsum((tensor.double() ** 2).tolist())
    assert abs(values - exact) <= FLOAT32_SUMS_BOUND * exact, (values, exact)
    assert_matches_reference(tensor, row)


def _adversarial(dtype: torch.dtype) -> torch.Tensor:
    """Four programs at the longest span; in every lane one element in seven is 2**15 and
    the rest are values in [1, 2) with every mantissa bit used (odd last bit): each
    addition of a small square drops bits that only the error terms keep (the worst of
    the cases tried for docs/gpu.md)."""
    gen = torch.Generator().manual_seed(31)
    mantissa = 10 if dtype == torch.float16 else 7
    odd = torch.randint(0, 1 << (mantissa - 1), (4 * triton_kernel.MAX_SPAN,), generator=gen)
    values = 1 + (2 * odd.double() + 1) / (1 << mantissa)
    values[::7] = 2.0**15
    return values.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp32_sums", [True, False])
def test_sum_of_squares_error_on_adversarial_data_is_within_the_documented_bound(
    dtype: torch.dtype, fp32_sums: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/gpu.md: compensated float32 sums within (n - 1)**2 * 2**-48 of the sum of squares,
    n the squares one lane adds (float16: 130, 5.9e-11; bfloat16, whose fast-path lanes are
    words of two elements: 258, 2.4e-10); float64 sums within about n * 2**-53."""
    per_dtype = {torch.float16: 6e-11, torch.bfloat16: 2.4e-10}
    bound = per_dtype[dtype] if fp32_sums else 1e-13
    monkeypatch.setattr(triton_kernel, "FP32_ACCUMULATE", fp32_sums)
    tensor = _adversarial(dtype)
    batch = triton_kernel.TritonBatch(DEVICE, sms=1)  # MAX_SPAN: 130 per lane
    assert batch.add(tensor.to(DEVICE), 0)
    out, _ = batch.launch()
    row = out[0].cpu().tolist()
    exact = math.fsum((tensor.double() ** 2).tolist())  # squares exact in float64
    assert abs(row[SCALE] ** 2 * row[SSQ] - exact) <= bound * exact


def test_float32_sums_are_chosen_where_float64_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compute capability 7.5, 8.6, 8.7, 8.9, 10.3, 11.x and 12.x: about 2 float64
    operations per clock per SM (B300, cc 10.3, cut them from B200's 64)."""
    cases = {(7, 0): False, (7, 5): True, (8, 0): False, (8, 6): True, (8, 7): True}
    cases |= {(8, 9): True, (9, 0): False, (10, 0): False, (10, 3): True, (11, 0): True}
    cases |= {(12, 0): True, (12, 1): True, (12, 3): True}
    for capability, expected in cases.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        triton_kernel._slow_fp64.cache_clear()
        assert triton_kernel.fp32_accumulate(torch.device("cuda", 0)) is expected, capability
    triton_kernel._slow_fp64.cache_clear()
    assert not triton_kernel.fp32_accumulate(torch.device("cpu"))
