"""Device side of the engine: tensors in, one small stats row per tensor out.

Nothing here reads a device value back to the host. Every statistic of a
tensor is a slot of a float64 *stats row* that stays on the tensor's device;
rows are stacked and read back once by :func:`read_rows` (the only host read of
a whole scan). That is what lets a training loop collect between ``backward()``
and ``optimizer.step()`` without stalling the stream, and it is proved by a test
that collects on ``device="meta"``, where every host read raises.

The stats row
-------------
``[nan, pos_inf, neg_inf, zeros, max_abs, scale, ssq]``

* counts are exact in float64 up to 2**53 elements;
* ``max_abs`` is the largest |x| over finite elements (0 when there are none);
* the sum of squares of the finite elements is ``scale**2 * ssq``. ``ssq`` is
  accumulated in float64, which cannot overflow for any float32/16/bf16/fp8
  input (3.4e38**2 = 1.2e77). Only float64 input can overflow float64 squares,
  so float64 chunks are divided by a power of two just above their ``max_abs``
  (exact, no rounding) and record that ``scale``; other chunks use ``scale=1``.

The merge rule (:func:`merge_rows`) combines rows of chunks into a tensor,
tensors into a file or a whole scan, and later shards and ranks: counts add,
maxima take the max, and sums of squares add after rescaling to the largest
scale.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

NAN, POS_INF, NEG_INF, ZEROS, MAX_ABS, SCALE, SSQ = range(7)
ROW_WIDTH = 7
_COUNT_SLOTS = slice(NAN, ZEROS + 1)

#: Elements reduced at once. Bounds the scratch memory: one float64 buffer
#: (8 MiB), one float32 buffer for upcast half/fp8 chunks (4 MiB) and one bool
#: mask (1 MiB) per device, whatever the size of the model or of its largest tensor.
DEFAULT_CHUNK_ELEMENTS = 1 << 20

#: Dtypes that are audited numerically; everything else is reported as skipped.
AUDITED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)

#: Dtypes that are reduced in a float32 working copy: CPU kernels for
#: isinf/max/norm are missing for fp8, and a float32 copy of a half chunk is exact.
_UPCAST_TO_FLOAT32: frozenset[torch.dtype] = AUDITED_DTYPES - {torch.float64, torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, the spelling used in every output."""
    return str(dtype).removeprefix("torch.")


def not_audited_reason(tensor: torch.Tensor) -> str | None:
    """Why ``tensor`` is skipped rather than audited, or ``None`` when it is audited."""
    if tensor.layout is not torch.strided:
        return f"{str(tensor.layout).removeprefix('torch.')} tensors are not audited"
    return dtype_skip_reason(tensor.dtype)


def dtype_skip_reason(dtype: torch.dtype) -> str | None:
    """Why a tensor of ``dtype`` is skipped, or ``None`` when the dtype is audited."""
    if dtype in AUDITED_DTYPES:
        return None
    if dtype.is_floating_point:
        return f"dtype {dtype_name(dtype)} is not supported by the engine; not audited"
    return f"dtype {dtype_name(dtype)} is not floating-point; not audited"


def merge_rows(rows: torch.Tensor) -> torch.Tensor:
    """Merge stats rows ``[k, 7]`` (k >= 1) into one row ``[7]``; the one merge rule.

    Rescaling multiplies by ``(scale_i / scale)`` twice rather than by its
    square so that a large ``ssq`` meets the small factor before it can
    underflow; contributions that still underflow are below 2**-1074 of the
    largest one and cannot change the result.
    """
    counts = rows[:, _COUNT_SLOTS].sum(dim=0)
    max_abs = rows[:, MAX_ABS].amax()
    scale = rows[:, SCALE].amax()
    ratio = rows[:, SCALE] / scale
    ssq = (rows[:, SSQ] * ratio * ratio).sum()
    return torch.cat([counts, torch.stack([max_abs, scale, ssq])])


def empty_row(device: torch.device | str = "cpu") -> torch.Tensor:
    """The stats row of a tensor with no elements (also the identity of the merge)."""
    row = torch.zeros(ROW_WIDTH, dtype=torch.float64, device=device)
    row[SCALE] = 1.0
    return row


class StatsCollector:
    """Turns tensors into stats rows, chunk by chunk, reusing scratch buffers.

    Fresh large temporaries cost several times a reused buffer on the CPU, so
    each device keeps one buffer per working dtype, sized to the chunk.
    """

    def __init__(self, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        if chunk_elements < 1:
            raise ValueError("chunk_elements must be >= 1")
        self.chunk_elements = chunk_elements
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._unit: dict[torch.device, torch.Tensor] = {}

    def row(self, tensor: torch.Tensor) -> torch.Tensor:
        """The stats row of ``tensor`` on its own device, without any host read."""
        if tensor.dtype not in AUDITED_DTYPES:
            raise TypeError(f"cannot audit dtype {dtype_name(tensor.dtype)}")
        if tensor.numel() == 0:
            return empty_row(tensor.device)
        rows = [self._chunk_row(chunk) for chunk in self._chunks(tensor)]
        if len(rows) == 1:
            return rows[0]
        return merge_rows(torch.stack(rows))

    def _chunks(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """1-D pieces of at most ``chunk_elements`` elements, never a copy of the whole tensor.

        A non-contiguous tensor is cut along dim 0 first, so only one block of
        rows is ever made contiguous.
        """
        step = self.chunk_elements
        if tensor.is_contiguous():
            yield from _pieces(tensor.reshape(-1), step)
            return
        row_elements = tensor.numel() // tensor.shape[0]
        rows_per_block = max(1, step // row_elements)
        for start in range(0, tensor.shape[0], rows_per_block):
            yield from _pieces(tensor[start : start + rows_per_block].reshape(-1), step)

    def _buffer(self, device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
        key = (device, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, self.chunk_elements), dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:n]

    def _one(self, device: torch.device) -> torch.Tensor:
        unit = self._unit.get(device)
        if unit is None:
            unit = torch.ones((), dtype=torch.float64, device=device)
            self._unit[device] = unit
        return unit

    def _chunk_row(self, chunk: torch.Tensor) -> torch.Tensor:
        n = chunk.numel()
        device = chunk.device
        work = chunk
        if chunk.dtype in _UPCAST_TO_FLOAT32:
            work = self._buffer(device, torch.float32, n).copy_(chunk)

        mask = self._buffer(device, torch.bool, n)
        nan = torch.count_nonzero(torch.ne(work, work, out=mask))
        pos_inf = torch.count_nonzero(torch.eq(work, math.inf, out=mask))
        neg_inf = torch.count_nonzero(torch.eq(work, -math.inf, out=mask))
        # count_nonzero counts NaN as non-zero and -0.0 as zero, as wanted.
        zeros = n - torch.count_nonzero(work)

        finite = self._buffer(device, torch.float64, n).copy_(work)
        torch.nan_to_num_(finite, nan=0.0, posinf=0.0, neginf=0.0)
        low, high = torch.aminmax(finite)
        max_abs = torch.maximum(-low, high)
        if work.dtype == torch.float64:
            # 2**(e-1) with max_abs = m * 2**e, m in [0.5, 1): every |x|/scale < 2,
            # and 2**(e-1) stays finite even for max_abs near float64's maximum.
            _, exponent = torch.frexp(max_abs)
            scale = torch.ldexp(self._one(device), exponent - 1)
            finite.div_(scale)
        else:
            scale = self._one(device)
        ssq = torch.dot(finite, finite)
        counts = torch.stack([nan, pos_inf, neg_inf, zeros]).to(torch.float64)
        return torch.cat([counts, torch.stack([max_abs, scale, ssq])])


def _pieces(flat: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


@dataclass(frozen=True)
class HostRow:
    """One stats row after the host read, with the derived norm."""

    nan: int
    pos_inf: int
    neg_inf: int
    zeros: int
    max_abs: float
    norm: float

    @classmethod
    def from_values(cls, values: list[float]) -> HostRow:
        scale, ssq = values[SCALE], values[SSQ]
        return cls(
            nan=int(values[NAN]),
            pos_inf=int(values[POS_INF]),
            neg_inf=int(values[NEG_INF]),
            zeros=int(values[ZEROS]),
            max_abs=values[MAX_ABS],
            norm=scale * math.sqrt(ssq),
        )


def read_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack device rows and copy them to the host: one transfer per device.

    Returns a CPU float64 ``[len(rows), 7]`` matrix in the order given. Rows
    normally share one device; rows spread over several devices cost one read
    for each.
    """
    if not rows:
        return torch.empty((0, ROW_WIDTH), dtype=torch.float64)
    by_device: dict[torch.device, list[int]] = {}
    for index, row in enumerate(rows):
        by_device.setdefault(row.device, []).append(index)
    host = torch.empty((len(rows), ROW_WIDTH), dtype=torch.float64)
    for _device, indices in by_device.items():
        stacked = torch.stack([rows[i] for i in indices])
        host[indices] = stacked.to("cpu")
    return host
