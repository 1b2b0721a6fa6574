"""The engine's own kernel (eager or compiled) over pieces of bounded size.

Whatever the native and Triton kernels do not take (other devices, float64 and fp8 on
CUDA, ``--engine eager``, a Triton failure under ``auto``) is reduced here, a chunk at
a time, so the kernel's scratch stays within the memory budget: on the CPU a chunk is
small enough to stay in cache across the eager kernel's passes; on other devices it is
as large as the budget allows, since each chunk costs a dozen kernel launches.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gradaudit.engine.devices import stream_key
from gradaudit.engine.dtypes import work_dtype
from gradaudit.engine.kernels import Engine, RowKernel, make_kernel
from gradaudit.results.row import merge_rows

#: Elements of a large tensor reduced at once by the eager kernel. 2**18 float32
#: elements (1 MiB) stay in the CPU's cache across the kernel's passes.
DEFAULT_CHUNK_ELEMENTS = 1 << 18
#: The compiled kernel makes a single pass, so it takes larger chunks to amortise its call cost.
COMPILED_CHUNK_ELEMENTS = 1 << 22
#: Scratch bytes per chunk element of the eager kernel: a float32 mask, a float32
#: finite copy, a float64 copy for the sum of squares and a float32 upcast buffer.
_SCRATCH_BYTES_PER_ELEMENT = 20


class ChunkedKernel:
    """The engine's own row kernel, fed chunks of at most :meth:`step` elements.

    Shared by a collector and its fresh ones (a training loop's steps), with its
    scratch: the float32 buffer half and fp8 blocks are upcast into, per stream.
    """

    def __init__(self, engine: Engine, chunk_elements: int | None, memory_budget: int) -> None:
        # Half the budget for the kernel's scratch (chunks and buckets share it); the
        # collector keeps the other half for buckets waiting to be filled.
        fits = 1 << max((memory_budget // (2 * _SCRATCH_BYTES_PER_ELEMENT)).bit_length() - 1, 0)
        #: Chunks of tensors on accelerators: no cache to fit, and each chunk costs the
        #: eager kernel a dozen launches, so they are as large as the budget allows.
        self.device_chunk_elements = max(4096, min(COMPILED_CHUNK_ELEMENTS, fits))
        if chunk_elements is None:
            chunk_elements = (
                COMPILED_CHUNK_ELEMENTS if engine is Engine.COMPILED else DEFAULT_CHUNK_ELEMENTS
            )
            chunk_elements = max(4096, min(chunk_elements, fits))
        else:
            self.device_chunk_elements = chunk_elements
        if chunk_elements < 1:
            raise ValueError("chunk_elements must be >= 1")
        #: Chunks of CPU tensors.
        self.chunk_elements = chunk_elements
        self._kernel: RowKernel = make_kernel(engine)
        #: The kernel's engine: eager behind the native and Triton engines.
        self.engine = Engine.EAGER if engine in (Engine.NATIVE, Engine.TRITON) else engine
        self._upcast: dict[tuple[torch.device, int], torch.Tensor] = {}

    def step(self, device: torch.device) -> int:
        """Elements per chunk on ``device``: cache-sized on the CPU, budget-sized elsewhere."""
        return self.chunk_elements if device.type == "cpu" else self.device_chunk_elements

    def chunks(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """1-D pieces of at most :meth:`step` elements, never a copy of the whole tensor.

        A non-contiguous tensor is cut along dim 0 first, so only one block of
        rows is ever made contiguous.
        """
        step = self.step(tensor.device)
        if tensor.is_contiguous():
            yield from _pieces(tensor.reshape(-1), step)
            return
        row_elements = tensor.numel() // tensor.shape[0]
        rows_per_block = max(1, step // row_elements)
        for start in range(0, tensor.shape[0], rows_per_block):
            yield from _pieces(tensor[start : start + rows_per_block].reshape(-1), step)

    def rows(self, block: torch.Tensor) -> torch.Tensor:
        """Rows of a 2-D block, a chunk at a time.

        A whole tensor comes here when the Triton kernel failed on it: chunks keep
        the eager kernel's scratch within the memory budget.
        """
        step = self.step(block.device)
        if block.shape[0] == 1 and block.shape[1] > step:
            pieces = _pieces(block.view(-1), step)
            rows = torch.cat([self.rows(piece.view(1, -1)) for piece in pieces])
            return merge_rows(rows).unsqueeze(0)
        return self._kernel(self._upcast_for_eager(block))

    def _upcast_for_eager(self, block: torch.Tensor) -> torch.Tensor:
        """A half or fp8 block copied to float32 (the eager kernel's input), in a reused buffer."""
        if self.engine is not Engine.EAGER or block.dtype == work_dtype(block.dtype):
            return block
        key = (block.device, stream_key(block.device))
        buffer = self._upcast.get(key)
        if buffer is None or buffer.numel() < block.numel():
            buffer = torch.empty(
                max(block.numel(), self.step(block.device)),
                dtype=torch.float32,
                device=block.device,
            )
            self._upcast[key] = buffer
        return buffer[: block.numel()].view(block.shape).copy_(block)


def _pieces(flat: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]
