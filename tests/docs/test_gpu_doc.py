"""docs/gpu.md quotes the Triton its compiled-code figures came from: the one CI installs."""

from __future__ import annotations

import re

from benchmarks.gpu_check import PINS
from tests.docs.examples import REPO


def pinned(text: str) -> set[str]:
    return set(re.findall(r"triton==([0-9][0-9.]*[0-9])", text))


def test_the_triton_the_docs_measured_is_the_one_ci_readme_and_gpu_check_install() -> None:
    ci = pinned((REPO / ".ci" / "run").read_text(encoding="utf-8"))
    assert len(ci) == 1
    readme = pinned((REPO / "README.md").read_text(encoding="utf-8"))
    gpu = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    measured = set(re.findall(r"Measured from the compiled code \(Triton ([0-9.]+)[,)]", gpu))
    assert ci == readme == pinned(" ".join(PINS)) == measured
