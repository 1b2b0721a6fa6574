"""The comparison library: the formula against float64 by hand, every edge case, A vs B."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaudit
from gradaudit import (
    CompareFindingKind,
    ComparePolicy,
    ExitCode,
    FindingKind,
    InputError,
    Severity,
    Thresholds,
    compare,
    comparison_exit_code,
    dual_stats,
)
from gradaudit.policy import PolicyError
from gradaudit.results.comparison import scaled_ratio
from tests.grafted import grads, grafted_model


def kinds(comparison: gradaudit.Comparison) -> dict[CompareFindingKind, Severity]:
    return {f.kind: f.severity for f in comparison.findings}


# --- the formula -------------------------------------------------------------------------


def test_normalized_ratio_against_a_hand_computed_float64_value() -> None:
    # host: 4 elements of 1 -> norm 2; seed: [3, 4] -> norm 5.
    # raw = 5 / 2 = 2.5; normalized = 2.5 * sqrt(4 / 2) = 2.5 * 1.4142135623730951.
    dual = dual_stats({"h": torch.ones(2, 2)}, {"s": torch.tensor([3.0, 4.0])})
    assert (dual.host_norm, dual.seed_norm) == (2.0, 5.0)
    assert (dual.host_params, dual.seed_params) == (4, 2)
    assert dual.raw_ratio == 2.5
    assert dual.normalized_ratio == pytest.approx(3.5355339059327378, rel=1e-15)
    assert dual.ratio_note is None
    # It is the ratio of the RMS gradient elements: (5 / sqrt 2) / (2 / sqrt 4).
    assert dual.normalized_ratio == pytest.approx(
        dual.seed.norm_per_sqrt_param / dual.host.norm_per_sqrt_param, rel=1e-15
    )


def test_real_gradients_against_an_independent_float64_reference() -> None:
    model = grafted_model()
    host, seed = grads(model.host), grads(model.seed)

    def fsum_norm(tensors: dict[str, torch.Tensor]) -> tuple[float, int]:
        values = [v for t in tensors.values() for v in t.double().reshape(-1).tolist()]
        return math.sqrt(math.fsum(v * v for v in values)), len(values)

    host_norm, host_params = fsum_norm(host)
    seed_norm, seed_params = fsum_norm(seed)
    expected = (seed_norm / host_norm) * math.sqrt(host_params / seed_params)
    dual = dual_stats(host, seed)
    assert (dual.host_params, dual.seed_params) == (host_params, seed_params)
    assert dual.host_norm == pytest.approx(host_norm, rel=1e-12)
    assert dual.seed_norm == pytest.approx(seed_norm, rel=1e-12)
    assert dual.raw_ratio == pytest.approx(seed_norm / host_norm, rel=1e-12)
    assert dual.normalized_ratio == pytest.approx(expected, rel=1e-12)


@settings(derandomize=True, deadline=None, max_examples=60)
@given(
    host=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=40),
    seed=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=40),
    copies=st.integers(2, 5),
    scale=st.sampled_from([0.25, 3.0, 1024.0]),
)
def test_normalized_ratio_invariants(
    host: list[float], seed: list[float], copies: int, scale: float
) -> None:
    """Size does not matter, intensity does: k copies of the host leave the normalized
    ratio unchanged (norm x sqrt k, params x k), and scaling the seed scales it."""
    h = torch.tensor(host, dtype=torch.float64)
    s = torch.tensor(seed, dtype=torch.float64)
    if not h.abs().sum() or not s.abs().sum():
        return
    base = dual_stats({"h": h}, {"s": s}).normalized_ratio
    assert base is not None
    tiled = dual_stats({f"h{i}": h for i in range(copies)}, {"s": s}).normalized_ratio
    scaled = dual_stats({"h": h}, {"s": s * scale}).normalized_ratio
    assert tiled == pytest.approx(base, rel=1e-12)
    assert scaled == pytest.approx(base * scale, rel=1e-12)


def test_scaled_ratio_never_overflows_in_between() -> None:
    assert scaled_ratio(3.0, 2.0) == 1.5
    assert scaled_ratio(1.5e308, 0.5, 0.1) == pytest.approx(3e307, rel=1e-15)  # 3e308 overflows
    assert scaled_ratio(1e300, 1e-300) == math.inf  # the true value is beyond float64
    assert scaled_ratio(1e-300, 1e300) == 0.0


def test_overflow_safe_ratio_of_float64_norms() -> None:
    # seed norm = 10 * 1.5e307 = 1.5e308; raw ratio 3e308 exceeds float64, the
    # normalized one (x sqrt(1/100)) does not and must come out finite.
    host = {"h": torch.tensor([0.5], dtype=torch.float64)}
    seed = {"s": torch.full((100,), 1.5e307, dtype=torch.float64)}
    dual = dual_stats(host, seed)
    assert dual.seed_norm == pytest.approx(1.5e308, rel=1e-12)
    assert dual.raw_ratio == math.inf
    assert dual.normalized_ratio == pytest.approx(3e307, rel=1e-12)


# --- inputs ------------------------------------------------------------------------------


def test_every_input_form_gives_the_same_result() -> None:
    model = grafted_model()
    model.host.head.bias.grad = None  # a parameter without gradient is left out
    host = grads(model.host)
    seed = grads(model.seed)
    from_modules = dual_stats(model.host, model.seed)
    from_mapping = dual_stats(host, seed)
    from_pairs = dual_stats(list(host.items()), iter(seed.items()))
    assert from_modules == from_mapping == from_pairs
    assert from_mapping.host.tensors == len(host) == 34


def test_both_sides_are_read_back_in_one_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The module whose read_blocks is the one host read of a PendingStats.
    engine = importlib.import_module("gradaudit.scan.readback")
    calls: list[int] = []
    real = engine.read_blocks

    def counting(blocks: list[torch.Tensor], *settled: object) -> list[torch.Tensor]:
        calls.append(sum(block.shape[0] for block in blocks))
        return real(blocks, *settled)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "read_blocks", counting)
    model = grafted_model()
    compare(model.host, model.seed)
    assert calls == [35 + 4]


def test_a_module_without_gradients_is_an_input_error() -> None:
    model = grafted_model()
    model.seed.zero_grad(set_to_none=True)
    with pytest.raises(InputError, match="seed side has no floating-point gradient") as info:
        dual_stats(model.host, model.seed)
    assert info.value.exit_code is ExitCode.INPUT_ERROR


@pytest.mark.parametrize(
    "empty",
    [{}, {"ids": torch.arange(3)}, {"w": torch.empty(0)}],
    ids=["nothing", "integers-only", "zero-elements"],
)
def test_an_empty_side_is_an_input_error(empty: dict[str, torch.Tensor]) -> None:
    with pytest.raises(InputError, match="host side"):
        compare(empty, {"s": torch.ones(3)})


def test_duplicate_names_on_one_side_are_an_input_error() -> None:
    with pytest.raises(InputError, match="names 'w' twice"):
        compare([("w", torch.ones(2)), ("w", torch.ones(2))], {"w": torch.ones(2)})


# --- edge cases of the ratio --------------------------------------------------------------


def test_zero_host_norm_gives_an_infinite_ratio_and_a_warning() -> None:
    c = compare({"h": torch.zeros(4)}, {"s": torch.ones(2)})
    assert c.dual.raw_ratio == math.inf
    assert c.dual.normalized_ratio == math.inf
    assert kinds(c) == {CompareFindingKind.ZERO_HOST_NORM: Severity.WARNING}
    assert comparison_exit_code(c) is ExitCode.OK


def test_zero_seed_norm_gives_ratio_0_and_a_warning() -> None:
    c = compare({"h": torch.ones(4)}, {"s": torch.zeros(2)})
    assert c.dual.raw_ratio == 0.0
    assert c.dual.normalized_ratio == 0.0
    assert kinds(c) == {CompareFindingKind.ZERO_SEED_NORM: Severity.WARNING}
    assert "receives no gradient" in (c.dual.ratio_note or "")


def test_both_norms_zero_leave_the_ratio_undefined() -> None:
    c = compare({"h": torch.zeros(4)}, {"s": torch.zeros(2)})
    assert c.dual.raw_ratio is None
    assert c.dual.normalized_ratio is None
    assert kinds(c) == {CompareFindingKind.ZERO_NORMS: Severity.WARNING}


@pytest.mark.parametrize(("side", "value"), [("host", math.nan), ("seed", -math.inf)])
def test_nan_or_inf_on_a_side_means_no_ratio_and_a_named_finding(side: str, value: float) -> None:
    bad = torch.tensor([1.0, value, 2.0])
    host = {"h.ok": torch.ones(3), "h.bad": bad} if side == "host" else {"h.ok": torch.ones(3)}
    seed = {"s.ok": torch.ones(3), "s.bad": bad} if side == "seed" else {"s.ok": torch.ones(3)}
    c = compare(host, seed)
    assert c.dual.raw_ratio is None
    assert c.dual.normalized_ratio is None
    assert f"NaN/Inf on the {side} side" in (c.dual.ratio_note or "")
    assert kinds(c) == {CompareFindingKind.RATIO_NOT_COMPUTED: Severity.WARNING}
    (finding,) = c.tensor_findings
    assert finding.source == side
    assert finding.tensor == ("h.bad" if side == "host" else "s.bad")
    assert finding.kind is (FindingKind.NAN if math.isnan(value) else FindingKind.INF)
    assert comparison_exit_code(c) is ExitCode.FINDINGS  # NaN and Inf fail by default
    side_stats = c.dual.host if side == "host" else c.dual.seed
    assert side_stats.nonfinite == 1
    assert side_stats.norm == pytest.approx(math.sqrt(3.0 + 5.0))  # finite elements only


# --- gating ------------------------------------------------------------------------------


def test_ratio_bounds_fail_the_run() -> None:
    host, seed = {"h": torch.ones(4)}, {"s": torch.tensor([3.0, 4.0])}  # normalized 3.54
    inside = compare(host, seed, policy=ComparePolicy(min_ratio=1.0, max_ratio=4.0))
    assert comparison_exit_code(inside) is ExitCode.OK
    below = compare(host, seed, policy=ComparePolicy(min_ratio=5.0))
    assert kinds(below) == {CompareFindingKind.RATIO_BELOW_MIN: Severity.ERROR}
    assert comparison_exit_code(below) is ExitCode.FINDINGS
    above = compare(host, seed, policy=ComparePolicy(max_ratio=3.5))
    assert kinds(above) == {CompareFindingKind.RATIO_ABOVE_MAX: Severity.ERROR}
    assert "3.536 > --max-ratio 3.5" in above.findings[0].message


def test_a_gate_that_cannot_be_checked_fails() -> None:
    c = compare(
        {"h": torch.tensor([math.nan, 1.0])},
        {"s": torch.ones(2)},
        thresholds=Thresholds(fail_on=frozenset()),
        policy=ComparePolicy(min_ratio=0.1),
    )
    assert kinds(c) == {CompareFindingKind.RATIO_NOT_COMPUTED: Severity.ERROR}
    assert "cannot be checked" in c.findings[0].message
    assert comparison_exit_code(c) is ExitCode.FINDINGS


def test_an_infinite_ratio_fails_max_ratio_and_a_zero_one_fails_min_ratio() -> None:
    inf = compare({"h": torch.zeros(2)}, {"s": torch.ones(2)}, policy=ComparePolicy(max_ratio=10))
    assert CompareFindingKind.RATIO_ABOVE_MAX in kinds(inf)
    zero = compare({"h": torch.ones(2)}, {"s": torch.zeros(2)}, policy=ComparePolicy(min_ratio=0.1))
    assert CompareFindingKind.RATIO_BELOW_MIN in kinds(zero)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_ratio": -1.0}, "min-ratio: must be >= 0 (got -1.0)"),
        ({"max_ratio": 0.0}, "max-ratio: must be > 0 (got 0.0)"),
        ({"min_ratio": 2.0, "max_ratio": 1.0}, "min-ratio: must not exceed max-ratio (2 > 1)"),
        ({"max_change": 0.5}, "max-change: must be >= 1, the band is [1/k, k] (got 0.5)"),
        ({"max_change": math.nan}, "max-change: must be >= 1"),
        ({"min_ratio": math.nan}, "min-ratio: must be >= 0 (got nan)"),
    ],
)
def test_policy_refuses_bad_values(kwargs: dict[str, float], message: str) -> None:
    # PolicyError is a ValueError naming the setting, like Thresholds' errors.
    with pytest.raises(PolicyError) as error:
        ComparePolicy(**kwargs)  # type: ignore[arg-type]
    assert isinstance(error.value, ValueError)
    assert str(error.value).startswith(message)


# --- A vs B per parameter -----------------------------------------------------------------


def test_per_parameter_comparison_flags_lists_and_never_broadcasts() -> None:
    a = {
        "same": torch.full((4,), 1.0),
        "louder": torch.full((4,), 1.0),
        "edge": torch.full((4,), 1.0),
        "quieter": torch.full((4,), 1.0),
        "from_zero": torch.zeros(4),
        "zeros": torch.zeros(4),
        "nan": torch.tensor([math.nan, 1.0]),
        "shape": torch.ones(2, 3),
        "dtype": torch.ones(4),
        "gone": torch.ones(1),
        "ids": torch.arange(3),
    }
    b = {
        "same": torch.full((4,), 1.0),
        "louder": torch.full((4,), 20.0),
        "edge": torch.full((4,), 10.0),
        "quieter": torch.full((4,), 0.05),
        "from_zero": torch.ones(4),
        "zeros": torch.zeros(4),
        "nan": torch.tensor([2.0, 1.0]),
        "shape": torch.ones(3, 2),
        "dtype": torch.ones(4, dtype=torch.bfloat16),
        "new": torch.ones(1),
        "ids": torch.arange(3),
    }
    c = compare(a, b, thresholds=Thresholds(fail_on=frozenset()))
    p = c.parameters
    assert p is not None
    by_name = {change.name: change for change in p.changes}
    assert by_name["same"].ratio == 1.0
    assert by_name["same"].relative_change == 0.0
    assert not by_name["same"].flagged
    assert by_name["louder"].ratio == 20.0
    assert by_name["louder"].relative_change == 19.0
    assert by_name["louder"].flagged
    assert not by_name["edge"].flagged  # the band [1/k, k] is closed
    assert by_name["quieter"].ratio == pytest.approx(0.05)
    assert by_name["quieter"].flagged
    assert by_name["from_zero"].ratio == math.inf
    assert by_name["from_zero"].flagged
    assert by_name["zeros"].ratio is None
    assert by_name["zeros"].note == "both norms are 0"
    assert by_name["nan"].ratio is None
    assert by_name["nan"].note == "NaN/Inf in A"
    assert not by_name["nan"].flagged
    assert "shape" not in by_name  # different shapes are never compared
    assert by_name["dtype"].ratio == 1.0  # a norm does not depend on the storage dtype
    assert [(m.name, m.shape_differs, m.dtype_differs) for m in p.mismatches] == [
        ("shape", True, False),
        ("dtype", False, True),
    ]
    assert p.only_in_a == ("gone",)
    assert p.only_in_b == ("new",)
    assert {f.name for f in p.flagged} == {"louder", "quieter", "from_zero"}
    assert kinds(c) == {
        CompareFindingKind.LARGE_CHANGE: Severity.WARNING,
        CompareFindingKind.MISMATCH: Severity.WARNING,
        CompareFindingKind.RATIO_NOT_COMPUTED: Severity.WARNING,
    }
    assert comparison_exit_code(c) is ExitCode.OK


def test_max_change_and_fail_on_change() -> None:
    a, b = {"w": torch.ones(4)}, {"w": torch.full((4,), 3.0)}
    assert not compare(a, b).parameters.flagged  # type: ignore[union-attr]
    strict = compare(a, b, policy=ComparePolicy(max_change=2.0))
    assert kinds(strict) == {CompareFindingKind.LARGE_CHANGE: Severity.WARNING}
    assert comparison_exit_code(strict) is ExitCode.OK
    failing = compare(a, b, policy=ComparePolicy(max_change=2.0, fail_on_change=True))
    assert kinds(failing) == {CompareFindingKind.LARGE_CHANGE: Severity.ERROR}
    assert comparison_exit_code(failing) is ExitCode.FINDINGS


def test_no_shared_names_means_no_per_parameter_comparison() -> None:
    model = grafted_model()
    assert compare(model.host, model.seed).parameters is None


def test_two_steps_of_the_same_model() -> None:
    before, after = grafted_model(steps=1), grafted_model(steps=3)
    c = compare(before, after)
    assert c.parameters is not None
    assert len(c.parameters.changes) == 39
    assert not c.parameters.only_in_a
    assert not c.parameters.only_in_b
    assert c.dual.host_params == c.dual.seed_params
    assert c.dual.normalized_ratio == pytest.approx(c.dual.raw_ratio, rel=1e-15)
