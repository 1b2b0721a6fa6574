"""Import every gradaudit module under the floor Python (3.10) without torch installed.

A module that needs torch (or numpy, safetensors, Triton, matplotlib) cannot be
imported here and is only compiled (``compileall`` in ``floor-check``); every
other module must import, and the modules in ``PURE`` must be among them: they
are the ones a 3.11-only name would break at import time for every user (the
CLI's start-up path imports no torch).
"""

from __future__ import annotations

import importlib
import pathlib
import sys

HEAVY = {"torch", "numpy", "safetensors", "triton", "matplotlib"}
#: Modules that must import without torch (the CLI's start-up path and the pure core).
PURE = {"gradaudit._compat"}


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent / "gradaudit"
    names = ["gradaudit"] + [
        "gradaudit." + ".".join(path.relative_to(root).with_suffix("").parts)
        for path in sorted(root.rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
    ]
    names += [
        "gradaudit." + ".".join(path.parent.relative_to(root).parts)
        for path in sorted(root.rglob("__init__.py"))
        if path.parent != root
    ]
    imported, heavy, broken = [], [], []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] in HEAVY:
                heavy.append(name)
            else:
                broken.append(f"{name}: {error!r}")
        except Exception as error:  # noqa: BLE001 - every failure is reported
            broken.append(f"{name}: {error!r}")
        else:
            imported.append(name)
    missing = sorted(PURE - set(imported))
    print(
        f"Python {sys.version.split()[0]}: {len(imported)} modules imported, "
        f"{len(heavy)} need torch (compiled only)"
    )
    for line in broken:
        print(f"  broken: {line}")
    for name in missing:
        print(f"  must import without torch: {name}")
    return 1 if broken or missing else 0


if __name__ == "__main__":
    sys.exit(main())
