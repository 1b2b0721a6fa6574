"""What every Triton test module imports first: the kernels run through Triton's
interpreter on CPU tensors where there is no GPU (``TRITON_INTERPRET=1``, set before a
kernel is first built: ``triton.jit`` reads it then), and for real on a GPU
(``benchmarks/gpu_check.py``'s ``tests-kernel`` step)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gradaudit.engine import triton_kernel

#: Where the tensors of those tests live.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: Slow (not in the quick loop: the kernels through the interpreter), and skipped where
#: Triton is not installed.
MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(not triton_kernel.installed(), reason="Triton is not installed"),
]
