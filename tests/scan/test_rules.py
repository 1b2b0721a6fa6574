"""Policy: stats -> findings, and the exit-code precedence."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradaudit import ExitCode, FindingKind, Severity, Thresholds, audit, exit_code
from gradaudit.policy import parse_fail_on
from gradaudit.results import InputProblem, TensorStats
from gradaudit.scan.rules import evaluate


def stats(**overrides: object) -> TensorStats:
    base = TensorStats(
        name="w",
        shape=(10,),
        dtype="float32",
        numel=10,
        nan=0,
        pos_inf=0,
        neg_inf=0,
        zeros=0,
        max_abs=1.0,
        norm=1.0,
        rms=0.3,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def kinds(s: TensorStats, thresholds: Thresholds | None = None) -> list[FindingKind]:
    return [f.kind for f in evaluate(s, thresholds or Thresholds())]


def test_healthy_tensor_has_no_findings() -> None:
    assert kinds(stats()) == []


def test_nan_and_signed_inf_are_reported_and_fail_by_default() -> None:
    found = evaluate(stats(nan=2, pos_inf=1, neg_inf=3), Thresholds())
    assert [f.kind for f in found] == [FindingKind.NAN, FindingKind.INF]
    assert all(f.severity is Severity.ERROR for f in found)
    assert "1 +Inf and 3 -Inf" in found[1].message


def test_thresholds_are_strict_and_overridable() -> None:
    assert kinds(stats(norm=100.0)) == []
    assert kinds(stats(norm=100.01)) == [FindingKind.EXPLODING]
    assert kinds(stats(norm=1e-7)) == []
    assert kinds(stats(norm=9.9e-8)) == [FindingKind.VANISHING]
    custom = Thresholds(vanishing=1e-3, exploding=5.0)
    assert kinds(stats(norm=6.0), custom) == [FindingKind.EXPLODING]
    assert kinds(stats(norm=1e-4), custom) == [FindingKind.VANISHING]


def test_vanishing_is_a_warning_unless_asked_to_fail() -> None:
    (finding,) = evaluate(stats(norm=0.0, zeros=10, max_abs=0.0), Thresholds())
    assert finding.kind is FindingKind.VANISHING
    assert finding.severity is Severity.WARNING
    strict = Thresholds(fail_on=frozenset(FindingKind))
    assert evaluate(stats(norm=0.0), strict)[0].severity is Severity.ERROR


def test_no_magnitude_verdict_without_finite_elements() -> None:
    assert kinds(stats(nan=10, norm=0.0, max_abs=0.0, rms=None)) == [FindingKind.NAN]
    assert kinds(stats(numel=0, shape=(0,), norm=0.0, max_abs=0.0, rms=None)) == []


def test_exit_code_precedence() -> None:
    healthy = audit({"w": torch.ones(3)})
    assert exit_code(healthy) is ExitCode.OK
    bad = audit({"w": torch.full((3,), float("nan"))})
    assert exit_code(bad) is ExitCode.FINDINGS
    errored = dataclasses.replace(bad, errors=(InputProblem("x.safetensors", "truncated"),))
    assert exit_code(errored) is ExitCode.INPUT_ERROR
    empty = audit({})
    assert exit_code(empty) is ExitCode.INPUT_ERROR
    lenient = audit(
        {"w": torch.full((3,), float("nan"))},
        thresholds=Thresholds(fail_on=frozenset()),
    )
    assert exit_code(lenient) is ExitCode.OK
    assert lenient.summary.warnings == 1


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nan,inf", {FindingKind.NAN, FindingKind.INF}),
        ("NaN, exploding", {FindingKind.NAN, FindingKind.EXPLODING}),
        ("all", set(FindingKind)),
        ("none", set()),
    ],
)
def test_parse_fail_on(spec: str, expected: set[FindingKind]) -> None:
    assert parse_fail_on(spec) == expected


@pytest.mark.parametrize("spec", ["", "nan,bogus", "none,nan"])
def test_parse_fail_on_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="fail-on"):
        parse_fail_on(spec)


def test_thresholds_validate() -> None:
    with pytest.raises(ValueError, match="below"):
        Thresholds(vanishing=10.0, exploding=1.0)
