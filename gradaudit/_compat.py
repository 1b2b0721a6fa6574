"""What Python 3.10 (our floor, ``requires-python``) lacks, imported from one place.

``typing.assert_never`` and ``tomllib`` arrived in 3.11. CI type-checks for 3.10
(``mypy --python-version 3.10``) and imports the package under a 3.10
interpreter, so a new 3.11-only name is caught there rather than by a user.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from typing import assert_never

    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib
    from typing_extensions import assert_never

__all__ = ["assert_never", "tomllib"]
