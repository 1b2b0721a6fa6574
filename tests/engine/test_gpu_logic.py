"""The GPU path's host-side logic, checked on the CPU.

What a CPU can prove about the CUDA path (``docs/gpu.md`` lists what it cannot):

* the Triton batch path and the monitor's prefetch queue their work without a
  single host read: run on ``meta`` tensors (every host read of one raises)
  with the kernel launches replaced by no-ops, every line of host code of the
  path runs, table building and placements included;
* an element count that another rank's NCCL collective produced stays on the
  device and is read with the rows, in the one read;
* a bucket of small tensors is reduced on the stream its rows were copied in on, whatever
  stream is current at the flush (streams and events faked: which stream the work is
  queued on is host logic).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gradaudit import GradientMonitor
from gradaudit.engine import torch_shim, triton_kernel, triton_plan, warmup
from gradaudit.engine.stats import ROW_WIDTH, SCALE, StatsCollector
from gradaudit.scan.pending import PendingEntry, PendingStats
from gradaudit.training.gradients import GradientLister, collect_columns


class _NoopLaunch:
    """A Triton kernel whose launches do nothing (what the host does is what is checked)."""

    def __init__(self, launches: list[int]) -> None:
        self.launches = launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append(grid[0])

        return launch


@pytest.fixture
def triton_on_meta(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Route ``meta`` tensors to the Triton batch path, with no-op kernels; returns the grids."""
    launches: list[int] = []
    monkeypatch.setattr(triton_kernel, "installed", lambda: True)
    monkeypatch.setattr(triton_kernel, "runs_on", lambda device: device.type == "meta")
    monkeypatch.setattr(
        triton_kernel, "_kernels", lambda: (_NoopLaunch(launches), _NoopLaunch(launches))
    )
    real_init = StatsCollector.__init__

    def init(self: StatsCollector, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self._routes.enabled = True
        self._routes.devices = frozenset({"meta"})
        self._routes.off_cuda = True

    monkeypatch.setattr(StatsCollector, "__init__", init)
    triton_kernel.reset_failure()
    return launches


def test_the_triton_batch_path_never_reads_the_device(triton_on_meta: list[int]) -> None:
    tensors = {
        "big": torch.empty(3_000_000, device="meta"),
        "half": torch.empty(5000, dtype=torch.float16, device="meta"),
        "bf16": torch.empty(64, 3, dtype=torch.bfloat16, device="meta"),
        "tiny": torch.empty(3, device="meta"),
        "strided": torch.empty(40, 30, device="meta").t(),
        "double": torch.empty(10, dtype=torch.float64, device="meta"),
    }
    pending = PendingStats(engine="auto")
    pending.add_all(tensors)
    pending.prefetch()
    rows = pending.rows
    assert len(rows) == len(tensors)
    assert {row.device.type for row in rows} == {"meta"}
    assert "triton" in pending._collector.engine_used
    # One launch per dtype of the batch (float32: big and tiny; float16; bfloat16) and
    # one merge of their 3 + 1 + 1 rows and 3 sentinels; then the strided tensor's
    # chunk, a block of its own: 1200 elements in one program, whose row is its stats
    # row (nothing to merge, no merge launch).
    # One span per group, sized from the group: 3,000,003 float32 elements; the float16
    # tensor is shorter than the shortest span, one program.
    big_programs = -(-3_000_000 // triton_kernel.span_for(3_000_003))
    assert triton_on_meta == [big_programs + 1, 1, 1, 7, 1]


def test_the_monitors_collecting_step_never_reads_the_device(triton_on_meta: list[int]) -> None:
    """The monitor's default mode: collect, prefetch, return; the read is the next step's."""
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32, device="meta"), torch.nn.Linear(32, 8, device="meta")
    )
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    monitor = GradientMonitor(model, every=1, dump_dir=None)
    assert monitor.step() is None
    assert triton_on_meta  # the Triton path ran


def test_the_monitors_collection_plans_its_flush_once(
    triton_on_meta: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each collecting step of the monitor (its lister's columns into ``collect_columns`` with
    its collector, as ``GradientMonitor.step`` does) is one planned flush, one launch per
    dtype and a merge; the plan is made on the first step and taken again while the
    gradients keep their facts, made again when one changes (``model.to(dtype)``); nothing
    is read (the read of each step is the next monitor step's, not run here: ``meta``)."""
    plans: list[triton_plan.TritonPlan] = []
    real = triton_plan.TritonPlan.__init__

    def init(self: triton_plan.TritonPlan, *args: Any) -> None:
        real(self, *args)
        plans.append(self)

    monkeypatch.setattr(triton_plan.TritonPlan, "__init__", init)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32, device="meta"), torch.nn.Linear(32, 8, device="meta")
    )
    lister = GradientLister(model)
    collector = StatsCollector()
    for step in range(4):
        for param in model.parameters():
            param.grad = torch.empty_like(param)  # new gradients every step (set_to_none)
        pending = collect_columns(*lister.columns(), collector=collector)
        assert len(pending) == 4
        # Through torch's C shim the first step is planned; through the binding it goes the
        # per-tensor way (planning costs more there, and a one-off collection never comes
        # back to a plan), the second is planned.
        assert len(plans) == (1 if torch_shim.bound() else min(step, 1))
        # One float32 group of 4 tensors, each shorter than a span: one launch of a
        # program per tensor, whose rows are the stats rows (no merge), planned or not.
        assert triton_on_meta[-1] == 4
    assert len(triton_on_meta) == 4
    assert plans[0].programs == 4
    model.to(torch.bfloat16)
    for param in model.parameters():
        param.grad = torch.empty_like(param)
    collect_columns(*lister.columns(), collector=collector)
    assert len(plans) == 2
    assert plans[1].dtypes == [torch.bfloat16] * 4


def test_an_element_count_on_the_device_is_read_with_the_rows() -> None:
    """What ``collect_sharded`` does with an NCCL-only group: the count arrives with the rows."""
    pending = PendingStats()
    pending.add("local", torch.tensor([3.0, 4.0]))
    row = torch.zeros(ROW_WIDTH, dtype=torch.float64)
    row[SCALE] = 1.0
    row[6] = 25.0
    child = pending.child()
    child.add_row(PendingEntry("sharded", (), "float32"), row, numel=torch.tensor(12.0))
    pending.absorb(child)
    assert pending.entries[1].shape == ()  # not known before the read
    report = pending.materialize()
    assert [t.shape for t in report.tensors] == [(2,), (12,)]
    assert report.tensors[1].numel == 12
    assert report.tensors[1].norm == 5.0
    assert report.tensors[1].rms == pytest.approx(5.0 / math.sqrt(12))


@pytest.fixture
def cold_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """An sm_90 that never compiled the kernels: no marker, nothing deferred yet."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_kernel, "_arch", lambda device: "sm_90")
    monkeypatch.setattr(triton_kernel, "_warm", set())
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", 0)
    # The rule without the background compile (off, or failed): tests/engine/test_warmup.py
    # has the background compile's own.
    monkeypatch.setattr(warmup, "ENABLED", False)
    triton_kernel._marker.cache_clear()
    yield tmp_path
    triton_kernel._marker.cache_clear()


def test_auto_waits_to_compile_until_the_data_is_worth_it(cold_cache: Any) -> None:
    gpu = torch.device("cuda", 0)
    assert triton_kernel.compile_worth(torch.device("cpu"))  # the interpreter compiles nothing
    assert not triton_kernel.compile_worth(gpu)
    triton_kernel.defer(triton_kernel.COMPILE_AFTER_BYTES - 1)
    assert not triton_kernel.compile_worth(gpu)
    triton_kernel.defer(1)
    assert triton_kernel.compile_worth(gpu)


def test_compiled_once_is_warm_in_the_next_process(cold_cache: Any) -> None:
    import triton

    gpu = torch.device("cuda", 0)
    assert not triton_kernel.compile_worth(gpu)
    triton_kernel.mark_warm(gpu)
    (marker,) = cold_cache.iterdir()
    assert marker.name.startswith("gradaudit-")
    assert marker.name.endswith(f"-sm_90-triton{triton.__version__}")
    triton_kernel._warm.clear()  # a new process: only the marker remains
    assert triton_kernel.compile_worth(gpu)


def test_tensors_after_the_compile_threshold_join_the_batch(
    triton_on_meta: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` reduces with eager until ``COMPILE_AFTER_BYTES`` went through it; the tensors
    after that, in the same collector and before any settle, join the one batched launch
    instead of a launch, a merge and a table copy each (the cold route is not kept)."""
    monkeypatch.setattr(triton_kernel, "COMPILE_AFTER_BYTES", 8_000_000)
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", 0)
    monkeypatch.setattr(
        triton_kernel,
        "compile_worth",
        lambda device: triton_kernel._deferred_bytes >= triton_kernel.COMPILE_AFTER_BYTES,
    )
    collector = StatsCollector(engine="auto")
    big = [torch.empty(1_000_000, device="meta") for _ in range(6)]  # 4 MB each
    for tensor in big:
        collector.submit(tensor)
    # The first went through eager; the second reached the threshold and joined the batch.
    assert triton_kernel._deferred_bytes == 8_000_000
    assert triton_on_meta == []  # nothing launched before the settle
    blocks = collector.flush()
    programs = -(-1_000_000 // triton_kernel.span_for(5_000_000))  # the group's span
    assert triton_on_meta == [5 * programs, 6]  # one launch for the five, one merge
    assert collector.engine_used == "eager+triton"
    assert sum(block.shape[0] for block in blocks) == 1 + 6  # and the group's sentinel row


def test_a_cold_route_ends_at_the_settle(
    triton_on_meta: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm since the last settle (another collector compiled): the next tensor joins a batch."""
    warm = False
    monkeypatch.setattr(triton_kernel, "compile_worth", lambda device: warm)
    monkeypatch.setattr(triton_kernel, "_deferred_bytes", 0)
    collector = StatsCollector(engine="auto")
    collector.submit(torch.empty(100_000, device="meta"))
    collector.settle()
    warm = True
    collector.submit(torch.empty(100_000, device="meta"))
    assert triton_on_meta == []  # queued in a batch, not launched alone
    collector.flush()
    assert triton_on_meta == [-(-100_000 // triton_kernel.span_for(100_000)), 2]
    assert collector.engine_used == "eager+triton"


class _FakeStream:
    """A CUDA stream as the collector sees one: a device, an id, equality."""

    def __init__(self, stream_id: int) -> None:
        self.device = torch.device("cuda", 0)
        self.stream_id = stream_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FakeStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return self.stream_id


def test_a_bucket_is_reduced_on_the_stream_its_rows_were_copied_in_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small tensors collected on a side stream are reduced there even when the flush comes
    with the default stream current (the H200 found the eager kernel reading a bucket before
    the side stream had copied into it: zeros where a -Inf was), and readers get a settle
    event on that stream; a bucket of the current stream is reduced where it is."""
    from gradaudit.engine.buckets import Bucket
    from gradaudit.results.row import NAN, NEG_INF, POS_INF, ZEROS

    side, default = _FakeStream(7), _FakeStream(0)
    current = [default]
    entered: list[int] = []
    recorded: list[int] = []

    class Switch:
        def __init__(self, stream: _FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            entered.append(self.stream.stream_id)
            self.saved = current[0]
            current[0] = self.stream

        def __exit__(self, *exc: object) -> None:
            current[0] = self.saved

    class Event:
        def record(self, stream: _FakeStream) -> None:
            recorded.append(stream.stream_id)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", Switch)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    collector = StatsCollector(engine="eager")
    reduced_on: list[int] = []
    block_rows = collector._block_rows

    def noting(block: torch.Tensor) -> torch.Tensor:
        reduced_on.append(current[0].stream_id)
        return block_rows(block)

    monkeypatch.setattr(collector, "_block_rows", noting)
    values = torch.tensor([1.0, -math.inf, 0.0])
    for stream in (side, default):
        bucket = Bucket(torch.zeros((2, 64)), stream)  # type: ignore[arg-type]
        ticket = collector._layout.new_ticket()
        bucket.buffer[0, :3] = values
        bucket.tickets.append((ticket, 3))
        collector._reduce_bucket(bucket)
        assert not bucket.tickets
        assert not bucket.buffer.any()  # zeroed for the next rows
        (row,) = collector.gather([ticket], collector._blocks).tolist()
        # NaN, +Inf, -Inf, zeros (the padding's taken out):
        assert [row[i] for i in (NAN, POS_INF, NEG_INF, ZEROS)] == [0, 0, 1, 1]
    assert reduced_on == [7, 0]
    assert entered == [7]  # only the side stream's bucket switched streams
    assert recorded == [7]  # ...and gave its stream a settle event
    assert current[0] == default
