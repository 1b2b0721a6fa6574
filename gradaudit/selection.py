"""Which tensors a scan looks at: ``--include`` / ``--exclude`` glob patterns on names.

Kept apart from the readers and the CLI so the library (``scan_paths``) and every reader
apply the same rule. Patterns are matched with :func:`fnmatch.fnmatchcase`: ``*`` also
matches dots (``model.*`` covers ``model.encoder.layers.0.weight``), matching is
case-sensitive, and ``[`` starts a character class (``[[]`` matches a literal ``[``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase


@dataclass(frozen=True)
class NameFilter:
    """Keep a name when it matches an ``include`` pattern (or there is none) and no ``exclude``.

    Exclusion wins over inclusion, so ``--include 'model.*' --exclude '*.bias'`` means
    "the model's tensors except the biases".
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __call__(self, name: str) -> bool:
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)

    @property
    def active(self) -> bool:
        """Whether any pattern was given (an inactive filter keeps everything)."""
        return bool(self.include or self.exclude)
