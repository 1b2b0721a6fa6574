"""Build the optional single-pass CPU kernel (``gradaudit.engine._native``).

Everything else is in ``pyproject.toml``. The extension is plain C with no
torch headers (a second to compile); ``optional=True`` lets the install go on
without a compiler, and gradaudit then falls back to its eager kernel.
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-std=gnu99", "-pthread"]

setup(
    ext_modules=[
        Extension(
            "gradaudit.engine._native",
            sources=["gradaudit/engine/_native.c"],
            extra_compile_args=flags,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        ),
        # SIGBUS on a truncated memory-mapped input becomes an input error (POSIX only).
        *(
            []
            if sys.platform == "win32"
            else [
                Extension(
                    "gradaudit.io._mapguard",
                    sources=["gradaudit/io/_mapguard.c"],
                    extra_compile_args=["-O2", "-std=gnu99"],
                    optional=True,
                )
            ]
        ),
    ]
)
