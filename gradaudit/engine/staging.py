"""Host-to-device copies that overlap reading the next tensor with reducing this one.

``cpu_tensor.to("cuda")`` from ordinary (pageable) memory blocks the host
until the copy is done, and the driver stages it through a pinned buffer of
its own. Streaming a checkpoint that way alternates: read a tensor, wait for
its copy, queue its reduction, read the next. Here the host copies each
tensor into one of a few pinned staging buffers (that copy is where the file
is actually read, page by page, from the memory map) and queues the
host-to-device copy on a side stream; the compute stream only waits for
that copy on the device, and the host goes on reading the next tensor while
the GPU copies and reduces this one. The host waits only before it refills a
staging buffer whose previous copy is still in flight.

Memory stays bounded: the staging buffers (``buffers * buffer_bytes``
pinned bytes, a share of ``--max-memory``) and the device copy of the
tensors being reduced. A tensor larger than a buffer goes through in
buffer-sized pieces; small tensors share a buffer.

The ring bookkeeping is separate from CUDA (:class:`Channel`), so it is
tested on the CPU with a synchronous channel; :class:`CudaChannel` is the real one.
"""

from __future__ import annotations

from typing import Protocol

import torch

#: Bytes of one pinned staging buffer, and how many buffers take turns.
BUFFER_BYTES = 16 * 1024 * 1024
BUFFERS = 2
#: Offsets of tensors inside a staging buffer are rounded up to this many bytes.
ALIGNMENT = 256


class Channel(Protocol):
    """How bytes reach the device: staging memory, asynchronous copies, and marks to wait on."""

    device: torch.device

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` (uint8) that copies can start from (pinned on CUDA)."""
        ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device memory (uint8) that the copies may write to while the device computes."""
        ...

    def copy(self, target: torch.Tensor, staged: torch.Tensor) -> None:
        """Queue a copy of ``staged`` (host) into ``target`` (device); may return before it runs."""
        ...

    def mark(self) -> object:
        """A mark after every copy queued so far, to :meth:`wait` on before reusing their buffer."""
        ...

    def wait(self, mark: object) -> None:
        """Block the host until the copies before ``mark`` have run."""
        ...

    def hand_over(self, target: torch.Tensor) -> None:
        """Make the computation that follows wait for ``target``'s copies, on the device."""
        ...


class CudaChannel:
    """Pinned staging buffers and a side stream of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def staging_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        # Allocated on the side stream that writes it; hand_over records its use
        # by the compute stream, so the caching allocator cannot give the memory
        # to a later copy while a reduction still reads it.
        with torch.cuda.stream(self._stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, target: torch.Tensor, staged: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            target.copy_(staged, non_blocking=True)

    def mark(self) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def wait(self, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event)
        mark.synchronize()

    def hand_over(self, target: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self._stream)
        target.record_stream(compute)


class HostToDevice:
    """Copies CPU tensors to one device through a ring of staging buffers.

    :meth:`copy` returns the device tensor once its values are in a staging
    buffer: the source may change or be unmapped right after, and the device
    copy is ordered before anything queued next on the compute stream.
    """

    def __init__(
        self,
        channel: Channel,
        *,
        buffer_bytes: int | None = None,
        buffers: int | None = None,
    ) -> None:
        buffer_bytes = BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        buffers = BUFFERS if buffers is None else buffers
        if buffers < 2 or buffer_bytes < ALIGNMENT:
            raise ValueError("need at least two staging buffers of at least ALIGNMENT bytes")
        self.channel = channel
        self.buffer_bytes = buffer_bytes - buffer_bytes % ALIGNMENT
        self._count = buffers
        self._buffers: list[torch.Tensor] = []  # made on first use: pinning costs milliseconds
        self._marks: list[object | None] = [None] * buffers
        self._current = 0
        self._offset = 0
        #: Buffers refilled after a wait for their previous copies (the ring went round).
        self.refills = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the CPU) as a new tensor on the channel's device."""
        source = tensor.contiguous().reshape(-1).view(torch.uint8)
        nbytes = source.numel()
        target = self.channel.empty(nbytes)
        start = 0
        while start < nbytes:
            if self._offset == self.buffer_bytes:
                self._rotate()
            length = min(nbytes - start, self.buffer_bytes - self._offset)
            if length < nbytes - start and self._offset > 0:
                # Do not split a tensor that would fit whole in a fresh buffer
                # (nor start a large one in a buffer's last few bytes).
                self._rotate()
                length = min(nbytes - start, self.buffer_bytes)
            staged = self._buffer(self._current)[self._offset : self._offset + length]
            staged.copy_(source[start : start + length])
            self.channel.copy(target[start : start + length], staged)
            start += length
            aligned_end = -(-(self._offset + length) // ALIGNMENT) * ALIGNMENT
            self._offset = min(self.buffer_bytes, aligned_end)
        self.channel.hand_over(target)
        return target.view(tensor.dtype).view(tensor.shape)

    def _buffer(self, index: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(self.channel.staging_buffer(self.buffer_bytes))
        return self._buffers[index]

    def _rotate(self) -> None:
        """Close the current buffer (mark its copies) and take the next, once its copies ran."""
        self._marks[self._current] = self.channel.mark()
        self._current = (self._current + 1) % self._count
        self._offset = 0
        mark = self._marks[self._current]
        if mark is not None:
            self.refills += 1
            self.channel.wait(mark)
            self._marks[self._current] = None
