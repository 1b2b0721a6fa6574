"""A trainer's logged history judged: NaN/Inf and blow-ups, named with the step."""

from __future__ import annotations

import math
from pathlib import Path

from gradaudit.io.trainer_state import LoggedStep, logged_steps
from gradaudit.policy import FindingKind, Severity, Thresholds
from gradaudit.scan.history import (
    GRAD_NORM_BLOWUP,
    GRAD_NORM_LIMIT_FACTOR,
    LOSS_BLOWUP,
    evaluate_history,
)


def judged(rows: list[LoggedStep], **policy: object) -> dict[str, tuple[FindingKind, str, bool]]:
    found = evaluate_history({"run": rows}, Thresholds(**policy))  # type: ignore[arg-type]
    assert all(f.source == "run" for f in found)
    return {f.tensor: (f.kind, f.message, f.failing) for f in found}


def healthy(steps: int = 40) -> list[LoggedStep]:
    """A loss falling from 10 with noise, gradient norms of 1-50 (a big first step)."""
    rows = []
    for step in range(1, steps + 1):
        loss = 10 * math.exp(-step / 15) + 0.5 + 0.3 * math.sin(step)
        norm = 50.0 if step == 1 else 1 + abs(math.sin(step * 1.7)) * 4
        rows.append(LoggedStep(step, loss, norm))
    return rows


def test_a_healthy_log_has_no_finding() -> None:
    assert judged(healthy()) == {}


def test_the_first_non_finite_step_is_named_with_the_last_finite_value() -> None:
    rows = [*healthy(10), LoggedStep(11, math.nan, math.inf), LoggedStep(12, math.nan, math.nan)]
    found = judged(rows)
    kind, message, failing = found["log_history.loss"]
    assert (kind, failing) == (FindingKind.NAN, True)
    assert "loss nan at step 11 (first of 2 non-finite of 12 logged)" in message
    assert f"last finite {rows[9].loss:.4g} at step 10" in message
    kind, message, _ = found["log_history.grad_norm"]
    assert kind is FindingKind.INF
    assert "grad_norm inf at step 11" in message


def test_a_loss_a_hundredfold_above_the_first_is_a_diverged_run() -> None:
    rows = healthy(10)
    first = rows[0].loss
    assert first is not None
    below = [*rows, LoggedStep(11, first * LOSS_BLOWUP * 0.99)]
    assert judged(below) == {}
    above = [*rows, LoggedStep(11, first * LOSS_BLOWUP * 1.01)]
    kind, message, failing = judged(above)["log_history.loss"]
    assert (kind, failing) == (FindingKind.EXPLODING, True)
    assert "at step 11" in message
    assert "diverged" in message


def test_a_loss_that_can_be_negative_has_no_blowup_rule() -> None:
    rows = [LoggedStep(1, -5.0), LoggedStep(2, 1e6)]
    assert judged(rows) == {}


def test_a_gradient_norm_spike_far_above_the_median() -> None:
    rows = healthy(20)
    spike = [*rows, LoggedStep(21, None, 10 * 5 * GRAD_NORM_BLOWUP)]  # norms are at most 5
    kind, message, _ = judged(spike)["log_history.grad_norm"]
    assert kind is FindingKind.EXPLODING
    assert "at step 21" in message


def test_fail_on_and_ignore_apply_as_to_a_tensor() -> None:
    rows = [*healthy(5), LoggedStep(6, math.nan)]
    assert judged(rows, fail_on=frozenset())["log_history.loss"][2] is False
    found = evaluate_history({"run": rows}, Thresholds(ignore=("log_history.*",)))
    assert [f.severity for f in found] == [Severity.IGNORED]


def test_log_rows_are_read_defensively() -> None:
    rows = logged_steps(
        [
            {"step": 1, "loss": 2.0, "grad_norm": 1.0},
            {"step": 2, "loss": True},  # a bool is not a number
            {"step": "3", "loss": 1.0},  # nor is a text step
            {"step": 4, "loss": 10**400},  # too large for a float: not logged
            {"step": 5, "loss": "nan"},
            "not a row",
            {"step": 6, "eval_loss": 1.0},  # neither number: left out
            {"step": 7, "loss": math.nan},
        ]
    )
    assert [(r.step, r.loss, r.grad_norm) for r in rows[:1]] == [(1, 2.0, 1.0)]
    assert [r.step for r in rows] == [1, 7]
    assert rows[1].loss is not None
    assert math.isnan(rows[1].loss)


def test_a_trainer_state_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """Some editors save JSON with a UTF-8 BOM; it was refused as "not valid JSON"."""
    from gradaudit.io.trainer_state import read_log_history

    path = tmp_path / "trainer_state.json"
    path.write_bytes(b'\xef\xbb\xbf{"log_history": [{"step": 1, "loss": 2.5}]}')
    assert read_log_history(str(path)) == (LoggedStep(1, 2.5, None),)


def test_a_run_logged_above_the_limit_from_its_first_row_diverged() -> None:
    # Learning rate 1e4 (the corpus's diverged Trainer runs): no baseline to rise from.
    rows = [LoggedStep(step, 3e9, 2.7e5 - step * 1e3) for step in (5, 10, 15)]
    kind, message, failing = judged(rows)["log_history.grad_norm"]
    assert (kind, failing) == (FindingKind.EXPLODING, True)
    assert "grad_norm 2.65e+05 at step 5 > 1e+04" in message
    assert "3 of 3 logged steps above it" in message
    # The limit is the exploding threshold scaled: raising one raises the other.
    assert "log_history.grad_norm" not in judged(rows, exploding=1e4)


def test_the_limit_sits_above_healthy_early_spikes() -> None:
    rows = [LoggedStep(1, 10.0, GRAD_NORM_LIMIT_FACTOR * 100 * 0.99), *healthy(10)[1:]]
    assert "log_history.grad_norm" not in judged(rows)
