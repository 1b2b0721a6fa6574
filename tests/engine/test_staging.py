"""The staging ring's bookkeeping, on the CPU, with a channel whose copies run late.

A CUDA copy from a pinned buffer runs some time after it is queued; a ring
that refilled a buffer before its copies ran would send the wrong bytes.
:class:`LateChannel` models exactly that: queued copies run only when the
ring waits on a mark (or at the end), so any such bug changes the result.
The real channel is exercised on CUDA in ``tests/engine/test_cuda.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.engine.staging import ALIGNMENT, HostToDevice


@dataclass
class LateChannel:
    """Copies are queued and run only when waited on: the worst a device may do."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    queued: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    staging_buffers: int = 0
    handed_over: int = 0

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        self.staging_buffers += 1
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xCD, dtype=torch.uint8)

    def copy(self, target: torch.Tensor, staged: torch.Tensor) -> None:
        assert target.numel() == staged.numel() > 0
        self.queued.append((target, staged))

    def mark(self) -> object:
        return len(self.queued)

    def wait(self, mark: object) -> None:
        assert isinstance(mark, int)
        self.run(mark)

    def hand_over(self, target: torch.Tensor) -> None:
        self.handed_over += 1

    def run(self, upto: int | None = None) -> None:
        """Run the queued copies (up to a mark); a copy reads the staging buffer *now*."""
        upto = len(self.queued) if upto is None else upto
        for target, staged in self.queued[:upto]:
            if staged.numel():
                target.copy_(staged)
                staged.fill_(0xEE)  # a copied region must never be read again
        self.queued[:upto] = [(t, s[:0]) for t, s in self.queued[:upto]]


def send(sizes: list[tuple[int, torch.dtype]], buffer_bytes: int) -> tuple[LateChannel, int]:
    channel = LateChannel()
    ring = HostToDevice(channel, buffer_bytes=buffer_bytes)
    gen = torch.Generator().manual_seed(len(sizes))
    sources = [torch.randn(n, generator=gen).to(dtype) for n, dtype in sizes]
    expected = [s.clone() for s in sources]
    copies = []
    for source in sources:
        copies.append(ring.copy(source))
        source.fill_(-1.0)  # the values were taken: the caller may change them now
    channel.run()
    for copy, want in zip(copies, expected, strict=True):
        assert copy.dtype == want.dtype
        assert copy.shape == want.shape
        assert torch.equal(copy.view(torch.uint8), want.view(torch.uint8))
    assert channel.handed_over == len(sizes)
    return channel, ring.refills


@settings(derandomize=True, max_examples=150, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 70), st.integers(0, 5000)),
            st.sampled_from([torch.float32, torch.float16, torch.float64, torch.bfloat16]),
        ),
        max_size=30,
    ),
    buffer_bytes=st.sampled_from([ALIGNMENT, 1024, 4096 + 100]),
)
def test_every_byte_arrives_whatever_the_sizes(
    sizes: list[tuple[int, torch.dtype]], buffer_bytes: int
) -> None:
    channel, _ = send(sizes, buffer_bytes)
    assert channel.staging_buffers <= 2


def test_a_tensor_larger_than_the_ring_goes_through_in_pieces() -> None:
    """1 MiB through two 4 KiB buffers: bounded staging memory, the ring goes round."""
    channel, refills = send([(1 << 18, torch.float32), (3, torch.float32)], 4096)
    assert channel.staging_buffers == 2
    assert refills >= (1 << 20) // 4096 - 2


def test_small_tensors_share_a_buffer() -> None:
    """Ten 64-byte tensors fit one 4 KiB buffer: no refill, so no host wait."""
    channel, refills = send([(16, torch.float32)] * 10, 4096)
    assert channel.staging_buffers == 1
    assert refills == 0


def test_shapes_and_scalars_survive() -> None:
    channel = LateChannel()
    ring = HostToDevice(channel, buffer_bytes=1024)
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    scalar = torch.tensor(2.5, dtype=torch.float64)
    empty = torch.empty(0, 5)
    copies = [ring.copy(t) for t in (matrix, scalar, empty)]
    channel.run()
    assert torch.equal(copies[0], matrix)
    assert copies[1].shape == ()
    assert copies[1].item() == 2.5
    assert copies[2].shape == (0, 5)


def test_the_ring_needs_two_buffers() -> None:
    with pytest.raises(ValueError, match="two staging buffers"):
        HostToDevice(LateChannel(), buffers=1)
