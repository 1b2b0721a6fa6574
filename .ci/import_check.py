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

#: Not installed in the floor environment: torch and what needs it, and the optional extras.
HEAVY = {
    "torch",
    "numpy",
    "safetensors",
    "triton",
    "matplotlib",
    "transformers",
    "accelerate",
    "lightning",
    "tensorboard",
    "wandb",
}
#: Modules that must import without torch: what ``import gradaudit.cli`` loads, so
#: ``gradaudit --help``, ``--version`` and shell completion start without torch
#: (tests/cli/test_startup.py checks the same on the CI's Python). A module added to
#: the CLI's start-up path belongs here; one that needs torch belongs in a command.
PURE = {
    "gradaudit",
    "gradaudit._compat",
    "gradaudit.cli",
    "gradaudit.cli.app",
    "gradaudit.cli.coercion",
    "gradaudit.cli.compare",
    "gradaudit.cli.config",
    "gradaudit.cli.options",
    "gradaudit.cli.output",
    "gradaudit.cli.progress",
    "gradaudit.cli.scan",
    "gradaudit.cli.setting_values",
    "gradaudit.cli.streams",
    "gradaudit.cli.style",
    "gradaudit.cli.trend",
    "gradaudit.cli.visuals",
    "gradaudit.comparison",
    "gradaudit.engine",
    "gradaudit.engine.options",
    "gradaudit.errors",
    "gradaudit.grouping",
    "gradaudit.policy",
    "gradaudit.precision",
    "gradaudit.precision.formats",
    "gradaudit.precision.headroom",
    "gradaudit.precision.judging",
    "gradaudit.report",
    "gradaudit.report.base",
    "gradaudit.report.chart",
    "gradaudit.report.console",
    "gradaudit.report.fit",
    "gradaudit.report.output_format",
    "gradaudit.report.plot",
    "gradaudit.report.precision_plot",
    "gradaudit.report.precision_table",
    "gradaudit.report.styles",
    "gradaudit.report.text",
    "gradaudit.results",
    "gradaudit.results.comparison",
    "gradaudit.results.trend",
    "gradaudit.results.verdict",
    "gradaudit.scan",
    "gradaudit.scan.torchrun",
    "gradaudit.trend",
    "gradaudit.training",
}


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
