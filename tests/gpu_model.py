"""The whole-program bandwidth model of the Triton kernels, from their compiled SASS.

Run as ``python -m tests.gpu_model`` (unset ``TRITON_INTERPRET``): compiles the kernels
for sm_90 through :mod:`tests.sass` and prints docs/gpu.md's table, the modelled share of
H100 and H200 HBM for each realistic flush. ``tests/engine/test_gpu_budget.py`` asserts it.

The model (the issue rule of ``tests/sass.py``, applied to every instruction a flush
issues, not only the inner loop's)
----------------------------------------------------------------------------------
A program of :func:`~gradaudit.engine._triton_rows.table_rows` issues, per warp:

* the straight-line code once (the row lookup through the program -> row map, the
  fast path's reductions and the stores): an upper bound, since a predicated-off
  instruction still takes its issue slot and a branch around a part that is not an edge
  block is counted as taken;
* an edge block (a region a conditional branch skips that loads data) only when the
  program has that edge: a head when its first element is not 16-byte aligned (never
  here: the caching allocator aligns tensors and spans are whole steps), a tail when its
  elements are not a whole number of steps;
* the inner loop's instructions × its steps (``STEP`` elements each);
* not the exact path (``rescue``): a healthy flush holds no NaN or infinity, and a
  program that meets one runs its span again through it (about twice its cost).

Every warp of a program issues the same, and :func:`merge_partials` adds its own per
stats row, unless every tensor is one program (``DIRECT``: nothing is merged, and the
programs are that variant's, whose store takes its row from the map: 4 instructions more
on sm_90).
Issue slots per element ``i`` = all warp instructions of the flush / its elements; the
modelled share of HBM is ``min(1, budget / i)`` with ``budget = 4 × SMs × clock ×
itemsize / bandwidth`` (an SM issues 4 warp instructions per clock).

What it leaves out (a GPU measures it): latency. A program's row lookup is a chain of
dependent loads before its first data load, and each step's load is consumed at once,
so bytes in flight per SM are ``resident programs × BLOCK × itemsize``;
:func:`in_flight_share` gives Little's-law ceiling (600 ns) as a second, separate figure.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradaudit.engine import triton_kernel
from tests.sass import ISSUE_PER_CLOCK

#: H100 SXM and H200 (both 132 SMs of the same die; the clock under load, not boost).
H100 = {"sms": 132, "clock_hz": 1.755e9, "bandwidth": 3.35e12}
H200 = {"sms": 132, "clock_hz": 1.755e9, "bandwidth": 4.8e12}
GPUS = {"H100": H100, "H200": H200}
#: Load-to-use latency of HBM the in-flight ceiling assumes (issue 31's figure).
LATENCY_S = 600e-9
#: Registers per SM and the most resident programs per SM (sm_90).
REGISTERS_PER_SM = 65536
MAX_PROGRAMS_PER_SM = 32


def budget(itemsize: int, gpu: dict[str, float]) -> float:
    """Issue slots per element (per warp) that keep up with ``gpu``'s HBM."""
    return ISSUE_PER_CLOCK * gpu["sms"] * gpu["clock_hz"] * itemsize / gpu["bandwidth"]


@dataclass(frozen=True)
class Costs:
    """Per-warp instruction counts of one compiled variant of ``table_rows`` and of
    ``merge_partials``, read from their SASS (``tests.sass`` results)."""

    inner: int
    #: Straight-line instructions every program issues (edge blocks excluded).
    fixed: int
    #: Instructions of the edge blocks a branch skips: (head, tail), or () when none is
    #: skippable (they are then in ``fixed``).
    edges: tuple[int, ...]
    warps: int
    registers: int
    #: Instructions of the exact path, which a program runs only when its span holds a
    #: NaN or an infinity (left out of a healthy flush's figures).
    rescue: int
    merge_fixed: int
    merge_loop: int
    merge_warps: int
    #: Straight-line instructions of the ``DIRECT`` variant (a flush of one program per
    #: tensor: each program stores its tensor's stats row, nothing is merged).
    direct_fixed: int

    @classmethod
    def from_sass(
        cls, table: dict[str, Any], merge: dict[str, Any], direct: dict[str, Any]
    ) -> Costs:
        inner = [loop for loop in table["loops"] if "LDG.E.128" in loop["global_loads"]]
        assert len(inner) == 1, table["loops"]
        # Only the inner loop: a program finds its row in the map, without a search.
        assert len(table["loops"]) == 1, table["loops"]
        looped = sum(loop["instructions"] for loop in table["loops"])
        edges = tuple(edge["instructions"] for edge in table["edges"])
        assert len(edges) <= 2, table["edges"]
        (merge_loop,) = merge["loops"]
        # The direct variant differs in its straight-line code only.
        assert shape(direct["loops"]) == shape(table["loops"]), (direct["loops"], table["loops"])
        assert tuple(edge["instructions"] for edge in direct["edges"]) == edges
        unlooped = looped + sum(edges)
        return cls(
            inner=inner[0]["instructions"],
            fixed=table["instructions"] - unlooped - table["rescue"]["instructions"],
            direct_fixed=direct["instructions"] - unlooped - direct["rescue"]["instructions"],
            edges=edges,
            warps=table["warps"],
            registers=table["registers"],
            rescue=table["rescue"]["instructions"],
            merge_fixed=merge["instructions"] - merge_loop["instructions"],
            merge_loop=merge_loop["instructions"],
            merge_warps=merge["warps"],
        )


@dataclass(frozen=True)
class Figures:
    """The model's figures for one flush of one dtype."""

    elements: int
    programs: int
    #: Warp instructions per element: the whole flush, and its inner loops alone.
    per_element: float
    inner_per_element: float
    itemsize: int
    registers: int

    def share(self, gpu: dict[str, float]) -> float:
        """Modelled share of ``gpu``'s HBM bandwidth (issue slots only)."""
        return min(1.0, budget(self.itemsize, gpu) / self.per_element)


def flush(lengths: Sequence[int], itemsize: int, costs: Costs, sms: int = 132) -> Figures:
    """The model for one dtype group of ``lengths`` elements, spans as ``TritonBatch`` sizes
    them for ``sms`` SMs (tensors 16-byte aligned, as the caching allocator leaves them)."""
    block = triton_kernel.STEP  # elements per inner-loop iteration
    spans = triton_kernel.spans(lengths, sms)
    direct = triton_kernel.is_direct(
        len(lengths) + 1, sum(map(programs_of, lengths, spans)), groups=1
    )
    per_program = costs.direct_fixed if direct else costs.fixed
    tail = costs.edges[-1] if costs.edges else 0
    instructions = 0  # per warp, summed over programs
    programs = 0
    steps = 0
    for length, span in zip(lengths, spans, strict=True):
        whole, rest = divmod(length, span)
        programs += -(-length // span)
        steps += length // span * (span // block) + rest // block
        # Every program but a tensor's last takes a whole span; the last takes the rest.
        for count, elements in ((whole, span), (1 if rest else 0, rest)):
            body, edge = divmod(elements, block)
            instructions += count * (per_program + costs.inner * body + (tail if edge else 0))
    rows = len(lengths) + 2  # the group's sentinel and the last row
    parts = triton_kernel.MERGE_PARTS
    merge = rows * costs.merge_fixed + sum(
        -(-programs_of(length, span) // parts) * costs.merge_loop
        for length, span in zip(lengths, spans, strict=True)
    )
    if direct:
        merge = 0  # every tensor one program: table_rows writes the stats rows, no merge
    elements = sum(lengths)
    total = costs.warps * instructions + costs.merge_warps * merge
    return Figures(
        elements=elements,
        programs=programs,
        per_element=total / elements,
        inner_per_element=costs.warps * costs.inner * steps / elements,
        itemsize=itemsize,
        registers=costs.registers,
    )


def shape(loops: Sequence[dict[str, Any]]) -> list[tuple[int, list[str]]]:
    """Loops as their instruction counts and loads (not where they start)."""
    return [(loop["instructions"], loop["global_loads"]) for loop in loops]


def programs_of(length: int, span: int) -> int:
    return -(-length // span)


def in_flight_share(figures: Figures, gpu: dict[str, float], warps: int = 4) -> float:
    """Little's-law ceiling: resident programs × one step's bytes per SM, per latency."""
    threads = 32 * warps
    registers = -(-figures.registers // 8) * 8
    resident = min(MAX_PROGRAMS_PER_SM, REGISTERS_PER_SM // (registers * threads))
    resident = min(resident, math.ceil(figures.programs / gpu["sms"]))
    in_flight = gpu["sms"] * resident * triton_kernel.STEP * figures.itemsize
    return min(1.0, in_flight / LATENCY_S / gpu["bandwidth"])


# -- the flushes ---------------------------------------------------------------------


def transformer(itemsize: int) -> list[int]:
    """bench_gpu's transformer: 420 tensors, 2 GiB in float32, 1 GiB in 2-byte dtypes."""
    from benchmarks.bench_scan import transformer_layout

    total = 2048 * (1 << 20) * itemsize // 4
    return [math.prod(shape) for _, shape in transformer_layout(total, itemsize)]


def llama(layers: int = 8) -> list[int]:
    """8 blocks of a 7B Llama-like model (benchmarks/gpu_probes.py's layout)."""
    hidden, ffn = 4096, 11008
    block = [hidden * hidden] * 4 + [ffn * hidden] * 3 + [hidden, hidden]
    return block * layers


def tiny(count: int = 5000) -> list[int]:
    """bench_gpu's tiny workload: ``count`` tensors of 1,000..10,000 elements (seeded)."""
    import torch

    sizes = torch.randint(1000, 10_000, (count,), generator=torch.Generator().manual_seed(1))
    return [int(n) for n in sizes]


#: (label, dtype name, itemsize, lengths) of every modelled flush.
def layouts() -> list[tuple[str, str, int, list[int]]]:
    return [
        ("transformer", "float32", 4, transformer(4)),
        ("transformer", "bfloat16", 2, transformer(2)),
        ("7B-like, 8 layers", "float32", 4, llama()),
        ("7B-like, 8 layers", "bfloat16", 2, llama()),
        ("one 4096×4096", "bfloat16", 2, [4096 * 4096]),
        ("5000 tiny", "float32", 4, tiny()),
        ("5000 tiny", "bfloat16", 2, tiny()),
    ]


def costs_by_dtype(results: Sequence[dict[str, Any]], cc: int = 90) -> dict[str, Costs]:
    """Costs of the float64-sum variants on ``cc`` from ``tests.sass`` results."""
    (merge,) = [r for r in results if r["cc"] == cc and r["kernel"] == "merge_partials"]

    def variant(kernel: str) -> dict[str, Any]:
        return next(r for r in results if r["cc"] == cc and r["kernel"] == kernel)

    return {
        name: Costs.from_sass(
            variant(f"table_rows[{name}]"), merge, variant(f"direct table_rows[{name}]")
        )
        for name in ("float32", "bfloat16", "float16")
    }


def rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """docs/gpu.md's table: one row per flush."""
    costs = costs_by_dtype(results)
    table = []
    for label, dtype, itemsize, lengths in layouts():
        figures = flush(lengths, itemsize, costs[dtype])
        table.append(
            {
                "flush": label,
                "dtype": dtype,
                "tensors": len(lengths),
                "programs": figures.programs,
                "instr/elem": figures.per_element,
                "loop instr/elem": figures.inner_per_element,
                **{f"% of {name}": 100 * figures.share(gpu) for name, gpu in GPUS.items()},
                **{
                    f"in flight % of {name}": 100 * in_flight_share(figures, gpu)
                    for name, gpu in GPUS.items()
                },
            }
        )
    return table


def markdown(table: Sequence[dict[str, Any]]) -> str:
    head = list(table[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        cells = [
            f"{v:.3f}"
            if isinstance(v, float) and "instr" in k
            else f"{v:.0f}"
            if isinstance(v, float)
            else str(v)
            for k, v in row.items()
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from tests.sass import compile_all

    print(markdown(rows(compile_all([90]))))


if __name__ == "__main__":
    main()
    sys.exit(0)
