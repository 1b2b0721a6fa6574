"""The CI policy: nonfinite, ignore patterns, run-level limits, and how they change the verdict."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gradaudit import ExitCode, FindingKind, Severity, Thresholds, audit, exit_code, scan_paths
from gradaudit.policy import LimitKind, PolicyError, fraction_exceeds, parse_fail_on
from gradaudit.results import FileResult, LimitFinding
from gradaudit.scan.judge import evaluate_limits
from tests.conftest import WriteDump


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nonfinite", {FindingKind.NAN, FindingKind.INF}),
        ("nonfinite,exploding", {FindingKind.NAN, FindingKind.INF, FindingKind.EXPLODING}),
        (["nonfinite", "vanishing"], {FindingKind.NAN, FindingKind.INF, FindingKind.VANISHING}),
        (["nan, inf"], {FindingKind.NAN, FindingKind.INF}),
        ("NONFINITE,nan", {FindingKind.NAN, FindingKind.INF}),
    ],
)
def test_fail_on_nonfinite_and_lists(spec: str | list[str], expected: set[FindingKind]) -> None:
    assert parse_fail_on(spec) == expected


def test_fail_on_errors_name_the_setting() -> None:
    with pytest.raises(PolicyError) as error:
        parse_fail_on("nan,nonfinit")
    assert error.value.key == "fail-on"
    assert "'nonfinit'" in str(error.value)
    assert "nonfinite" in str(error.value)


def test_nonfinite_fails_on_nan_and_inf_but_not_exploding() -> None:
    policy = Thresholds(fail_on=parse_fail_on("nonfinite"))
    loud = audit({"w": torch.full((4,), 1e3)}, thresholds=policy)
    assert exit_code(loud) is ExitCode.OK
    assert loud.findings[0].severity is Severity.WARNING
    for bad in (math.nan, math.inf, -math.inf):
        report = audit({"w": torch.tensor([1.0, bad])}, thresholds=policy)
        assert exit_code(report) is ExitCode.FINDINGS


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [
        ("max_global_norm", 0.0, "max-global-norm"),
        ("max_global_norm", -1.0, "max-global-norm"),
        ("max_global_norm", math.nan, "max-global-norm"),
        ("max_vanishing_fraction", 1.5, "max-vanishing-fraction"),
        ("max_vanishing_fraction", -0.1, "max-vanishing-fraction"),
        ("max_vanishing_fraction", math.nan, "max-vanishing-fraction"),
        ("vanishing", -1.0, "vanishing-threshold"),
        ("exploding", 0.0, "exploding-threshold"),
        ("ignore", ("",), "ignore"),
    ],
)
def test_bad_policy_values_name_their_key(field: str, value: object, key: str) -> None:
    with pytest.raises(PolicyError) as error:
        Thresholds(**{field: value})  # type: ignore[arg-type]
    assert error.value.key == key


def test_ignored_tensors_keep_their_stats_and_findings_but_never_fail() -> None:
    grads = {
        "encoder.attn.key.bias": torch.zeros(4),
        "encoder.attn.query.weight": torch.tensor([math.nan, 1.0]),
        "decoder.weight": torch.tensor([math.nan, 1.0]),
    }
    policy = Thresholds(fail_on=frozenset(FindingKind), ignore=("*.key.bias", "encoder.*.query.*"))
    report = audit(grads, thresholds=policy)
    assert exit_code(report) is ExitCode.FINDINGS  # decoder.weight still fails
    by_name = {f.tensor: f for f in report.findings}
    assert by_name["encoder.attn.key.bias"].severity is Severity.IGNORED
    assert by_name["encoder.attn.query.weight"].severity is Severity.IGNORED
    assert by_name["decoder.weight"].severity is Severity.ERROR
    assert len(report.tensors) == 3
    assert report.summary.ignored_findings == 2
    assert report.summary.failing_findings == 1
    assert report.summary.warnings == 0
    assert report.summary.nan_tensors == 1  # flagged counts leave ignored findings out
    assert report.summary.vanishing_tensors == 0
    assert policy.ignored_by("encoder.attn.key.bias") == "*.key.bias"
    assert policy.ignored_by("decoder.weight") is None


def test_ignore_patterns_are_case_sensitive_globs() -> None:
    policy = Thresholds(ignore=("layers.[0-1].*", "Head?weight"))
    assert policy.ignored_by("layers.0.fc.weight") == "layers.[0-1].*"
    assert policy.ignored_by("layers.2.fc.weight") is None
    assert policy.ignored_by("Head.weight") == "Head?weight"
    assert policy.ignored_by("head.weight") is None


def test_everything_ignored_passes() -> None:
    report = audit({"w": torch.tensor([math.nan])}, thresholds=Thresholds(ignore=("*",)))
    assert exit_code(report) is ExitCode.OK
    assert report.summary.ignored_findings == 1


@pytest.mark.parametrize(
    ("count", "total", "limit", "exceeds"),
    [
        (57, 100, 0.57, False),  # 0.57 * 100 == 56.99999999999999 in floating point
        (58, 100, 0.57, True),
        (1, 2, 0.5, False),
        (2, 3, 0.5, True),
        (0, 10, 0.0, False),
        (1, 10, 0.0, True),
        (10, 10, 1.0, False),
        (0, 0, 0.0, False),
        (3, 10, 0.3, False),
        (7, 10, 0.7, False),
    ],
)
def test_fraction_exceeds_is_exact(count: int, total: int, limit: float, exceeds: bool) -> None:
    assert fraction_exceeds(count, total, limit) is exceeds


def _vanishing_model(dead: int, alive: int) -> dict[str, torch.Tensor]:
    grads = {f"dead{i}.weight": torch.zeros(4) for i in range(dead)}
    grads.update({f"alive{i}.weight": torch.ones(4) for i in range(alive)})
    return grads


def test_max_vanishing_fraction_tolerates_a_few_dead_layers() -> None:
    policy = Thresholds(max_vanishing_fraction=0.5)
    few = audit(_vanishing_model(dead=1, alive=3), thresholds=policy)
    assert exit_code(few) is ExitCode.OK
    assert few.findings[0].severity is Severity.WARNING
    half = audit(_vanishing_model(dead=2, alive=2), thresholds=policy)
    assert exit_code(half) is ExitCode.OK  # "more than" half: exactly half passes
    most = audit(_vanishing_model(dead=3, alive=2), thresholds=policy)
    assert exit_code(most) is ExitCode.FINDINGS
    (limit,) = most.limit_findings
    assert limit.kind is LimitKind.VANISHING_FRACTION
    assert limit.value == pytest.approx(0.6)
    assert limit.limit == 0.5
    assert "3 of 5 tensors vanish" in limit.message
    assert most.summary.failing_findings == 1
    assert most.summary.warnings == 3


def test_max_vanishing_fraction_replaces_fail_on_vanishing() -> None:
    policy = Thresholds(fail_on=parse_fail_on("all"), max_vanishing_fraction=0.5)
    report = audit(_vanishing_model(dead=1, alive=3), thresholds=policy)
    assert exit_code(report) is ExitCode.OK
    assert policy.severity(FindingKind.NAN) is Severity.ERROR
    assert policy.severity(FindingKind.VANISHING) is Severity.WARNING


def test_vanishing_fraction_leaves_ignored_tensors_out_of_both_counts() -> None:
    grads = _vanishing_model(dead=3, alive=2)
    policy = Thresholds(max_vanishing_fraction=0.5, ignore=("dead0.*", "dead1.*"))
    report = audit(grads, thresholds=policy)
    # Judged: dead2, alive0, alive1 -> 1 of 3 vanish.
    assert exit_code(report) is ExitCode.OK
    strict = Thresholds(max_vanishing_fraction=0.3, ignore=("dead0.*", "dead1.*"))
    (limit,) = audit(grads, thresholds=strict).limit_findings
    assert "1 of 3 tensors vanish" in limit.message


def test_max_global_norm_counts_ignored_tensors() -> None:
    grads = {"big": torch.tensor([30.0, 40.0]), "small": torch.tensor([0.5])}
    policy = Thresholds(max_global_norm=10.0, ignore=("big",), exploding=1e6)
    report = audit(grads, thresholds=policy)
    (limit,) = report.limit_findings
    assert limit.kind is LimitKind.GLOBAL_NORM
    assert limit.value == pytest.approx(math.sqrt(2500.25))
    assert limit.source is None
    assert exit_code(report) is ExitCode.FINDINGS
    assert exit_code(audit(grads, thresholds=Thresholds(max_global_norm=51.0))) is ExitCode.OK


def test_limit_fails_even_with_fail_on_none() -> None:
    policy = Thresholds(fail_on=frozenset(), max_global_norm=1.0)
    report = audit({"w": torch.full((4,), 10.0)}, thresholds=policy)
    assert exit_code(report) is ExitCode.FINDINGS
    assert report.summary.failing_findings == 1
    assert report.summary.warnings == 0


def test_limits_are_judged_per_file(write_dump: WriteDump) -> None:
    calm = write_dump({"w": torch.full((4,), 1.0), "v": torch.ones(2)}, "calm.safetensors")
    loud = write_dump({"w": torch.full((4,), 30.0), "v": torch.zeros(2)}, "loud.safetensors")
    policy = Thresholds(max_global_norm=50.0, max_vanishing_fraction=0.4)
    report = scan_paths([calm, loud], thresholds=policy, device="cpu")
    assert {(f.kind, f.source) for f in report.limit_findings} == {
        (LimitKind.GLOBAL_NORM, str(loud)),
        (LimitKind.VANISHING_FRACTION, str(loud)),
    }
    # The run-wide norm is above the limit too, but only the loud file is blamed.
    assert report.summary.global_norm > 50.0


def test_limits_skip_files_that_were_not_audited(tmp_path: Path) -> None:
    files = [
        FileResult("broken.safetensors", 0, 0, 0, None, error="truncated"),
        FileResult("ints.safetensors", 0, 1, 0, None),
    ]
    policy = Thresholds(max_global_norm=1.0, max_vanishing_fraction=0.0)
    assert evaluate_limits([], [], files, 0.0, policy) == ()


def test_no_limits_no_limit_findings() -> None:
    report = audit({"w": torch.full((4,), 1e9)})
    assert report.limit_findings == ()


def test_limit_finding_is_always_an_error() -> None:
    finding = LimitFinding(LimitKind.GLOBAL_NORM, 5.0, 1.0, "x")
    assert finding.failing
    assert finding.severity is Severity.ERROR
