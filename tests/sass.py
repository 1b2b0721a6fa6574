"""Compile the Triton kernels for real GPU targets without a GPU, and read the machine code.

Run as ``python -m tests.sass [cc ...]``: prints one JSON object per kernel
variant and target with what ``tests/engine/test_gpu_budget.py`` checks. It runs in
a process of its own because the test suite turns on Triton's interpreter
(``TRITON_INTERPRET=1``), under which ``triton.jit`` gives interpreted
functions that cannot be compiled.

``triton.compile`` with a ``GPUTarget`` runs Triton's whole pipeline and its
bundled ``ptxas`` for that target on the CPU; ``cuobjdump`` (bundled too)
gives the registers, local memory (spills) and SASS of the cubin.

The bandwidth model the budgets come from (``docs/gpu.md`` has it in words)
----------------------------------------------------------------------------
An SM issues at most 4 warp instructions per clock (one per scheduler, on
every target here). The inner loop of :func:`table_rows` is ``n`` SASS
instructions per warp and takes ``E = BLOCK / num_warps`` elements per warp,
so it costs ``i = n / E`` issue slots per element, and an SM can process at
most ``4 / i`` elements per clock. To keep up with HBM, ``SMs * clock * 4 / i``
elements per second must reach ``bandwidth / itemsize``, so

    i  <=  4 * SMs * clock * itemsize / bandwidth.

H100 SXM (132 SMs, 1.755 GHz under load, 3.35 TB/s): 1.106 for float32 and
0.553 for 2-byte dtypes. A100 80 GB (108 SMs, 1.41 GHz, 2.04 TB/s): 1.195 and
0.597. The H100's are the tighter: they are :data:`BUDGET`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

#: Issue slots per element the inner loop may take (see the module doc).
H100 = {"sms": 132, "clock_hz": 1.755e9, "bandwidth": 3.35e12}
ISSUE_PER_CLOCK = 4


def budget(itemsize: int, gpu: dict[str, float] = H100) -> float:
    """Instructions per element (per warp) that still keep up with ``gpu``'s HBM."""
    return ISSUE_PER_CLOCK * gpu["sms"] * gpu["clock_hz"] * itemsize / gpu["bandwidth"]


BUDGET = {4: budget(4), 2: budget(2)}

#: The kernel variants: KIND -> (pointer type of x_ptr, itemsize).
KINDS = {0: ("*fp32", 4), 1: ("*i16", 2), 2: ("*fp16", 2)}
NAMES = {0: "float32", 1: "bfloat16", 2: "float16"}
#: ``STAGES`` of the pipelined variants (``benchmarks/gpu_probes.py``'s ``LAUNCH_VARIANTS``).
STAGED = (2, 3)


def _tools() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def newest_target() -> int:
    """The newest ``sm_XY`` the bundled ptxas (Blackwell's, the newer one) accepts."""
    tools = _tools()
    names = ("ptxas-blackwell", "ptxas")
    path = next(os.path.join(tools, n) for n in names if os.path.exists(os.path.join(tools, n)))
    text = subprocess.run([path, "--help"], capture_output=True, text=True, check=True).stdout
    return max(int(arch) for arch in re.findall(r"'sm_(\d+)[a-z]?'", text))


def _analyse(cubin: bytes) -> dict[str, Any]:
    tools = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        usage = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-res-usage", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sass = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-sass", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))  # type: ignore[union-attr]
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # type: ignore[union-attr]
    code = [
        (int(address, 16), text.strip())
        for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    ]
    # Up to the last EXIT: what follows is the padding branch to itself.
    last = max(a for a, t in code if re.search(r"\bEXIT\b", t))
    code = [(a, t) for a, t in code if a <= last]
    loops = []
    skips = []
    for address, text in code:
        if re.search(r"\bBRA\b", text):
            target = int(re.findall(r"0x([0-9a-f]+)", text)[-1], 16)
            if target < address:  # a backward branch closes a loop
                body = [t for a, t in code if target <= a <= address]
                opcodes = [_opcode(t) for t in body]
                loops.append(
                    {
                        "start": target,
                        "end": address,
                        "instructions": len(body),
                        "global_loads": [op for op in opcodes if op.startswith("LDG")],
                        "opcodes": [op.split(".")[0] for op in opcodes],
                    }
                )
            elif text.startswith("@"):  # a conditional forward branch skips a region
                skips.append((address, target))
    # The exact path (``_exact``): the region a conditional forward branch skips that holds
    # a data loop other than the first (the fast path's loop comes first in the code). A
    # program runs it only when its span holds a NaN or an infinity; its loops and edges
    # are reported apart, as ``rescue``, not as the program's.
    vector = sorted(
        (loop for loop in loops if "LDG.E.128" in loop["global_loads"]),
        key=lambda loop: loop["start"],
    )
    rescue = {"start": 0, "end": 0, "instructions": 0}
    if len(vector) > 1:
        fast = vector[0]
        regions = [
            (address, target)
            for address, target in skips
            if not address < fast["start"] < target
            and any(address < loop["start"] < target for loop in vector[1:])
        ]
        address, target = max(regions, key=lambda region: region[1] - region[0])
        inside = [t for a, t in code if address < a < target]
        rescue = {"start": address, "end": target, "instructions": len(inside)}
        loops = [loop for loop in loops if not address < loop["start"] < target]
        skips = [skip for skip in skips if not address <= skip[0] < target]
    # Edge blocks: regions a conditional forward branch skips that load data (not a
    # table row's LDG.E.64) and hold no loop: what a program without that edge saves.
    edges = []
    for address, target in skips:
        region = [t for a, t in code if address < a < target]
        data = [op for op in map(_opcode, region) if op.startswith("LDG") and op != "LDG.E.64"]
        looped = any(address < loop["start"] < target for loop in loops)
        if data and not looped:
            edges.append({"start": address, "instructions": len(region)})
    return {
        "registers": registers,
        "local_bytes": local,
        "stack_bytes": stack,
        "instructions": len(code),
        "loops": loops,
        "edges": edges,
        "rescue": rescue,
    }


def _opcode(text: str) -> str:
    """The opcode of a SASS line, past its predicate (``@P0``, ``@!P1``)."""
    return text.split()[1] if text.startswith("@") else text.split()[0]


def recorded_launches(fp32_sums: bool) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """The kernel launches of one real flush, recorded instead of run: kernel, args, kwargs.

    ``TritonBatch.launch`` itself builds them, on CPU tensors: per dtype a fresh tensor
    (the group's base) and views of it at odd element offsets (misaligned starts), so
    what is compiled below is what the collector launches, options and alignment included.
    """
    import torch

    from gradaudit.engine import triton_kernel
    from gradaudit.engine._triton_rows import merge_partials, table_rows

    recorded: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                recorded.append((self.kernel, args, kwargs))

            return launch

    kernels, accumulate = triton_kernel._kernels, triton_kernel.FP32_ACCUMULATE
    triton_kernel._kernels = lambda: (Recorder(table_rows), Recorder(merge_partials))  # type: ignore[assignment]
    triton_kernel.FP32_ACCUMULATE = fp32_sums
    try:
        batch = triton_kernel.TritonBatch(torch.device("cpu"))
        ticket = 0
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            parent = torch.zeros(70_000, dtype=dtype)
            # A misaligned view first: it must not become the group's base (a batch
            # refuses it and a later tensor may take it).
            batch.add(parent[1:], ticket)
            for view in (parent, parent[1:], parent[3:40_000], parent[5:]):
                ticket += 1
                assert batch.add(view, ticket)
        batch.launch()
    finally:
        triton_kernel._kernels = kernels  # type: ignore[method-assign]
        triton_kernel.FP32_ACCUMULATE = accumulate
    return recorded


def specialise_and_compile(
    kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cc: int
) -> Any:
    """``kernel[grid](*args, **kwargs)``'s compile for ``sm_<cc>``, as Triton's launcher does it.

    Triton's own binder specialises on the real arguments (a pointer's 16-byte alignment,
    integers' divisibility) and parses the launch's options; only the target is ours.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    kwargs = {
        **kwargs,
        "debug": kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
        "instrumentation_mode": knobs.compilation.instrumentation_mode,
    }
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def compile_all(targets: list[int]) -> list[dict[str, Any]]:
    """Every kernel variant for every target, from a real flush's launches: registers,
    spills, loops and the options the launch gave."""
    from gradaudit.engine import triton_kernel

    launches = recorded_launches(False)
    table = {launch[2]["KIND"]: launch for launch in launches if "KIND" in launch[2]}
    (merge,) = [launch for launch in launches if "KIND" not in launch[2]]
    sums = {
        launch[2]["KIND"]: launch for launch in recorded_launches(True) if launch[2].get("FP32_ACC")
    }
    assert sorted(table) == [0, 1, 2]
    assert sorted(sums) == [0, 1, 2]
    # The float32-sum variant, for every dtype on GPUs with slow float64: an
    # sm_86 (A10) and the newest target (12.x).
    variants = [(cc, table[kind], False) for cc in targets for kind in KINDS]
    variants += [(cc, sums[kind], True) for cc in (86, targets[-1]) for kind in KINDS]
    jobs: list[tuple[str, int, Any, tuple[Any, ...], dict[str, Any]]] = []
    for cc, (kernel, args, kwargs), fp32_sums in variants:
        name = f"table_rows[{NAMES[kwargs['KIND']]}{', fp32 sums' if fp32_sums else ''}]"
        jobs.append((name, cc, kernel, args, kwargs))
    # The pipelined loops the GPU check's launch-shapes step measures (``STAGES``), on sm_90.
    for (kernel, args, kwargs), stages in itertools.product(
        (table[kind] for kind in KINDS), STAGED if 90 in targets else ()
    ):
        name = f"staged table_rows[{NAMES[kwargs['KIND']]}, {stages} stages]"
        jobs.append((name, 90, kernel, args, {**kwargs, "STAGES": stages}))
    # The variant a flush of one program per tensor launches (``DIRECT``: no merge), on
    # sm_90: the whole-program model's tiny flushes.
    for kernel, args, kwargs in (table[kind] for kind in KINDS) if 90 in targets else ():
        name = f"direct table_rows[{NAMES[kwargs['KIND']]}]"
        jobs.append((name, 90, kernel, args, {**kwargs, "DIRECT": True}))
    results = []
    for name, cc, kernel, args, kwargs in jobs:
        compiled = specialise_and_compile(kernel, args, kwargs, cc)
        results.append(
            {
                "kernel": name,
                "cc": cc,
                "itemsize": KINDS[kwargs["KIND"]][1],
                "warps": compiled.metadata.num_warps,
                "block": triton_kernel.STEP,
                **({"stages": kwargs["STAGES"]} if "STAGES" in kwargs else {}),
                "shared": compiled.metadata.shared,
                "fp_fusion": compiled.metadata.enable_fp_fusion,
                **_analyse(compiled.asm["cubin"]),
            }
        )
    for cc in targets:
        compiled = specialise_and_compile(*merge, cc)
        results.append(
            {
                "kernel": "merge_partials",
                "cc": cc,
                "warps": compiled.metadata.num_warps,
                "fp_fusion": compiled.metadata.enable_fp_fusion,
                **_analyse(compiled.asm["cubin"]),
            }
        )
    return results


def main(argv: list[str]) -> None:
    # Triton reads TRITON_INTERPRET once, when it is first imported (below, not before).
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        raise SystemExit("tests.sass compiles for real targets: unset TRITON_INTERPRET")
    targets = [int(a) for a in argv] or [80, 90, newest_target()]
    for result in compile_all(targets):
        print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
