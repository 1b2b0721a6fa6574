"""Where each ticket's stats row is, and the zero-padded buckets small tensors share.

The collector (:class:`~gradaudit.engine.stats.StatsCollector`) hands out a ticket per
tensor and appends blocks of rows as kernels produce them, in whatever order the
native batch, the buckets and the Triton launches finish. This module is that
bookkeeping alone, apart from the routing, so the one question "which row of the
blocks is ticket ``t``'s, and how many padding zeros does it count" has one answer.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@functools.lru_cache(maxsize=4096)
def bucket_length(numel: int) -> int:
    """The padded row length of a bucket for a tensor of ``numel`` elements.

    Lengths step by a factor of 2**(1/4), rounded up to 64 elements, so
    padding wastes at most about 19% of a bucket.
    """
    length = 64
    while length < numel:
        length = -(-int(length * 1.1892) // 64) * 64
    return length


@dataclass
class Bucket:
    """Zero-padded rows of small tensors waiting to be reduced together."""

    buffer: torch.Tensor
    #: The CUDA stream its rows were copied in on (``None`` off CUDA): the bucket is
    #: reduced there, after those copies, whatever stream is current at the flush.
    stream: torch.cuda.Stream | None = None
    #: (ticket, numel) of each filled row, in row order.
    tickets: list[tuple[int, int]] = field(default_factory=list)


class RowLayout:
    """Where each ticket's row is: its index in the concatenation of the blocks.

    Arrays of ints, not an object per tensor: with 100,000 tiny tensors
    the bookkeeping per ticket is a visible part of the audit. The common
    case (every row placed in ticket order, as one native batch after another
    does) needs no gather at all.
    """

    def __init__(self) -> None:
        #: Row of each ticket in the concatenated blocks; -1 while it waits in a batch or bucket.
        #: int64, not a list: a list holds an int object (~36 bytes) per tensor.
        self.rows: array.array[int] = array.array("q")
        #: Zeros that bucket padding added to a ticket's row (bucketed tickets only).
        self.padding: dict[int, int] = {}
        #: Rows in the blocks so far, and tickets given a row.
        self.placed = 0
        self.tickets_placed = 0
        self.in_order = True

    def new_ticket(self) -> int:
        self.rows.append(-1)
        return len(self.rows) - 1

    def place(
        self, tickets: list[int], padding: list[int] | None, *, unused_rows: bool = False
    ) -> None:
        """The next block's rows belong to ``tickets``, in order (-1: a row of no ticket,
        allowed with ``unused_rows``)."""
        start, count = self.placed, len(tickets)
        first = tickets[0] if count else 0
        if unused_rows:
            for offset, ticket in enumerate(tickets):
                if ticket >= 0:
                    self.rows[ticket] = start + offset
                    self.tickets_placed += 1
            self.in_order = False
        elif count and tickets[-1] - first == count - 1:  # consecutive (tickets only grow)
            self.rows[first : first + count] = array.array("q", range(start, start + count))
            self.in_order = self.in_order and first == start
            self.tickets_placed += count
        else:
            for offset, ticket in enumerate(tickets):
                self.rows[ticket] = start + offset
            self.in_order = False
            self.tickets_placed += count
        if padding is not None:
            for ticket, zeros in zip(tickets, padding, strict=True):
                if zeros:
                    self.padding[ticket] = zeros
        self.placed += count

    def new_placed(self, rows_of: np.ndarray, rows: int) -> range:
        """New tickets for a block of ``rows`` rows: ticket ``i``'s row is ``rows_of[i]`` (the
        block's other rows belong to no ticket), placed at once (one numpy operation)."""
        first, count = len(self.rows), len(rows_of)
        self.rows.frombytes((rows_of + self.placed).astype(np.int64).tobytes())
        self.tickets_placed += count
        self.in_order = False
        self.placed += rows
        return range(first, first + count)

    def check_placed(self) -> None:
        assert self.tickets_placed == len(self.rows), "a ticket was never placed"

    def index(self, tickets: Sequence[int]) -> tuple[list[int] | None, list[int] | None]:
        """Rows to gather for ``tickets`` (``None``: the blocks as they are) and their padding."""
        rows = self.rows
        in_order = self.in_order and len(tickets) == self.placed
        if in_order and array.array("q", tickets) == rows:
            index = None  # rows[t] == t for every ticket, and tickets are 0..n-1 in order
        else:
            index = [rows[ticket] for ticket in tickets]
        padding = None
        if self.padding:
            get = self.padding.get
            padding = [get(ticket, 0) for ticket in tickets]
        return index, padding
