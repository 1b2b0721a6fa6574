"""Row kernels: a 2-D block ``[m, L]`` in, its stats rows ``[m, 7]`` (float64) out.

Each row of the block is one tensor (a bucket of small tensors, zero-padded)
or one chunk of a large tensor (``m == 1``). Two kernels compute the same
thing: the eager one is the reference and runs on every device, the compiled
one fuses every statistic into one pass with ``torch.compile``.

On the CPU both lose to the native single-pass kernel (:mod:`gradaudit.engine.native`,
which does not take blocks: it reads tensors in place). Measured on the 2-core
CPU this project targets (see ``benchmarks/``), the compiled kernel is not
faster than the cache-aware eager one and costs seconds of compilation, so
``auto`` never picks it; it is there for devices where one fused pass beats
several cached ones, and as a cross-check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gradaudit.engine.devices import stream_key
from gradaudit.engine.fpmode import subnormals_survive
from gradaudit.engine.options import Engine as Engine  # where the torch side finds it

INF = math.inf


class RowKernel(Protocol):
    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        """Stats rows ``[m, 7]`` of a contiguous block ``[m, L]``; no host read."""
        ...


class EagerKernel:
    """The reference kernel: a dozen eager ops per block, on reused scratch buffers.

    Choices that matter on the CPU (each measured): comparisons written into a
    float buffer and summed are 2x faster than bool masks and ``count_nonzero``;
    ``aminmax``/``dot`` over a whole ``[1, n]`` chunk are fast while their
    row-wise forms are not, so single-row blocks take full reductions and
    buckets take ``amax(dim=1)`` and a row-wise sum of squares.

    Blocks must be float32 or float64 (callers upcast half and fp8 blocks).
    """

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, torch.dtype, str, int], torch.Tensor] = {}
        self._ones: dict[torch.device, torch.Tensor] = {}

    def _buffer(self, like: torch.Tensor, dtype: torch.dtype, role: str) -> torch.Tensor:
        # Per stream: blocks reduced on two streams must not share a scratch buffer.
        key = (like.device, dtype, role, stream_key(like.device))
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < like.numel():
            buffer = torch.empty(like.numel(), dtype=dtype, device=like.device)
            self._scratch[key] = buffer
        return buffer[: like.numel()].view(like.shape)

    def _one(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, dtype=torch.float64, device=device)
        return one

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        if block.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"eager kernel takes float32/float64 blocks, not {block.dtype}")
        rows, _ = block.shape
        single = rows == 1
        mask = self._buffer(block, block.dtype, "mask")
        finite = self._buffer(block, block.dtype, "finite")

        def count(values: torch.Tensor) -> torch.Tensor:
            return values.sum().reshape(1) if single else values.sum(dim=1)

        counts = torch.stack(
            [
                count(torch.ne(block, block, out=mask)),
                count(torch.eq(block, INF, out=mask)),
                count(torch.eq(block, -INF, out=mask)),
                count(torch.eq(block, 0.0, out=mask)),
            ],
            dim=1,
        ).to(torch.float64)

        torch.nan_to_num(block, nan=0.0, posinf=0.0, neginf=0.0, out=finite)
        if single:
            low, high = torch.aminmax(finite)
            max_abs = torch.maximum(-low, high).to(torch.float64).reshape(1)
        else:
            max_abs = finite.abs_().amax(dim=1).to(torch.float64)
        # + 0.0 turns a -0.0 (maximum() does not order signed zeros) into 0: a tensor of
        # negative zeros has max |x| 0, not "-0.0" in the report.
        max_abs = max_abs + 0.0

        if block.dtype == torch.float64:
            scale = _power_of_two_above(max_abs)
            wide = finite.div_(scale.unsqueeze(1))
        else:
            scale = self._one(block.device).expand(rows)
            wide = self._buffer(block, torch.float64, "wide").copy_(finite)
        if single:
            flat = wide.view(-1)
            ssq = torch.dot(flat, flat).reshape(1)
        else:
            ssq = torch.mul(wide, wide, out=wide).sum(dim=1)
        return torch.cat([counts, torch.stack([max_abs, scale, ssq], dim=1)], dim=1)


def _power_of_two_above(max_abs: torch.Tensor) -> torch.Tensor:
    """2**(e-1) where max_abs = m * 2**e, m in [0.5, 1): every |x| / scale < 2.

    ``e - 1`` keeps the scale finite even for max_abs near float64's maximum
    (2**1024 would overflow), and a power of two divides exactly.
    """
    _, exponent = torch.frexp(max_abs)
    # pow of a float64 exponent, not ldexp: torch < 2.5's ldexp forms 2**e in float32,
    # which is inf from e = 128 on (every float64 norm above 1e38 came out NaN there).
    # A power of two is exact either way.
    return torch.pow(2.0, (exponent - 1).to(max_abs.dtype))


def complex_magnitudes(values: torch.Tensor) -> torch.Tensor:
    """The float64 modulus |z| of every element of a complex tensor, NaN where a part is NaN.

    The stats of the result are the complex tensor's, so every kernel audits
    complex data without knowing about it: an element counts as NaN when
    either part is NaN, as +Inf when a part is infinite and none is NaN (a
    complex infinity has no sign), as zero when both parts are zero;
    ``max_abs`` is the largest modulus and the sum of squares is that of both
    parts, sum(re² + im²). ``hypot`` in float64 cannot overflow for complex32
    or complex64 parts; a complex128 modulus above float64's range (~1.8e308,
    which takes a part within a factor √2 of it) comes out as +Inf.
    """
    parts = torch.view_as_real(values.resolve_conj()).to(torch.float64)
    modulus = torch.hypot(parts[..., 0], parts[..., 1])
    # hypot(inf, nan) is inf (IEEE 754); a NaN in either part must count as NaN.
    return torch.where(torch.isnan(parts).any(dim=-1), math.nan, modulus)


def fused_rows(block: torch.Tensor) -> torch.Tensor:
    """Every statistic of every row in one pass; written for ``torch.compile``.

    Counts are int32 (a block row holds far fewer than 2**31 elements) and the
    comparisons are spelled ``x != x`` and ``x == inf``: both compile to cheap
    vector compares where ``isnan``/``isinf`` with int64 sums do not.
    """
    work = block if block.dtype in (torch.float32, torch.float64) else block.float()
    # A single row (a chunk of a large tensor) is reduced whole: row-wise
    # reductions over one long row compile to a serial loop, 5x slower.
    dim = None if block.shape[0] == 1 else 1

    def total(values: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = values.sum(dtype=dtype) if dim is None else values.sum(dim=dim, dtype=dtype)
        return out.reshape(-1)

    nan = total(work != work, torch.int32)
    pos_inf = total(work == INF, torch.int32)
    neg_inf = total(work == -INF, torch.int32)
    zeros = total(work == 0, torch.int32)
    magnitude = work.abs()
    finite = torch.where(magnitude < INF, magnitude, 0.0)
    peak = finite.amax() if dim is None else finite.amax(dim=dim)
    max_abs = peak.reshape(-1).to(torch.float64) + 0.0  # never -0.0 (see above)
    if work.dtype == torch.float64:
        scale = _power_of_two_above(max_abs)
        wide = finite / scale.unsqueeze(1)
    else:
        scale = torch.ones_like(max_abs)
        wide = finite.to(torch.float64)
    ssq = total(wide * wide)
    counts = torch.stack([nan, pos_inf, neg_inf, zeros], dim=1).to(torch.float64)
    return torch.cat([counts, torch.stack([max_abs, scale, ssq], dim=1)], dim=1)


_compiled: Any = None


class CompiledKernel:
    """:func:`fused_rows` through ``torch.compile`` (dynamic shapes, one graph per dtype).

    Older PyTorch (2.4 measured; recent releases do not) builds inductor's CPU kernels
    with ``-ffast-math``, so loading each newly compiled kernel runs ``crtfastmath``'s
    constructor, which switches the loading thread to flush-to-zero: from then on the
    host process - its training included - reads every subnormal as 0, and this kernel's
    first block with it (a tensor of 1e-310 reported as ``max_abs`` 0). A call that
    flipped the mode puts IEEE mode back and computes its block again.
    """

    def __init__(self) -> None:
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(fused_rows, dynamic=True, fullgraph=True)
        self._fn = _compiled

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        ieee = subnormals_survive()
        result: torch.Tensor = self._fn(block)
        if ieee and not subnormals_survive():
            torch.set_flush_denormal(False)
            result = self._fn(block)
        return result


def make_kernel(engine: Engine) -> RowKernel:
    if engine is Engine.COMPILED:
        return CompiledKernel()
    return EagerKernel()


def collect_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stats rows ``[len(tensors), 7]`` of whole tensors: the collection as one pure function.

    Written so that ``torch.compile(collect_rows, fullgraph=True)`` traces it
    without a graph break (no host reads, no Python branch on a device value,
    only shapes and dtypes, which are static), for training loops that want
    the whole collection fused into their compiled step. Each tensor is one
    row (no chunking, no buckets): under ``torch.compile`` the reductions
    stream without temporaries, eagerly they would not — use the
    :class:`~gradaudit.engine.stats.StatsCollector` there.
    """
    rows = []
    for tensor in tensors:
        if tensor.numel() == 0:
            empty = torch.zeros((1, 7), dtype=torch.float64, device=tensor.device)
            empty[0, 5] = 1.0  # scale slot: the identity of the merge
            rows.append(empty)
            continue
        values = tensor.detach()
        if values.is_complex():
            values = complex_magnitudes(values)
        rows.append(fused_rows(values.reshape(1, -1)))
    return torch.cat(rows)
