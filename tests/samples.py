"""Reports the format tests share: small, deterministic, with every kind of finding."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from gradaudit import Report, Thresholds, audit, scan_paths


def sample_tensors() -> dict[str, torch.Tensor]:
    return {
        "encoder.layer.0.attention.self.key.bias": torch.zeros(8),
        "encoder.layer.0.attention.self.query.weight": torch.full((8, 8), 0.01),
        "encoder.layer.0.output.dense.weight": torch.tensor([[1e3, -2.0], [math.nan, 0.0]]),
        "encoder.layer.1.output.dense.weight": torch.tensor([math.inf, -math.inf, 1.0]),
        "decoder.weight": torch.full((4, 4), 0.5, dtype=torch.bfloat16),
        "decoder.bias": torch.tensor(2.0, dtype=torch.float64),
        "step": torch.tensor(10),
    }


def sample_report(thresholds: Thresholds | None = None) -> Report:
    """Tensors from memory (no files): NaN, ±Inf, exploding, vanishing, healthy, skipped."""
    report = audit(sample_tensors(), thresholds=thresholds or Thresholds())
    return dataclasses.replace(report, elapsed_s=0.25)


def two_file_report(directory: Path, thresholds: Thresholds | None = None) -> Report:
    """Two dumps and a corrupt file, scanned by relative name from ``directory``.

    The caller must ``chdir`` into ``directory`` so paths in the report are the
    short relative names (deterministic golden files).
    """
    save_file(
        {
            "model.0.weight": torch.full((4, 4), 0.1),
            "model.0.bias": torch.zeros(4),
            "model.1.weight": torch.tensor([1.0, math.nan, 2.0, 3.0]),
        },
        str(directory / "step1.safetensors"),
    )
    save_file(
        {
            "model.0.weight": torch.full((4, 4), 50.0),
            "model.0.bias": torch.full((4,), 1e-9),
            "model.1.weight": torch.ones(4),
        },
        str(directory / "step2.safetensors"),
    )
    (directory / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    report = scan_paths(
        ["step1.safetensors", "step2.safetensors", "broken.safetensors"],
        thresholds=thresholds,
        device="cpu",
    )
    return dataclasses.replace(report, elapsed_s=0.5)
