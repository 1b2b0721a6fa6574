"""Host vs seed, and A vs B per parameter: two sets of gradients side by side.

``api`` collects both sides into one pending scan and reads them back once,
``model`` holds the frozen result types and ``checks`` the host-side arithmetic
(pure Python). This ``__init__`` imports neither: the CLI imports ``model`` at
start-up, which must not import torch.

The package is ``comparison``, not ``compare``: ``gradaudit.compare`` is the library
function (:func:`gradaudit.comparison.api.compare`), and a subpackage of the same name
would replace it on ``gradaudit`` as soon as one of its modules was imported.
"""

from typing import TYPE_CHECKING

from gradaudit import _submodules

if not TYPE_CHECKING:  # ``gradaudit.comparison.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
