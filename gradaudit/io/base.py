"""The one interface every reader implements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from gradaudit.results import Skipped

#: What a reader yields: a named tensor to audit, or a tensor it could not hand over.
SourceItem = tuple[str, torch.Tensor] | Skipped


class TensorSource(Protocol):
    """A file (or set of files) that yields named tensors one at a time.

    Readers validate their input before yielding anything and raise
    :class:`gradaudit.errors.InputError` for anything they cannot read, so the
    orchestrator can record the problem and carry on with the next input.
    """

    path: str

    def items(self, device: torch.device) -> Iterator[SourceItem]:
        """Yield tensors on ``device``, one at a time, never all at once."""
        ...
