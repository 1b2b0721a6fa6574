"""``gradaudit trend``: gradient norms over a series of dumps (``builder``).

This ``__init__`` imports nothing: the CLI imports the builder's result types
at start-up, without torch.
"""

from typing import TYPE_CHECKING

from gradaudit import _submodules

if not TYPE_CHECKING:  # ``gradaudit.trend.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
