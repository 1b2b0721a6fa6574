"""The engine's user-facing choices, without torch: which kernel, how much working memory.

The CLI declares ``--engine`` and ``--max-memory`` with these before any command
runs, and ``gradaudit --help``, ``--version`` and shell completion must not pay
for ``import torch`` (about 1.2 s of a 2 s start-up, measured). So the choices
live here, and the torch-side modules (:mod:`gradaudit.engine.kernels`,
:mod:`gradaudit.engine.stats`) import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


@dataclass(frozen=True)
class EngineOptions:
    """Where and how the engine reduces tensors: one value instead of four keywords.

    Every library entry point still takes ``device=``, ``chunk_elements=``,
    ``engine=`` and ``memory_budget=``: it turns them into one of these (see
    :func:`choose`), and what it calls takes the value whole. ``options=`` hands
    one on instead of the keywords (the CLI builds it once from its flags).
    """

    #: Where tensors are reduced: ``None`` where each one lives, or ``"auto"``,
    #: ``"cpu"``, ``"cuda[:N]"`` (resolved strictly: ``cuda`` without CUDA is an error).
    device: torch.device | str | None = None
    #: Elements per chunk of a large tensor; ``None`` sizes the chunks from the budget.
    chunk_elements: int | None = None
    engine: Engine | str = Engine.AUTO
    #: Bytes of working memory (``--max-memory``): scratch buffers plus live buckets.
    memory_budget: int = DEFAULT_MEMORY_BUDGET


#: The keywords' defaults of the in-memory entry points (``audit``, ``compare``):
#: tensors are reduced where they live.
IN_MEMORY = EngineOptions()
#: The keywords' defaults of the file entry points (``scan_paths``, ``compare_paths``).
FROM_FILES = EngineOptions(device="auto")


def choose(
    options: EngineOptions | None, keywords: EngineOptions, defaults: EngineOptions
) -> EngineOptions:
    """``options`` if one was passed, else the one the keywords make.

    Both at once would leave one of them silently ignored, so that is an error
    unless the keywords are all at their ``defaults``.
    """
    if options is None:
        return keywords
    if keywords != defaults:
        raise TypeError("pass options= or device=/chunk_elements=/engine=/memory_budget=, not both")
    return options
