"""Reports and comparisons the format tests share: small, deterministic, every kind of finding."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from gradaudit import (
    ComparePolicy,
    Comparison,
    Report,
    Thresholds,
    audit,
    compare,
    compare_paths,
    scan_paths,
)
from gradaudit.precision.formats import Precision
from gradaudit.scan.judge import with_headroom
from gradaudit.scan.pending import PendingStats

#: The engine label every sample report carries. Which kernel ran depends on the install
#: (no C compiler: eager instead of native); rendered output must not.
ENGINE = "native"
#: The floating dtypes the native kernel reads (the torch-free path's too).
KERNEL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample_tensors() -> dict[str, torch.Tensor]:
    """Values with few significant bits: every sum of squares is exact in any order, so
    the statistics (and the golden files) are the same whatever kernel or CPU made them."""
    return {
        "encoder.layer.0.attention.self.key.bias": torch.zeros(8),
        "encoder.layer.0.attention.self.query.weight": torch.full((8, 8), 2**-7),
        "encoder.layer.0.output.dense.weight": torch.tensor([[1e3, -2.0], [math.nan, 0.0]]),
        "encoder.layer.1.output.dense.weight": torch.tensor([math.inf, -math.inf, 1.0]),
        "decoder.weight": torch.full((4, 4), 0.5, dtype=torch.bfloat16),
        "decoder.bias": torch.tensor(2.0, dtype=torch.float64),
        "step": torch.tensor(10),
    }


def sample_report(thresholds: Thresholds | None = None) -> Report:
    """Tensors from memory (no files): NaN, ±Inf, exploding, vanishing, healthy, skipped."""
    report = audit(sample_tensors(), thresholds=thresholds or Thresholds())
    return dataclasses.replace(report, elapsed_s=0.25, engine=ENGINE)


def two_file_report(
    directory: Path, thresholds: Thresholds | None = None, *, histograms: bool = False
) -> Report:
    """Two dumps and a corrupt file, scanned by relative name from ``directory``.

    The caller must ``chdir`` into ``directory`` so paths in the report are the
    short relative names (deterministic golden files).
    """
    save_file(
        {
            "model.0.weight": torch.full((4, 4), 0.125),
            "model.0.bias": torch.zeros(4),
            "model.1.weight": torch.tensor([1.0, math.nan, 2.0, 3.0]),
        },
        str(directory / "step1.safetensors"),
        metadata={"gradaudit_content": "gradients"},  # as gradaudit.save_gradients writes
    )
    save_file(
        {
            "model.0.weight": torch.full((4, 4), 50.0),
            "model.0.bias": torch.full((4,), 2**-30),
            "model.1.weight": torch.ones(4),
        },
        str(directory / "step2.safetensors"),
        metadata={"gradaudit_content": "gradients"},
    )
    (directory / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    report = scan_paths(
        ["step1.safetensors", "step2.safetensors", "broken.safetensors"],
        thresholds=thresholds,
        device="cpu",
        histograms=histograms,
    )
    return dataclasses.replace(report, elapsed_s=0.5, engine=ENGINE)


#: A long tensor name, as real models have them: the formats must neither cut nor break it.
LONG_NAME = "model.encoder.layers.11.self_attention.query_key_value.weight"


def headroom_files_report(directory: Path, thresholds: Thresholds | None = None) -> Report:
    """``scan --precision fp16`` of :func:`two_file_report`: ``step2``'s 2**-30 bias
    flushes to zero in fp16 (an ``underflow`` finding, ignored under ``*.bias``)."""
    report = two_file_report(directory, thresholds, histograms=True)
    return with_headroom(report, Precision.FP16)


def headroom_memory_report() -> Report:
    """``scan --precision fp16`` of tensors from memory: an underflow and an overflow in one
    long-named tensor, an all-zero tensor, a healthy one."""
    pending = PendingStats(histograms=True)
    pending.add_all(
        {
            LONG_NAME: torch.tensor([1e-9, 1.0, 1e5, math.inf]),
            "a.b": torch.zeros(3),
            "c": torch.tensor([0.5]),
        }
    )
    report = dataclasses.replace(pending.materialize(), elapsed_s=0.25, engine=ENGINE)
    return with_headroom(report, Precision.FP16)


def sample_comparison() -> Comparison:
    """In memory: NaN on the host (no ratio, under a --max-ratio gate), large changes,
    names only in A or B, a shape and a dtype mismatch, a skipped integer tensor."""
    a = {
        "encoder.layer.0.attention.self.query.weight": torch.full((8, 8), 2**-7),
        "encoder.layer.0.output.dense.weight": torch.full((4, 4), 0.5),
        "encoder.layer.1.output.dense.weight": torch.tensor([1.0, math.nan, 2.0]),
        "decoder.weight": torch.full((4, 4), 0.5, dtype=torch.bfloat16),
        "decoder.bias": torch.ones(4),
        "pooler.weight": torch.ones(2, 3),
        "old.adapter": torch.ones(2),
        "step": torch.tensor(10),
    }
    b = {
        "encoder.layer.0.attention.self.query.weight": torch.full((8, 8), 1.25 * 2**-7),
        "encoder.layer.0.output.dense.weight": torch.full((4, 4), 20.0),
        "encoder.layer.1.output.dense.weight": torch.tensor([1.0, 3.0, 2.0]),
        "decoder.weight": torch.full((4, 4), 0.5),
        "decoder.bias": torch.full((4,), 0.0625),
        "pooler.weight": torch.ones(3, 2),
        "new.adapter": torch.ones(5),
    }
    comparison = compare(a, b, policy=ComparePolicy(max_ratio=100.0))
    report = dataclasses.replace(comparison.report, elapsed_s=0.25, engine=ENGINE)
    return dataclasses.replace(comparison, report=report)


#: The CI policy of :func:`gated_comparison`: a ratio band, a per-side norm limit, ignores.
GATE_THRESHOLDS = Thresholds(max_global_norm=1.0, ignore=("*.k.bias",))
GATE_POLICY = ComparePolicy(min_ratio=0.1, max_ratio=3.0, max_change=4.0, fail_on_change=True)


def gated_comparison(
    directory: Path,
    thresholds: Thresholds = GATE_THRESHOLDS,
    policy: ComparePolicy = GATE_POLICY,
) -> Comparison:
    """One dump split by ``host.``/``seed.``, read by relative name from ``directory``.

    Under the default gate it fails three ways: the normalized ratio (about 5.93)
    is above ``max_ratio``, the seed's norm exceeds ``max_global_norm``, and
    ``mlp.weight`` changes 4.67× under ``--fail-on-change``. The vanishing key
    biases are ignored; ``optimizer.step`` and ``other.weight`` match neither
    prefix and are skipped. The caller must ``chdir`` into ``directory``.
    """
    save_file(
        {
            "host.embed.weight": torch.full((8, 4), 0.0625),
            "host.attn.k.bias": torch.zeros(4),
            "host.mlp.weight": torch.full((4, 4), 0.1875),
            "seed.mlp.weight": torch.full((4, 4), 0.875),
            "seed.adapter.weight": torch.full((2, 4), 0.3125),
            "seed.attn.k.bias": torch.zeros(4),
            "optimizer.step": torch.tensor(3),
            "other.weight": torch.ones(2),
        },
        str(directory / "grafted.safetensors"),
    )
    comparison = compare_paths(
        "grafted.safetensors",
        host_prefix="host.",
        seed_prefix="seed.",
        thresholds=thresholds,
        policy=policy,
        device="cpu",
    )
    return dataclasses.replace(
        comparison, report=dataclasses.replace(comparison.report, elapsed_s=0.5, engine=ENGINE)
    )


def incomplete_comparison(directory: Path) -> Comparison:
    """Host file fine, seed file missing: exit 3. The caller must ``chdir`` into ``directory``."""
    save_file({"w": torch.ones(4), "b": torch.zeros(2)}, str(directory / "host.safetensors"))
    comparison = compare_paths(
        "host.safetensors",
        "missing.safetensors",
        policy=ComparePolicy(min_ratio=0.5),
        device="cpu",
    )
    return dataclasses.replace(
        comparison, report=dataclasses.replace(comparison.report, elapsed_s=0.125, engine=ENGINE)
    )
