"""The engine's user-facing choices, without torch: which kernel, how much working memory.

The CLI declares ``--engine`` and ``--max-memory`` with these before any command
runs, and ``gradaudit --help``, ``--version`` and shell completion must not pay
for ``import torch`` (about 1.2 s of a 2 s start-up, measured). So the choices
live here, and the torch-side modules (:mod:`gradaudit.engine.kernels`,
:mod:`gradaudit.engine.stats`) import them from here.
"""

from __future__ import annotations

from enum import Enum

#: Default working-memory budget (``--max-memory``): scratch buffers plus live buckets.
DEFAULT_MEMORY_BUDGET = 256 * 1024 * 1024


class Engine(str, Enum):
    """Which kernel reduces the data (``--engine``).

    ``auto`` takes the native single-pass kernel for CPU tensors when it was
    built (:mod:`gradaudit.engine.native`), the Triton single-pass kernel for CUDA
    tensors when Triton is installed (:mod:`gradaudit.engine.triton_kernel`), and the
    eager kernel for everything else.
    """

    NATIVE = "native"
    TRITON = "triton"
    EAGER = "eager"
    COMPILED = "compiled"
    AUTO = "auto"
