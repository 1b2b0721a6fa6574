"""What the README's install gives: the optional engines CI relies on are really there.

The other tests run with whatever engines an install has (native needs a C compiler,
Triton a Linux x86-64 wheel) and skip only the tests *of* an engine that is missing.
This one fails instead, so CI cannot pass with the native engine silently absent
(``tests/engine/test_triton_kernel.py`` does the same for Triton).
"""

from __future__ import annotations

from gradaudit.engine import native
from gradaudit.engine.kernels import Engine
from gradaudit.engine.routes import resolve_engine


def test_the_native_extension_is_built() -> None:
    """``pip install`` builds it where a C compiler is (README, .ci/run)."""
    assert native.available()
    assert resolve_engine("auto") is Engine.NATIVE
