"""The torch-free scan's collector: tensors' addresses into native batches, the rows (and
exponent histograms) they write into host memory, read back by ticket.

What :class:`~gradaudit.engine.stats.StatsCollector` and
:class:`~gradaudit.scan.readback.Readback` are to the torch path, for
:class:`~gradaudit.scan.torch_free.NativeScan`: tickets are handed out as the collector
hands them and batches are cut where it cuts them, so both paths reduce the same tensors
in the same calls. Apart from ``NativeScan``, which reads the files and records their
facts. No torch.
"""

from __future__ import annotations

import array

import numpy as np

from gradaudit.engine import native_rows
from gradaudit.engine.native_rows import NativeBatch
from gradaudit.precision.formats import ExponentHistogram, layout
from gradaudit.results.row import ROW_WIDTH


class HostRows:
    """The native batch and the rows it wrote, shared by a scan and the files it reads.

    Tickets are handed out as the collector hands them (one per tensor, in order), so a
    file that fails leaves rows nobody asks for, and batches are cut exactly where the
    torch path cuts them. With ``histograms`` (``--precision``) each call also counts
    every tensor's exponent histogram in the same read, as the torch path's collector
    asks the kernel to (``StatsCollector._reduce_batch``).
    """

    def __init__(self, *, histograms: bool = False) -> None:
        self.batch = NativeBatch()
        self.blocks: list[np.ndarray] = []
        self.histograms = histograms
        #: Per block of :attr:`blocks`, its histograms ``[rows, bins]`` (with ``histograms``).
        self.histogram_blocks: list[np.ndarray] = []
        self.issued = 0
        self.threads = native_rows.native_threads()

    def add(
        self,
        pointers: array.array[int],
        counts: array.array[int],
        codes: array.array[int],
        nbytes: int,
        keep: object,
    ) -> range:
        tickets = range(self.issued, self.issued + len(pointers))
        self.issued += len(pointers)
        if self.batch.add(tickets, pointers, counts, codes, nbytes, keep):
            self.settle()
        return tickets

    def add_one(self, pointer: int, count: int, code: int, nbytes: int, keep: object) -> int:
        ticket = self.issued
        self.issued += 1
        if self.batch.add_one(ticket, pointer, count, code, nbytes, keep):
            self.settle()
        return ticket

    def settle(self) -> None:
        """Reduce the waiting batch (its tickets are the next rows, in order)."""
        if not len(self.batch):
            return
        if self.histograms:
            rows, histograms = self.batch.reduce_with_histograms(self.threads)
            self.histogram_blocks.append(histograms)
        else:
            rows = self.batch.reduce(self.threads)
        self.blocks.append(rows)
        self.batch = NativeBatch()

    def rows(self, tickets: list[int]) -> np.ndarray:
        """The rows of ``tickets``, in that order."""
        self.settle()
        return _take(self.blocks, tickets, ROW_WIDTH, np.float64)

    def exponent_histograms(self, tickets: list[int]) -> tuple[ExponentHistogram, ...]:
        """The exponent histograms of ``tickets``, in that order (``histograms`` only)."""
        self.settle()
        counts = _take(self.histogram_blocks, tickets, layout().bins, np.int64)
        return tuple(ExponentHistogram(tuple(row)) for row in counts.tolist())


def _take(blocks: list[np.ndarray], tickets: list[int], width: int, dtype: type) -> np.ndarray:
    """Rows ``tickets`` of the blocks stacked in order (no copy when they are all, in order)."""
    stacked: np.ndarray
    if not blocks:
        stacked = np.empty((0, width), dtype=dtype)
    elif len(blocks) == 1:
        stacked = blocks[0]
    else:
        stacked = np.concatenate(blocks)
    if len(tickets) == len(stacked) and tickets == list(range(len(stacked))):
        return stacked
    return stacked[np.asarray(tickets, dtype=np.int64)]
