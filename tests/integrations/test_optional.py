"""The integrations stay optional: the core never imports a framework or tracker."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gradaudit._compat import tomllib

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = (
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "wandb",
    "tensorboard",
)


def test_core_and_the_dependency_free_modules_import_no_framework() -> None:
    code = (
        "import sys, gradaudit, gradaudit.cli, gradaudit.io.dcp, gradaudit.integrations, "
        "gradaudit.integrations.scalars, gradaudit.integrations.loggers, "
        "gradaudit.integrations.accelerate\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_each_extra_names_what_its_adapter_imports() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]

    def names(extra: str) -> set[str]:
        return {spec.split(">")[0].split("=")[0].split("[")[0].strip() for spec in extras[extra]}

    assert names("transformers") == {"transformers", "accelerate"}
    assert names("lightning") == {"lightning"}
    assert names("tensorboard") == {"tensorboard"}
    assert names("wandb") == {"wandb"}
    source = (ROOT / "gradaudit" / "integrations" / "hf.py").read_text(encoding="utf-8")
    assert "from transformers import" in source
    source = (ROOT / "gradaudit" / "integrations" / "lightning.py").read_text(encoding="utf-8")
    assert "from lightning.pytorch" in source


def test_the_two_framework_callbacks_have_names_of_their_own() -> None:
    """Both were ``GradauditCallback``; the old name stays an alias in each module."""
    for extra in ("transformers", "lightning"):
        pytest.importorskip(extra, reason=f"the {extra} extra is not installed")
    from gradaudit.integrations import hf, lightning

    assert hf.GradauditTrainerCallback.__name__ == "GradauditTrainerCallback"
    assert lightning.GradauditLightningCallback.__name__ == "GradauditLightningCallback"
    assert hf.GradauditCallback is hf.GradauditTrainerCallback
    assert lightning.GradauditCallback is lightning.GradauditLightningCallback
