"""The GPU check's ``launch-shapes`` probe, through Triton's interpreter: a launch variant
that fails is reported and the others are still measured and checked (a GPU's minutes are
too few to lose a step to one setting)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_probes
from tests.engine.interpreted import DEVICE, MARKS

pytestmark = MARKS


def test_a_failing_launch_variant_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gpu_probes, "LAUNCH_WORKLOADS", (("5000 tiny", torch.bfloat16),))
    monkeypatch.setattr(
        gpu_probes,
        "LAUNCH_VARIANTS",
        {"no such setting": {"NO_SUCH_SETTING": 1}, "3 stages": {"STAGES": 3}},
    )
    probe = gpu_probes.Probe(DEVICE, dry=DEVICE.type == "cpu")
    assert gpu_probes.launch_shapes(probe) == 1
    out = capsys.readouterr().out
    assert "FAIL 5000 tiny bfloat16, no such setting: AttributeError" in out
    (checked,) = [line for line in out.splitlines() if ", 3 stages: " in line]
    assert checked.startswith("ok   5000 tiny bfloat16")
    assert checked.endswith(" 0 wrong")
    row = next(line for line in out.splitlines() if line.startswith("5000 tiny bfloat16 |"))
    cells = row.split(" | ")
    assert cells[3] == "failed"  # workload, MiB, as shipped, then the failed variant
    assert cells[4] != "failed"
    assert "1 variants FAILED" in out.splitlines()[-1]
