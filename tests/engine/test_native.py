"""The native single-pass CPU kernel against the float64 reference, on every path the CPU runs."""

from __future__ import annotations

import array
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradaudit
from gradaudit import audit
from gradaudit.engine import native
from gradaudit.engine.stats import StatsCollector
from gradaudit.results.row import HostRow
from tests.engine.test_stats import HUGE, assert_matches_reference
from tests.reference import reference_stats
from tests.samples import KERNEL_DTYPES

NATIVE_DTYPES = KERNEL_DTYPES
PATHS = list(native.PATHS)
#: Subnormal in float32 (1e-40) and in float64 (1e-310).
SUBNORMALS = [1e-40, 1e-310]

# These test the kernel itself, so they need it; tests/engine/test_install.py fails (it does
# not skip) when the install that CI runs did not build it.
pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel is not built")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on each path: AVX-512 and AVX2 where the CPU has them, portable C always.

    A path the CPU lacks is skipped, never the portable one
    (:func:`test_the_portable_path_always_runs` fails instead).
    """
    name: str = request.param
    if name not in native.paths():
        pytest.skip(f"this CPU has no {name} path")
    previous = native.set_path(name)
    yield name
    native.set_path(previous)


@contextmanager
def on_path(name: str) -> Iterator[None]:
    previous = native.set_path(name)
    try:
        yield
    finally:
        native.set_path(previous)


def test_the_portable_path_always_runs() -> None:
    """Skipping a path the CPU lacks must never leave the kernel untested."""
    assert native.paths()[0] == "portable"
    assert list(native.paths()) == PATHS[: len(native.paths())]  # each path needs the one before


def test_import_chooses_the_widest_path_and_set_path_restores() -> None:
    assert native.path() == native.paths()[-1]
    previous = native.set_path("portable")
    assert native.path() == "portable"
    assert native.set_path(previous) == "portable"
    assert native.path() == previous
    with pytest.raises(ValueError, match="not available"):
        native.set_path("sse9")


def native_row(tensor: torch.Tensor, threads: int = 2) -> HostRow:
    out = torch.empty(7, dtype=torch.float64)
    native.tensor_row(tensor, out, threads)
    return HostRow.from_values(out.tolist())


@st.composite
def flat_tensors(
    draw: st.DrawFn,
    dtypes: Sequence[torch.dtype] = NATIVE_DTYPES,
    boundaries: Sequence[int] = (4095, 4096, 4097, 8191, 8208, 12_345),
    longest: int = 20_000,
) -> torch.Tensor:
    """1-D tensors with planted specials, their lengths around a kernel's step and block sizes.

    The defaults are the native kernel's (16-element steps, 4096-element blocks).
    """
    dtype = draw(st.sampled_from(dtypes))
    numel = draw(
        st.one_of(
            st.integers(0, 40),
            st.sampled_from(boundaries),
            st.integers(0, longest),
        )
    )
    magnitude = draw(st.sampled_from([1e-30, 1e-6, 1.0, HUGE[dtype]]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    values = torch.randn(numel, generator=gen, dtype=torch.float64) * magnitude
    specials = draw(
        st.lists(
            st.tuples(
                st.integers(0, max(numel - 1, 0)),
                st.sampled_from(
                    [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, HUGE[dtype], *SUBNORMALS]
                ),
            ),
            max_size=min(numel, 8),
        )
    )
    for index, value in specials:
        values[index] = value
    return values.to(dtype)


@settings(
    derandomize=True,
    max_examples=250,
    deadline=None,
    # the fixture only selects the code path, the same for every example
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(tensor=flat_tensors(), threads=st.sampled_from([1, 2, 3]))
def test_native_matches_float64_reference(path: str, tensor: torch.Tensor, threads: int) -> None:
    assert_matches_reference(tensor, native_row(tensor, threads))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_are_exact_in_a_thread_that_flushes_subnormals(
    path: str, dtype: torch.dtype, threads: int
) -> None:
    """A host thread in flush-to-zero mode (torch 2.4's compiled kernels, any -ffast-math
    library) still gets exact rows, and keeps its mode: the kernel computes in IEEE mode."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    torch.set_flush_denormal(False)
    tiny = SUBNORMALS[0] if dtype == torch.float32 else SUBNORMALS[1]
    values = torch.full(((1 << 20) + 3,), tiny, dtype=torch.float64)  # enough for 2 threads
    values[[0, 5]] = torch.tensor([-tiny * 3, 0.0], dtype=torch.float64)
    tensor = values.to(dtype)
    out = torch.empty(7, dtype=torch.float64)
    torch.set_flush_denormal(True)
    try:
        native.tensor_row(tensor, out, threads)
        still_flushing = torch.tensor([tiny], dtype=dtype).mul(1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert still_flushing  # the host's mode is its own
    row = HostRow.from_values(out.tolist())  # the host side: PendingStats guards it
    assert_matches_reference(tensor, row)
    assert row.max_abs == pytest.approx(3 * tiny, rel=1e-6)
    assert row.zeros == 1


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_threads_split_a_large_tensor_exactly(path: str, dtype: torch.dtype) -> None:
    """From 2**20 elements the work is split between threads and merged with the engine's rule."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn((1 << 20) + 4099, generator=gen, dtype=torch.float64)
    planted = torch.tensor([math.nan, math.inf, -math.inf, 0.0], dtype=torch.float64)
    values[[0, 1 << 19, (1 << 19) + 5, -1]] = planted
    values[12345] = HUGE[dtype]
    tensor = values.to(dtype)
    one, two = native_row(tensor, threads=1), native_row(tensor, threads=2)
    assert_matches_reference(tensor, two)
    assert (one.nan, one.pos_inf, one.neg_inf, one.zeros, one.max_abs) == (
        two.nan,
        two.pos_inf,
        two.neg_inf,
        two.zeros,
        two.max_abs,
    )
    assert one.norm == pytest.approx(two.norm, rel=1e-12)


def test_every_float16_and_bfloat16_bit_pattern(path: str) -> None:
    """All 65,536 patterns: NaN payloads, both infinities, subnormals, both zeros."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        tensor = bits.view(dtype)
        assert_matches_reference(tensor, native_row(tensor))
        for value in tensor[::997]:  # single elements take the scalar tail
            assert_matches_reference(value.reshape(1), native_row(value.reshape(1)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_blocks_with_and_without_specials_merge(path: str, dtype: torch.dtype) -> None:
    """Half formats read a block with no NaN/Inf by a short path and classify the others in
    full: every mix of the two must add up to the float64 reference (norm to 1e-12)."""
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(5 * 4096 + 21, generator=gen, dtype=torch.float64)
    values[100:140] = 0.0  # zeros in a clean block
    values[4096 + 7] = math.nan  # the second block has NaN, +Inf and a zero
    values[4096 + 300] = math.inf
    values[4096 + 301] = 0.0
    values[2 * 4096 + 9] = 300.0  # the largest magnitude sits in a clean block
    values[3 * 4096 + 5] = -math.inf  # and the fourth block -Inf
    values[-3] = math.nan  # and the scalar tail a NaN
    tensor = values.to(dtype)
    got = native_row(tensor, threads=1)
    assert_matches_reference(tensor, got)
    finite = tensor.double()[tensor.double().isfinite()]
    assert got.norm == pytest.approx(float(finite.square().sum().sqrt()), rel=1e-12)
    assert (got.nan, got.pos_inf, got.neg_inf, got.zeros) == (2, 1, 1, 41)
    assert got.max_abs == 300.0


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_tails_read_nothing_past_the_tensor(path: str, dtype: torch.dtype) -> None:
    """Every tail length, with specials in the tail and NaN in the bytes just past the end:
    the last elements (masked vector loads for float32) must count exactly those elements."""
    gen = torch.Generator().manual_seed(12)
    for numel in [*range(0, 48), 4095, 4097, 4096 + 15]:
        buffer = torch.full((numel + 40,), math.nan, dtype=torch.float64)
        buffer[:numel] = torch.randn(numel, generator=gen, dtype=torch.float64)
        for offset, value in enumerate([0.0, math.inf, -math.inf, math.nan, -0.0]):
            if numel > offset:
                buffer[numel - 1 - offset] = value
        tensor = buffer.to(dtype)[:numel]  # contiguous, followed by NaN in memory
        got = native_row(tensor, threads=1)
        assert_matches_reference(tensor, got)
        assert got.zeros == int((tensor.double() == 0).sum())


def test_every_fp8_bit_pattern() -> None:
    """All 256 patterns of both fp8 formats, together and one by one."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tensor = bits.view(dtype)
        assert_matches_reference(tensor, native_row(tensor))
        for value in tensor:
            assert_matches_reference(value.reshape(1), native_row(value.reshape(1)))


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, 3e38),
        (torch.float32, 1e-45),  # the smallest float32 subnormal
        (torch.float64, 1e305),
        (torch.float64, 5e-324),  # the smallest float64 subnormal: its scale has no inverse
        (torch.float64, 1e-310),
        (torch.float16, 65504.0),
        (torch.float16, 6e-8),
        (torch.bfloat16, 3e38),
    ],
)
def test_extremes_of_each_range(path: str, dtype: torch.dtype, value: float) -> None:
    tensor = torch.full((5000,), value, dtype=torch.float64).to(dtype)
    got = native_row(tensor)
    assert_matches_reference(tensor, got)
    assert got.norm == pytest.approx(abs(float(tensor[0])) * math.sqrt(5000), rel=1e-12)


def test_float64_blocks_of_very_different_scales_merge_exactly(path: str) -> None:
    """Each 4096-element block picks its own scale; merging must not flush the small ones."""
    values = torch.cat(
        [
            torch.full((4096,), 1e-300, dtype=torch.float64),
            torch.full((4096,), 1e300, dtype=torch.float64),
            torch.full((4096,), 3.0, dtype=torch.float64),
        ]
    )
    assert_matches_reference(values, native_row(values))
    small_first = native_row(values[:4096])
    assert small_first.norm == pytest.approx(1e-300 * 64, rel=1e-12)


@pytest.mark.slow
def test_collector_batches_small_tensors_and_keeps_their_order() -> None:
    """More tensors than one native batch holds (2,048), mixed with large (past the bucket
    limit), fp8 and strided ones. One large tensor in fifty, not one in five: the float64
    reference is plain Python, and 40 M elements through it took a minute of the suite."""
    gen = torch.Generator().manual_seed(9)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(2600):
        size = [3, 64, 500, 5000, 70_000 if i % 50 == 4 else 700][i % 5]
        dtype = NATIVE_DTYPES[i % 4]
        tensor = torch.randn(size, generator=gen).to(dtype)
        tensor[i % size] = [0.0, math.nan, math.inf, -math.inf, 1e4][i % 5]
        tensors[f"p{i}"] = tensor
    tensors["strided"] = torch.randn(300, 7, generator=gen).t()
    tensors["fp8"] = torch.randn(100, generator=gen).to(torch.float8_e5m2)
    report = audit(tensors, engine="native")
    assert report.engine == "native"
    for stats in report.tensors:
        assert_matches_reference(tensors[stats.name], stats)


def test_native_engine_reports_itself_and_matches_eager() -> None:
    gen = torch.Generator().manual_seed(10)
    tensors = {f"w{i}": torch.randn(1000 * i + 1, generator=gen) for i in range(20)}
    fast = audit(tensors, engine="native")
    slow = audit(tensors, engine="eager")
    assert (fast.engine, slow.engine) == ("native", "eager")
    for a, b in zip(fast.tensors, slow.tensors, strict=True):
        assert (a.name, a.nan, a.zeros, a.max_abs) == (b.name, b.nan, b.zeros, b.max_abs)
        assert a.norm == pytest.approx(b.norm, rel=1e-12)


def test_collector_row_of_a_non_contiguous_tensor_uses_native_pieces() -> None:
    tensor = torch.randn(3000, 70).t()
    collector = StatsCollector(chunk_elements=4096, engine="native")
    got = HostRow.from_values(collector.row(tensor).cpu().tolist())
    ref = reference_stats(tensor)
    assert got.norm == pytest.approx(ref.norm, rel=1e-12)
    assert collector.engine_used == "native"


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 17, 4096, 100_003, 700_001]), min_size=1, max_size=12),
    dtypes=st.lists(st.sampled_from(NATIVE_DTYPES), min_size=12, max_size=12),
    threads=st.sampled_from([2, 3]),
)
def test_a_batch_split_between_threads_matches_tensor_by_tensor(
    sizes: list[int], dtypes: list[torch.dtype], threads: int
) -> None:
    """Thread boundaries fall inside tensors; each row must equal that tensor's own row."""
    gen = torch.Generator().manual_seed(len(sizes))
    tensors = []
    for i, size in enumerate(sizes):
        values = torch.randn(size, generator=gen, dtype=torch.float64)
        if size:
            values[size // 2] = [math.nan, math.inf, -math.inf, 0.0][i % 4]
        tensors.append(values.to(dtypes[i]))
    rows = native.batch_rows(tensors, threads)
    for tensor, row in zip(tensors, rows.tolist(), strict=True):
        alone = native_row(tensor, threads=1)
        got = HostRow.from_values(row)
        assert (got.nan, got.pos_inf, got.neg_inf, got.zeros, got.max_abs) == (
            alone.nan,
            alone.pos_inf,
            alone.neg_inf,
            alone.zeros,
            alone.max_abs,
        )
        assert got.norm == pytest.approx(alone.norm, rel=1e-12)


@pytest.mark.parametrize("how", ["collect_async", "add", "collect_module"])
def test_values_are_taken_before_collection_returns(how: str) -> None:
    """A training loop zeroes its gradients right after collecting; the stats must not see it."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 2))
    model(torch.randn(8, 64)).square().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    expected = {name: reference_stats(g).norm for name, g in grads.items()}
    if how == "collect_async":
        pending = gradaudit.collect_async(grads)
    elif how == "add":
        pending = gradaudit.PendingStats()
        for name, grad in grads.items():
            pending.add(name, grad)
    else:
        pending = gradaudit.collect_module(model)
    model.zero_grad(set_to_none=False)  # in place: the collected tensors now hold zeros
    report = pending.materialize()
    assert report.engine == "native"
    for stats in report.tensors:
        assert stats.norm == pytest.approx(expected[stats.name], rel=1e-12)
        assert stats.norm > 0


#: Integer views of each native dtype, for random bit patterns.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def adversarial(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Values of every kind a kernel could get wrong, mixed in each vector.

    Half the elements are random bit patterns (NaN payloads, both infinities,
    subnormals, both zeros, every exponent); the other half normal values with one
    in four replaced by a special: NaN, ±Inf, ±0, the dtype's huge, subnormal and
    smallest normal values, and its largest finite one (for float64 1e300 instead:
    two of its largest would make the norm itself overflow, for every path alike).
    """
    gen = torch.Generator().manual_seed(seed)
    finfo = torch.finfo(dtype)
    largest = 1e300 if dtype == torch.float64 else finfo.max
    specials = torch.tensor(
        [
            *(math.nan, math.inf, -math.inf, 0.0, -0.0, HUGE[dtype], -HUGE[dtype]),
            *(finfo.smallest_normal * 2.0**-2, finfo.smallest_normal, largest, -largest),
        ],
        dtype=torch.float64,
    )
    values = torch.randn(numel, generator=gen, dtype=torch.float64)
    planted = torch.rand(numel, generator=gen) < 0.25
    choice = torch.randint(len(specials), (numel,), generator=gen)
    values = torch.where(planted, specials[choice], values).to(dtype)
    integer = BITS[values.element_size()]
    info = torch.iinfo(integer)
    bits = torch.randint(info.min, info.max, (numel,), generator=gen, dtype=torch.int64)
    random_bits = bits.to(integer).view(dtype)
    if dtype == torch.float64:  # the largest exponents scaled down, for the same reason
        random_bits = torch.where(random_bits.abs() > 1e300, random_bits * 2.0**-60, random_bits)
    mixed = torch.rand(numel, generator=gen) < 0.5
    # where() on the bits: torch < 2.5 has no where() for float8
    return torch.where(mixed, random_bits.view(integer), values.view(integer)).view(dtype)


def rows_on_every_path(tensor: torch.Tensor) -> dict[str, HostRow]:
    rows = {}
    for name in native.paths():
        with on_path(name):
            rows[name] = native_row(tensor, threads=1)
    return rows


def assert_paths_agree(tensor: torch.Tensor, rows: dict[str, HostRow]) -> None:
    """Every path matches the float64 reference; counts and max|x| are equal to the bit,
    norms to 1e-12 (the order of float64 additions is each path's own)."""
    ref = reference_stats(tensor)
    for name, got in rows.items():
        assert (got.nan, got.pos_inf, got.neg_inf, got.zeros, got.max_abs) == (
            ref.nan,
            ref.pos_inf,
            ref.neg_inf,
            ref.zeros,
            ref.max_abs,
        ), name
        assert math.isfinite(got.norm)
        assert got.norm == pytest.approx(ref.norm, rel=1e-12, abs=0.0), name


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_every_path_agrees_on_every_short_length_and_start(dtype: torch.dtype) -> None:
    """Lengths 0..64 (every tail of every vector width) from 17 starts, most of them not
    aligned to a vector or a cache line, with specials in every position."""
    buffer = adversarial(dtype, 17 + 64, seed=21)
    for start in range(17):
        for numel in range(65):
            tensor = buffer[start : start + numel]
            assert_paths_agree(tensor, rows_on_every_path(tensor))


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_every_path_agrees_across_blocks(dtype: torch.dtype) -> None:
    """Lengths around the 4096-element block, misaligned, with blocks that hold specials
    next to blocks that hold none (the AVX-512 path reads those by a shorter loop)."""
    buffer = adversarial(dtype, 5 * 4096 + 80, seed=22)
    clean = torch.randn(5 * 4096 + 80, generator=torch.Generator().manual_seed(23)).to(dtype)
    # Written through the bits: torch < 2.5 cannot fill or copy into float8 tensors.
    bits = clean.view(BITS[clean.element_size()])
    bits[4096 : 2 * 4096] = buffer.view(bits.dtype)[4096 : 2 * 4096]  # a block of specials
    bits[3 * 4096 + 100] = torch.tensor([math.nan]).to(dtype).view(bits.dtype)[0]  # a lone NaN
    bits[:50] = 0  # +0.0 in every format
    for source in (buffer, clean):
        for start in (0, 1, 3, 31):
            for numel in (4095, 4096, 4097, 4096 + 33, 2 * 4096 + 63, 5 * 4096):
                tensor = source[start : start + numel]
                assert_paths_agree(tensor, rows_on_every_path(tensor))


def test_planned_pointers_reads_every_address_or_stops_at_the_first_difference() -> None:
    """The planned flush's per-step pass (``gradaudit.engine.triton_plan``): the addresses
    when every fact is the plan's, ``None`` when any one differs."""
    base = torch.zeros(64, 3)
    tensors = [base, torch.ones(5, dtype=torch.bfloat16), torch.nn.Parameter(torch.ones(2, 2))]
    facts = (
        [t.dtype for t in tensors],
        [t.shape for t in tensors],
        [t.get_device() for t in tensors],
    )
    plain = (torch.Tensor, torch.nn.Parameter)
    found = native.planned_pointers(tensors, plain, *facts)
    assert found is not None
    assert array.array("q", found).tolist() == [t.data_ptr() for t in tensors]

    class Sub(torch.Tensor):
        pass

    for changed in (
        torch.zeros(64, 3, dtype=torch.float16),  # dtype
        torch.zeros(3, 64),  # shape, the same element count
        torch.zeros(3, 64).t(),  # not contiguous
        torch.zeros(64, 3).as_subclass(Sub),  # not a plain tensor
        torch.zeros(64, 3).to_sparse(),  # no contiguity: RuntimeError, taken as a difference
    ):
        assert native.planned_pointers([changed, *tensors[1:]], plain, *facts) is None
    assert native.planned_pointers(tensors, plain, facts[0], facts[1], [0, -1, -1]) is None
    assert native.planned_pointers(tensors[:2], plain, *facts) is None  # another length
    assert native.planned_pointers([], plain, [], [], []) == b""
