"""A role read on thin evidence never fails a file by a role-dependent check alone.

A flat safetensors file without metadata says nothing about what it holds. A published
voice-activity model's STFT basis has a norm of 111: an exploding gradient, or a healthy
convolution. On such a reading, exploding / vanishing / all-zero fail only when the other
reading (weight <-> gradient) fails too; otherwise they warn, say why, and ``--kind`` (or a
dump that says what it holds) gates them. NaN and Inf fail whatever the reading.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from gradaudit import ExitCode
from gradaudit.cli import app
from gradaudit.policy import FindingKind, Role, Severity, Thresholds
from gradaudit.results import TensorStats
from gradaudit.scan.rules import evaluate, thin_reading_holds
from tests.conftest import GRADIENT_DUMP, WriteDump, runner


def scan(path: Path, *args: str) -> object:
    return runner.invoke(
        app, ["scan", str(path), "--no-config", *args], env={"COLUMNS": "200", "NO_COLOR": "1"}
    )


def conv_model() -> dict[str, torch.Tensor]:
    """Trained-looking convolution weights, one of them with a norm above 100."""
    torch.manual_seed(0)
    return {
        "stft_conv.weight": torch.randn(258, 1, 256) * 0.43,  # norm ~111, RMS·sqrt(fan-in) ~7
        "conv1.weight": torch.randn(128, 129, 3) * 0.05,
        "conv1.bias": torch.randn(128) * 0.1,
        "final.weight": torch.randn(1, 128, 1) * 0.8,
    }


def test_a_flat_weight_file_with_a_large_norm_warns_and_passes(write_dump: WriteDump) -> None:
    path = write_dump(conv_model(), "vad.safetensors")
    result = scan(path)
    assert result.exit_code == ExitCode.OK, result.stdout
    assert "OK: no failing findings (1 warning)" in result.stdout
    assert "as gradients (thin evidence)" in result.stdout
    github = scan(path, "--format", "github")
    assert github.exit_code == ExitCode.OK
    warning = next(line for line in github.stdout.splitlines() if "stft_conv" in line)
    assert warning.startswith("::warning ")
    assert warning.endswith("read as a gradient on thin evidence (--kind gradients gates it)")
    assert scan(path, "--kind", "gradients").exit_code == ExitCode.FINDINGS
    assert scan(path, "--kind", "weights").exit_code == ExitCode.OK


def test_a_dump_that_says_it_holds_gradients_gates_on_them(write_dump: WriteDump) -> None:
    path = write_dump(conv_model(), "grads.safetensors", GRADIENT_DUMP)
    result = scan(path)
    assert result.exit_code == ExitCode.FINDINGS
    assert "thin evidence" not in result.stdout


def test_a_gradient_too_large_for_any_weight_fails_on_thin_evidence(
    write_dump: WriteDump,
) -> None:
    # RMS 2e3 in a 64x64 matrix: RMS·sqrt(fan-in 64) = 1.6e4, past any initialisation.
    tensors = {"a.weight": torch.full((64, 64), 2e3), "a.bias": torch.ones(64) * 1e-3}
    path = write_dump(tensors, "blown.safetensors")
    result = scan(path)
    assert result.exit_code == ExitCode.FINDINGS, result.stdout
    assert "exploding" in result.stdout


def test_nan_fails_whatever_the_reading(write_dump: WriteDump) -> None:
    tensors = conv_model()
    tensors["conv1.bias"][3] = math.nan
    result = scan(write_dump(tensors, "nan.safetensors"))
    assert result.exit_code == ExitCode.FINDINGS
    assert "conv1.bias" in result.stdout


def stats(shape: tuple[int, ...], value: float, role: Role, name: str = "x.weight") -> TensorStats:
    numel = math.prod(shape)
    norm = abs(value) * math.sqrt(numel)
    return TensorStats(
        name,
        shape,
        "float32",
        numel,
        0,
        0,
        0,
        numel if value == 0 else 0,
        abs(value),
        norm,
        abs(value),
        "f",
        role,
        "guessed",
        True,
    )


def test_what_holds_under_both_readings() -> None:
    policy = Thresholds()
    # A gradient of norm 200 in a 4x4 matrix: RMS·sqrt(4) = 100, a fine weight: warns.
    assert not thin_reading_holds(FindingKind.EXPLODING, stats((4, 4), 50.0, Role.GRADIENT), policy)
    # RMS 1e4 x sqrt(fan-in 4): a diverged weight as well: fails.
    assert thin_reading_holds(FindingKind.EXPLODING, stats((4, 4), 1e4, Role.GRADIENT), policy)
    # A LayerNorm scale at RMS 500 guessed as a weight, norm above 100 as a gradient: fails.
    scale = stats((32,), 500.0, Role.WEIGHT, "enc.LayerNorm.weight")
    assert thin_reading_holds(FindingKind.EXPLODING, scale, policy)
    # A vanishing gradient is a fine weight (a zero bias); an all-zero matrix is a warning
    # as a weight by default, so vanishing does not fail on a thin reading either...
    assert not thin_reading_holds(FindingKind.VANISHING, stats((4, 4), 0.0, Role.GRADIENT), policy)
    # ...unless all-zero weights fail too.
    strict = Thresholds(fail_on=frozenset({FindingKind.ALL_ZERO, FindingKind.VANISHING}))
    assert thin_reading_holds(FindingKind.VANISHING, stats((4, 4), 0.0, Role.GRADIENT), strict)


def test_evaluate_warns_with_the_reason_and_keeps_errors_on_firm_evidence() -> None:
    policy = Thresholds()
    thin = stats((4, 4), 50.0, Role.GRADIENT)
    (finding,) = evaluate(thin, policy)
    assert finding.kind is FindingKind.EXPLODING
    assert finding.severity is Severity.WARNING
    assert finding.message.endswith("(--kind gradients gates it)")
    firm = dataclasses.replace(thin, role_evidence="--kind gradients", role_thin=False)
    (finding,) = evaluate(firm, policy)
    assert finding.severity is Severity.ERROR


def test_a_weight_file_name_is_firm_evidence(tmp_path: Path) -> None:
    """``pytorch_model.bin`` / ``model.safetensors`` are what ``save_pretrained`` writes for
    weights: read as weights on that evidence, not on a guess (a diverged BERT's
    ``pytorch_model.bin`` was read as gradients on thin evidence before)."""
    torch.manual_seed(0)
    state = {"enc.weight": torch.randn(64, 64) * 0.1, "enc.bias": torch.zeros(64)}
    for name in ("pytorch_model.bin", "model-00001-of-00002.safetensors"):
        path = tmp_path / name
        if name.endswith(".bin"):
            torch.save(state, path)
        else:
            save_file(state, str(path))
        doc = json.loads(scan(path, "--format", "json").stdout)
        (entry,) = doc["files"]
        assert entry["read_as"] == "weights"
        assert entry["read_as_evidence"].startswith(f"file name {name}")
        assert entry["evidence_thin"] is False
    other = tmp_path / "grads.safetensors"
    save_file(state, str(other))
    doc = json.loads(scan(other, "--format", "json").stdout)
    assert doc["files"][0]["evidence_thin"] is True
