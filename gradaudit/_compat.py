"""What Python 3.10 (our floor, ``requires-python``) lacks, imported from one place.

``typing.assert_never`` and ``tomllib`` arrived in 3.11; ``functools.cached_property`` lost its
per-class lock in 3.12 (before, its first read on each object cost ~1 us more: a monitor's
record reads several, every collected step). CI type-checks for 3.10
(``mypy --python-version 3.10``) and imports the package under a 3.10
interpreter, so a new 3.11-only name is caught there rather than by a user.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    from typing import assert_never

    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib
    from typing_extensions import assert_never

if TYPE_CHECKING or sys.version_info >= (3, 12):
    from functools import cached_property
else:  # pragma: no cover - exercised on Python 3.10 and 3.11 only

    class cached_property:  # the name it stands for
        """``functools.cached_property`` as 3.12 has it: computed on the first read, then
        kept in the object's ``__dict__`` (which later reads find first), without a lock."""

        def __init__(self, func: Any) -> None:
            self.func = func
            self.attrname = func.__name__
            self.__doc__ = func.__doc__

        def __set_name__(self, owner: type, name: str) -> None:
            self.attrname = name

        def __get__(self, instance: Any, owner: type | None = None) -> Any:
            if instance is None:
                return self
            value = self.func(instance)
            instance.__dict__[self.attrname] = value
            return value


__all__ = ["assert_never", "cached_property", "tomllib"]
