"""Host side, pure Python: per-parameter A vs B, comparison findings, exit code.

The comparison counterpart of ``scan/judge.py``: plain numbers and a policy in,
results out; no torch, no files, no terminal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from gradaudit.policy import Severity
from gradaudit.results.change_table import ChangeTable
from gradaudit.results.comparison import (
    CompareFinding,
    CompareFindingKind,
    ComparePolicy,
    DualGradientStats,
    Mismatch,
    ParameterComparison,
)
from gradaudit.results.replicas import first_divergence
from gradaudit.results.stats_table import StatsTable, same_shapes


def compare_tensors(
    table: StatsTable,
    a: tuple[list[str], np.ndarray],
    b: tuple[list[str], np.ndarray],
    max_change: float,
) -> ParameterComparison | None:
    """A vs B for the names both sides hold, or ``None`` when they share no name.

    ``a`` and ``b`` are each side's names (prefixes already removed, each once) and
    the positions of its tensors in ``table``. Names are matched exactly; shapes are
    compared, never broadcast against each other. The changes are columns
    (:class:`ChangeTable`): nothing is built per shared name but its index.
    """
    keys_a, rows_a = a
    keys_b, rows_b = b
    where_b = dict(zip(keys_b, rows_b.tolist(), strict=True))
    in_b = [key in where_b for key in keys_a]
    shared = list(itertools.compress(keys_a, in_b))
    if not shared:
        return None
    pair_a = rows_a[np.fromiter(in_b, dtype=bool, count=len(keys_a))]
    pair_b = np.fromiter(map(where_b.__getitem__, shared), dtype=np.int64, count=len(shared))
    del where_b
    same_shape = same_shapes(table.dims, table.starts, pair_a, pair_b)
    same_dtype = table.dtype_codes[pair_a] == table.dtype_codes[pair_b]
    dtypes = table.dtypes

    def shape(i: int) -> tuple[int, ...]:
        return tuple(table.dims[table.starts[i] : table.starts[i + 1]].tolist())

    mismatches = tuple(
        Mismatch(
            shared[k],
            shape(i),
            shape(j),
            dtypes[table.dtype_codes[i]],
            dtypes[table.dtype_codes[j]],
        )
        for k in np.flatnonzero(~(same_shape & same_dtype)).tolist()
        for i, j in ((int(pair_a[k]), int(pair_b[k])),)
    )
    compared = np.flatnonzero(same_shape)
    divergence = first_divergence(
        shared, np.stack([_digests(table, pair_a, same_shape), _digests(table, pair_b, None)])
    )
    # Every name of B shared (two dumps of one model): no set of A's names is needed.
    in_a = set(shared) if len(shared) < len(keys_b) else None
    return ParameterComparison(
        max_change=max_change,
        changes=ChangeTable.between(
            table,
            [shared[k] for k in compared.tolist()] if len(compared) < len(shared) else shared,
            (pair_a[compared], pair_b[compared]),
            max_change,
        ),
        only_in_a=tuple(itertools.compress(keys_a, (not found for found in in_b))),
        only_in_b=() if in_a is None else tuple(key for key in keys_b if key not in in_a),
        mismatches=mismatches,
        first_difference=None if divergence is None else divergence.tensor,
        differing=0 if divergence is None else len(divergence.tensors),
    )


def _digests(table: StatsTable, rows: np.ndarray, same_shape: np.ndarray | None) -> np.ndarray:
    """Each tensor's digest as two ranks' dumps are compared: its exact stats (counts, peak,
    norm) and dtype, and on A's side whether B's shape equals it (B's side holds 1)."""
    shape = np.ones(len(rows)) if same_shape is None else same_shape.astype(np.float64)
    columns = (table.nan, table.pos_inf, table.neg_inf, table.zeros, table.dtype_codes)
    return np.column_stack(
        [
            *(column[rows].astype(np.float64) for column in columns),
            table.max_abs[rows],
            table.norm[rows],
            shape,
        ]
    )


def comparison_findings(
    dual: DualGradientStats, parameters: ParameterComparison | None, policy: ComparePolicy
) -> tuple[CompareFinding, ...]:
    return tuple(_ratio_findings(dual, policy)) + tuple(_parameter_findings(parameters, policy))


def _ratio_findings(dual: DualGradientStats, policy: ComparePolicy) -> Iterator[CompareFinding]:
    warn, error = Severity.WARNING, Severity.ERROR
    note = dual.ratio_note
    empty = not dual.host_params or not dual.seed_params
    nonfinite = bool(dual.host.nonfinite or dual.seed.nonfinite)
    if not empty and not nonfinite:
        if dual.host_norm == 0.0 and dual.seed_norm == 0.0:
            yield CompareFinding(
                CompareFindingKind.ZERO_NORMS, warn, "both gradient norms are 0: ratio undefined"
            )
        elif dual.host_norm == 0.0:
            yield CompareFinding(
                CompareFindingKind.ZERO_HOST_NORM,
                warn,
                "the host gradient norm is 0: the ratio is infinite",
            )
        elif dual.seed_norm == 0.0:
            yield CompareFinding(
                CompareFindingKind.ZERO_SEED_NORM,
                warn,
                "the seed gradient norm is 0: the seed receives no gradient",
            )
    ratio = dual.normalized_ratio
    if ratio is None:
        if nonfinite or policy.gated:
            message = f"normalized ratio not computed: {note}"
            if policy.gated:
                message += "; --min-ratio/--max-ratio cannot be checked"
            severity = error if policy.gated else warn
            yield CompareFinding(CompareFindingKind.RATIO_NOT_COMPUTED, severity, message)
        return
    if policy.min_ratio is not None and ratio < policy.min_ratio:
        yield CompareFinding(
            CompareFindingKind.RATIO_BELOW_MIN,
            error,
            f"normalized ratio {ratio:.4g} < --min-ratio {policy.min_ratio:g}",
        )
    if policy.max_ratio is not None and ratio > policy.max_ratio:
        yield CompareFinding(
            CompareFindingKind.RATIO_ABOVE_MAX,
            error,
            f"normalized ratio {ratio:.4g} > --max-ratio {policy.max_ratio:g}",
        )


def _parameter_findings(
    parameters: ParameterComparison | None, policy: ComparePolicy
) -> Iterator[CompareFinding]:
    if parameters is None:
        return
    flagged = len(parameters.flagged)
    if flagged:
        k = parameters.max_change
        yield CompareFinding(
            CompareFindingKind.LARGE_CHANGE,
            Severity.ERROR if policy.fail_on_change else Severity.WARNING,
            f"{flagged} shared {'tensor' if flagged == 1 else 'tensors'} changed by more than "
            f"{k:g}× (norm ratio B/A outside [1/{k:g}, {k:g}])",
        )
    # A dtype difference alone is compared all the same (a norm does not depend on the
    # storage dtype), so only names whose shapes differ, which are not compared, warn.
    if count := sum(1 for m in parameters.mismatches if m.shape_differs):
        yield CompareFinding(
            CompareFindingKind.MISMATCH,
            Severity.WARNING,
            f"{count} shared {'name differs' if count == 1 else 'names differ'} in shape "
            "(not compared)",
        )
