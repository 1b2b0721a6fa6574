"""Host vs seed, and A vs B per parameter: two sets of gradients side by side.

``api`` collects both sides into one pending scan and reads them back once,
``model`` holds the frozen result types and ``checks`` the host-side arithmetic
(pure Python). This ``__init__`` imports neither: the CLI imports ``model`` at
start-up, which must not import torch.

``gradaudit.compare`` is both this package and the library function
``gradaudit.compare(a, b)`` (:func:`gradaudit.compare.api.compare`). Importing
a submodule binds the package on ``gradaudit`` whatever the public API says, so
the package is made callable: calling it calls the function, and
``import gradaudit.compare`` gives a module.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from gradaudit import _submodules


class _CallablePackage(types.ModuleType):
    """This package, which calls :func:`gradaudit.compare.api.compare` when called."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from gradaudit.compare.api import compare

        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

if not TYPE_CHECKING:  # ``gradaudit.compare.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
