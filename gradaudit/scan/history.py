"""A training run's own logged history, judged: NaN, Inf and blow-ups with the step.

A checkpoint of a run that diverged can be all finite: the weights grew, the loss went to
3e9, and nothing in the tensors is NaN yet. The trainer saw it happen and wrote it down:
``transformers.Trainer`` keeps every logged ``loss`` and (pre-clipping) ``grad_norm`` in
``trainer_state.json``'s ``log_history``. Those rows are evidence a practitioner reads
first, so they are judged like tensors, and a finding names the logged quantity and the
step:

* a non-finite ``loss`` or ``grad_norm`` (the first step it happened at): ``nan`` / ``inf``;
* a loss that rose to more than :data:`LOSS_BLOWUP` times the first one logged
  (training lowers the loss; a hundredfold rise is a run that diverged): ``exploding``;
* a gradient norm more than :data:`GRAD_NORM_BLOWUP` times the run's median: ``exploding``;
* a gradient norm above :data:`GRAD_NORM_LIMIT_FACTOR` times the exploding threshold (1e4 by
  default): ``exploding`` even when every logged row is that large, as in a run that blew
  up before its first log (learning rate 1e4: grad_norm 4e4-3e5 at every logged step, no
  baseline to rise from). The limit is the per-tensor threshold scaled up a hundredfold
  because the logged norm is the whole model's: healthy runs in the corpus log 0.9-1.4.

Healthy runs have loss bumps and gradient-norm spikes of a few times to tens of times
their typical size (the first steps of a transformer's run are often 10-50x the later
norms); the factors sit well above that. Pure Python: rows in, findings out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gradaudit.io.trainer_state import LoggedStep
from gradaudit.policy import FindingKind, Thresholds
from gradaudit.results import HISTORY_NAME, Finding

#: A finite logged loss above this many times the first one marks a diverged run.
LOSS_BLOWUP = 100.0
#: A logged gradient norm above this many times the run's median marks a blow-up.
GRAD_NORM_BLOWUP = 1e4
#: A logged (whole-model) gradient norm above this many times the exploding threshold is a
#: blow-up whatever the rest of the run logged.
GRAD_NORM_LIMIT_FACTOR = 100.0


def _nonfinite(rows: Sequence[LoggedStep], key: str) -> list[tuple[FindingKind, str]]:
    values = [(row.step, getattr(row, key)) for row in rows if getattr(row, key) is not None]
    bad = [(step, value) for step, value in values if not math.isfinite(value)]
    if not bad:
        return []
    step, value = bad[0]
    kind = FindingKind.NAN if math.isnan(value) else FindingKind.INF
    before = [(s, v) for s, v in values if s < step and math.isfinite(v)]
    message = f"the trainer logged {key} {value} at step {step}"
    if len(bad) > 1:
        message += f" (first of {len(bad)} non-finite of {len(values)} logged)"
    if before:
        message += f"; last finite {before[-1][1]:.4g} at step {before[-1][0]}"
    return [(kind, message)]


def _loss_blowup(rows: Sequence[LoggedStep]) -> list[tuple[FindingKind, str]]:
    losses = [(row.step, row.loss) for row in rows if row.loss is not None]
    finite = [(step, loss) for step, loss in losses if math.isfinite(loss)]
    if len(finite) < 2 or finite[0][1] <= 0:
        return []  # a loss that can be negative (a log-likelihood) has no such scale
    first_step, first = finite[0]
    step, peak = max(finite[1:], key=lambda pair: pair[1])
    if peak <= LOSS_BLOWUP * first:
        return []
    return [
        (
            FindingKind.EXPLODING,
            f"the trainer logged loss {peak:.4g} at step {step}, {peak / first:.3g}x the "
            f"first logged ({first:.4g} at step {first_step}): the run diverged",
        )
    ]


def _grad_norm_blowup(rows: Sequence[LoggedStep]) -> list[tuple[FindingKind, str]]:
    norms = [
        (row.step, row.grad_norm)
        for row in rows
        if row.grad_norm is not None and math.isfinite(row.grad_norm)
    ]
    if len(norms) < 3:
        return []
    ordered = sorted(norm for _, norm in norms)
    median = ordered[len(ordered) // 2]
    step, peak = max(norms, key=lambda pair: pair[1])
    if median <= 0 or peak <= GRAD_NORM_BLOWUP * median:
        return []
    return [
        (
            FindingKind.EXPLODING,
            f"the trainer logged grad_norm {peak:.4g} at step {step}, {peak / median:.3g}x "
            f"the run's median ({median:.4g})",
        )
    ]


def _grad_norm_above_limit(
    rows: Sequence[LoggedStep], thresholds: Thresholds
) -> list[tuple[FindingKind, str]]:
    limit = GRAD_NORM_LIMIT_FACTOR * thresholds.exploding
    norms = [
        (row.step, row.grad_norm)
        for row in rows
        if row.grad_norm is not None and math.isfinite(row.grad_norm)
    ]
    above = [(step, norm) for step, norm in norms if norm > limit]
    if not above:
        return []
    step, norm = above[0]
    return [
        (
            FindingKind.EXPLODING,
            f"the trainer logged grad_norm {norm:.4g} at step {step} > {limit:.3g} "
            f"({GRAD_NORM_LIMIT_FACTOR:g}x the exploding threshold; {len(above)} of "
            f"{len(norms)} logged steps above it): the run diverged",
        )
    ]


def evaluate_history(
    histories: Mapping[str, Sequence[LoggedStep]], thresholds: Thresholds
) -> tuple[Finding, ...]:
    """The findings on each source's logged history (``source`` -> its rows, in step order).

    Each finding is named ``log_history.<key>`` and carries the step in its message; its
    severity follows ``--fail-on`` and ``ignore`` like a tensor's.
    """
    out: list[Finding] = []
    for source, rows in histories.items():
        for key, found in (
            ("loss", _nonfinite(rows, "loss") or _loss_blowup(rows)),
            (
                "grad_norm",
                _nonfinite(rows, "grad_norm")
                or _grad_norm_blowup(rows)
                or _grad_norm_above_limit(rows, thresholds),
            ),
        ):
            name = f"{HISTORY_NAME}.{key}"
            for kind, message in found:
                out.append(Finding(kind, thresholds.severity(kind, name), name, message, source))
    return tuple(out)
