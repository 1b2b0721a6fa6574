"""The one host read of a :class:`~gradaudit.scan.pending.PendingStats`, started ahead if asked.

Every block of stats rows a collector produced, and the exponent histograms
(``--precision``), come back to the host here: at once (one transfer per device,
:func:`~gradaudit.engine.host_read.read_blocks`), or copied ahead into pinned memory
right behind the collection (:meth:`Readback.prefetch`) so that a training loop reading
step N's stats during step N+1 does not wait for step N+1's backward pass. Collection
(what is queued, and the host-side facts) is :class:`PendingStats`' own; this is only
how its rows travel.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from gradaudit.engine.host_read import blocks_by_device, read_blocks, wait_for
from gradaudit.engine.stats import StatsCollector
from gradaudit.precision.formats import layout


@dataclass(frozen=True)
class Prefetch:
    """One device's prefetched rows: which blocks, their pinned host copy, the copy's event."""

    indices: list[int]
    pinned: torch.Tensor
    done: torch.cuda.Event


def copy_ahead(
    device: torch.device,
    settled: Mapping[torch.device, list[torch.cuda.Event]],
    indices: list[int],
    combine: Callable[[list[torch.Tensor]], torch.Tensor],
    parts: list[torch.Tensor],
) -> Prefetch:
    """Copy ``combine(parts)`` (``torch.cat`` or ``torch.stack``, made on ``device`` once its
    kernels have ``settled``) into pinned host memory without blocking; the copy's event
    says when it has arrived."""
    with torch.cuda.device(device):
        wait_for(device, settled)
        source = combine(parts)
        pinned = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        pinned.copy_(source, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(torch.cuda.current_stream(device))
    return Prefetch(indices, pinned, done)


class Readback:
    """A collector's rows and histograms on their way to the host.

    ``wanted`` and ``tickets`` (given to each call) are the collection's columns: per
    entry, 1 when it has a histogram, and its ticket in the collector.
    """

    def __init__(self, collector: StatsCollector) -> None:
        self._collector = collector
        #: What :meth:`prefetch` started: how many blocks it covers, and per CUDA device
        #: the blocks' indices, their pinned host copy and the event after that copy.
        self.prefetched: tuple[int, dict[torch.device, Prefetch]] | None = None
        #: The same for the exponent histograms: how many entries it covers, and per CUDA
        #: device the entries' indices, their pinned copy, its event.
        self.histograms_prefetched: tuple[int, dict[torch.device, Prefetch]] | None = None

    def prefetch(
        self,
        devices: Iterable[torch.device],
        wanted: array.array[int] | None,
        tickets: array.array[int],
    ) -> None:
        """Start copying the rows collected so far to the host, without waiting for it
        (``wanted``: the histograms too); see :meth:`PendingStats.prefetch`."""
        if not any(device.type == "cuda" for device in devices):
            # Every row is on the host already (a CPU training loop, every step): nothing
            # to copy ahead, and ``materialize`` reads them the usual way (issue 28 item 9).
            self.prefetched = None
            self.histograms_prefetched = None
            return
        blocks = self._collector.flush()
        settled = self._collector.settled()
        copies: dict[torch.device, Prefetch] = {}
        for device, indices in blocks_by_device(blocks).items():
            if device.type != "cuda":
                continue
            copies[device] = copy_ahead(
                device, settled, indices, torch.cat, [blocks[i] for i in indices]
            )
        self.prefetched = (len(blocks), copies)
        if wanted is not None:
            self.histograms_prefetched = (len(wanted), self._prefetch_histograms(wanted, tickets))

    def _prefetch_histograms(
        self, wanted: array.array[int], tickets: array.array[int]
    ) -> dict[torch.device, Prefetch]:
        """:meth:`prefetch` of the exponent histograms on CUDA devices: a blocking copy
        later would wait for every kernel queued meanwhile (the next step's backward)."""
        settled = self._collector.settled()
        copies: dict[torch.device, Prefetch] = {}
        by_device, histograms = self._histogram_sources(wanted, tickets)
        for device, indices in by_device.items():
            if device.type != "cuda":
                continue
            copies[device] = copy_ahead(
                device, settled, indices, torch.stack, [histograms[i] for i in indices]
            )
        return copies

    def read(self) -> list[torch.Tensor]:
        """The one host read: the host copy of every block (see ``StatsCollector.gather``)."""
        blocks = self._collector.flush()
        settled = self._collector.settled()
        if self.prefetched is None or self.prefetched[0] != len(blocks):
            return read_blocks(blocks, settled)
        host: list[torch.Tensor] = list(blocks)
        copies = self.prefetched[1]
        rest = [i for i, block in enumerate(blocks) if block.device not in copies]
        for i, block in zip(rest, read_blocks([blocks[i] for i in rest], settled), strict=True):
            host[i] = block
        for copy in copies.values():
            copy.done.synchronize()
            offset = 0
            for i in copy.indices:
                rows = blocks[i].shape[0]
                host[i] = copy.pinned[offset : offset + rows]
                offset += rows
        return host

    def histogram_counts(self, wanted: array.array[int], tickets: array.array[int]) -> np.ndarray:
        """Every entry's exponent histogram as one int64 matrix ``[entries, bins]`` (zeros
        where ``wanted`` is 0), read after the rows' kernels: from the prefetched copies,
        else one copy per device."""
        out = np.zeros((len(wanted), layout().bins), dtype=np.int64)
        prefetched = self.histograms_prefetched
        copies = {}
        if prefetched is not None and prefetched[0] == len(wanted):
            copies = prefetched[1]
        for copy in copies.values():
            copy.done.synchronize()
            out[copy.indices] = copy.pinned.numpy()
        by_device, histograms = self._histogram_sources(wanted, tickets)
        settled = self._collector.settled()
        for device, device_indices in by_device.items():
            if device in copies:
                continue
            wait_for(device, settled)  # collected on a side stream: read after its kernels
            stacked = torch.stack([histograms[i] for i in device_indices])
            out[device_indices] = stacked.to("cpu").numpy()
        return out

    def _histogram_sources(
        self, wanted: array.array[int], tickets: array.array[int]
    ) -> tuple[dict[torch.device, list[int]], dict[int, torch.Tensor]]:
        """The entries with a histogram, by device, and each one's histogram (on its device)."""
        by_device: dict[torch.device, list[int]] = {}
        histograms: dict[int, torch.Tensor] = {}
        for index, flag in enumerate(wanted):
            if flag:
                histogram = histograms[index] = self._collector.histogram(tickets[index])
                by_device.setdefault(histogram.device, []).append(index)
        return by_device, histograms
