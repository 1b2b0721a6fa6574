"""A training loop's planned flush, captured once as a CUDA graph and replayed every step.

A planned flush (:mod:`~gradaudit.engine.triton_plan`) still costs its launch on the
host: the table pinned and copied, two allocations, one Triton launch per dtype group and
the merge, about 0.2-0.25 ms a step whatever the list (an H200's host, docs/gpu.md). On
the 420-tensor bfloat16 transformer that is 0.8x the time an H100 takes to read those
gradients; issue 31 asks 0.3x. Replayed from one captured graph, the same flush costs the
host one copy into a pinned buffer and one ``cudaGraphLaunch``: the GPU check's ``graph``
step measured 0.055 ms a step with the same rows (H200, 2026-11-27).

What a graph holds, and so when it may be replayed:

* **the groups' base addresses**, as the kernels' pointer arguments: every other tensor is
  found by its offset from its group's base, and the offsets are in the table, which the
  replay copies afresh. A training loop's gradients come back to the same blocks step
  after step (the caching allocator), so the bases stay put; where they move, that step
  launches as before, and a new set of bases that holds for :data:`STABLE_LAUNCHES` steps
  is captured in turn, at most :data:`MAX_CAPTURES` times a plan;
* **its buffers**: the pinned table it copies from, the table on the device, the partial
  rows and the rows it writes. The replay's rows are cloned before they are handed out (a
  reader may read a step's rows after the next step has replayed), and the pinned table
  is rewritten only once the last replay's copy has run (an event, queried, never waited
  for: if it has not run, the step launches as before);
* **the stream** it was captured for: replays are queued on that stream only, so a step's
  table copy cannot overtake the last step's kernels on another stream.

Captured only on CUDA, after a plan's kernels have run once (compiled, loaded), on a side
stream with ``thread_local`` capture errors and without ``torch.cuda.graph``'s device
synchronisation: nothing in a training step waits for the capture. A capture that fails
turns graphs off for that plan; ``GRADAUDIT_CUDA_GRAPHS=0`` turns them off for the process.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

#: The environment variable that turns the replays off (``0``).
ENVIRONMENT = "GRADAUDIT_CUDA_GRAPHS"
#: Whether plans capture their flush (read once, at import).
ENABLED = os.environ.get(ENVIRONMENT, "1").strip() != "0"
#: Devices whose flushes are captured (tests add ``cpu``, with a stand-in :func:`capture`).
DEVICE_TYPES = frozenset({"cuda"})
#: Launches of a plan with the same bases before they are captured: a loop's first steps
#: may still move its gradients (the allocator settling), and capturing costs a few ms.
STABLE_LAUNCHES = 2
#: Captures a plan makes at most: a loop whose gradients move every step would otherwise
#: capture every other step.
MAX_CAPTURES = 3

#: The kernels of one flush reading a table already on the device: returns the rows.
Kernels = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Captured:
    """One captured flush: what it reads and writes, and how to queue it again."""

    #: Each dtype group's base address when captured.
    bases: tuple[int, ...]
    #: The stream replays are queued on (``None`` off CUDA).
    stream: Any
    #: The pinned table the graph's copy reads; rewritten before each replay.
    pinned: torch.Tensor
    #: The table on the device that the graph's kernels read (kept alive with the graph).
    flat: torch.Tensor
    #: The rows the graph's merge writes.
    out: torch.Tensor
    #: The graph (``replay()`` queues the copy and the kernels on the current stream).
    graph: Any
    #: Recorded after each replay: the pinned table may be rewritten once it has completed.
    event: Any


def capture(
    device: torch.device, bases: tuple[int, ...], host: torch.Tensor, kernels: Kernels
) -> Captured:
    """Capture the copy of a table like ``host`` into a device buffer and ``kernels`` on it,
    for the current stream of ``device`` (CUDA, ``device`` current; raises where the
    capture fails)."""
    stream = torch.cuda.current_stream(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    flat = torch.empty(host.shape, dtype=host.dtype, device=device)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    # Capturing queues nothing, so no synchronisation (torch.cuda.graph's) is needed; the
    # side stream is where torch allows a capture (not a default stream).
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            flat.copy_(pinned, non_blocking=True)
            out = kernels(flat)
        finally:
            graph.capture_end()
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return Captured(bases, stream, pinned, flat, out, graph, event)


class Replays:
    """When one plan's flush is captured and replayed (see the module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = ENABLED and device.type in DEVICE_TYPES
        #: Captures made, and replays queued (tests, the GPU check).
        self.captures = 0
        self.replays = 0
        self._bases: tuple[int, ...] | None = None
        self._streak = 0
        # The capture in use (:attr:`captured`), in a list the finalizer can keep: dropped
        # with the plan (a list with other facts makes a new one), it is retired.
        self._holder: list[Captured] = []
        if self.enabled:
            weakref.finalize(self, _retire_all, self._holder)

    @property
    def captured(self) -> Captured | None:
        """The flush captured for the current bases, if any."""
        return self._holder[0] if self._holder else None

    @captured.setter
    def captured(self, captured: Captured | None) -> None:
        self._holder[:] = [] if captured is None else [captured]

    def replay(self, bases: tuple[int, ...], host: torch.Tensor) -> torch.Tensor | None:
        """The rows of this step's flush replayed from the captured graph, or ``None`` when
        it cannot be (none yet, other bases or stream, the last replay's copy not run)."""
        captured = self.captured
        if captured is None or captured.bases != bases:
            return None
        if _current_stream(self.device) != captured.stream or not captured.event.query():
            return None
        if _capturing(self.device):  # inside a caller's own capture: launch as before
            return None
        captured.pinned.copy_(host)
        with _current(self.device):
            captured.graph.replay()
            captured.event.record(captured.stream)
            # The graph writes the same rows every replay; a reader may read this step's
            # after the next step has replayed.
            rows = captured.out.clone()
        self.replays += 1
        return rows

    def launched(self, bases: tuple[int, ...], host: torch.Tensor, kernels: Kernels) -> None:
        """After a launch of this plan at ``bases``: capture it once those bases have held
        for :data:`STABLE_LAUNCHES` launches (the kernels have run: compiled and loaded)."""
        if not self.enabled or _capturing(self.device):
            return
        self._streak = self._streak + 1 if bases == self._bases else 1
        self._bases = bases
        if self._streak < STABLE_LAUNCHES or self.captures >= MAX_CAPTURES:
            return
        if self.captured is not None and self.captured.bases == bases:
            # Launched at the captured bases because the last replay's table copy had not
            # run (a loop whose host runs ahead of the GPU): capturing again gains nothing.
            return
        self.captures += 1
        self._streak = 0
        retire(self.captured)
        self.captured = None
        try:
            with _current(self.device):
                self.captured = capture(self.device, bases, host, kernels)
        except Exception:  # noqa: BLE001 (the launch path stays; graphs off for this plan)
            self.enabled = False


#: Captured flushes let go of while a replay of theirs may still run: the graph's pinned
#: table, device buffers and memory pool are freed only once it has (:func:`retire`).
_retired: list[Captured] = []


def _retire_all(held: list[Captured]) -> None:
    for captured in held:
        retire(captured)


def retire(captured: Captured | None) -> None:
    """Let go of ``captured`` once its last replay has run: now, or at a later
    :func:`release_finished`."""
    release_finished()
    if captured is not None and not captured.event.query():
        _retired.append(captured)


def release_finished() -> None:
    """Let go of the retired captures whose last replay has run (an event queried per
    capture, never waited for). Called with the held lists' release
    (:func:`gradaudit.engine.triton_plan.release_finished`): every planned flush and read."""
    if _retired:
        _retired[:] = [old for old in _retired if not old.event.query()]


def retired() -> int:
    """Captures kept until their last replay has run (tests)."""
    return len(_retired)


def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _current(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _capturing(device: torch.device) -> bool:
    """Whether the current stream is being captured by the caller (a model's own graph)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
