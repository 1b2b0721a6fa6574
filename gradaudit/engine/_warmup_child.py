"""The background compile's child process (:mod:`gradaudit.engine.warmup`): compiles and
runs every variant of the Triton kernels this GPU uses on tiny tensors (the exponent
histogram's too), so that Triton's on-disk cache holds them, and leaves the marker a
later ``compile_worth`` finds.

Run as ``python -m gradaudit.engine._warmup_child DEVICE_INDEX``; exit status 0 when the
kernels ran, anything else (with the cause on stderr) when they did not.
"""

from __future__ import annotations

import sys

import torch

from gradaudit.engine import triton_histogram, triton_kernel


def main(argv: list[str]) -> int:
    device = torch.device("cuda", int(argv[0]))
    if not triton_kernel.runs_on(device):
        print(f"the Triton kernels do not run on {device}", file=sys.stderr)
        return 1
    # The variants a flush launches: two table_rows per dtype (the float32-sum ones where
    # the GPU's float64 is slow, as the parent chooses) and merge_partials. Fresh tensors
    # are 16-byte aligned, as the parent's bases are, so the same specialisations compile.
    # Both ways a flush goes: tensors of one program each (each stats row written by
    # table_rows, no merge) and tensors of several (partial rows, merged).
    rows = []
    for length in (4096, 2 * triton_kernel.MAX_SPAN):
        batch = triton_kernel.TritonBatch(device)
        for ticket, dtype in enumerate(triton_kernel.KINDS):
            assert batch.add(torch.ones(length, dtype=dtype, device=device), ticket)
        out, tickets = batch.launch()
        rows.append(out[[row for row, ticket in enumerate(tickets) if ticket >= 0]])
    out = torch.cat(rows)
    # The exponent histogram's kernel (``precision=``): one variant per kind of bits. Its
    # failure is said and does not fail the warm-up: the stats kernels compiled, and a
    # histogram that cannot launch is counted by torch's ops (StatsCollector._histogram).
    try:
        for dtype in (torch.float32, torch.bfloat16):
            triton_histogram.counts(torch.ones(4096, dtype=dtype, device=device))
    except Exception as error:  # noqa: BLE001 (any compile or launch failure)
        print(f"the exponent histogram's kernel did not compile: {error}", file=sys.stderr)
    torch.cuda.synchronize(device)
    if not bool(torch.isfinite(out).all()):
        print("the kernels ran but their rows are not finite", file=sys.stderr)
        return 1
    triton_kernel.mark_warm(device)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
