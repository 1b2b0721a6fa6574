"""first_divergence: the one judge of per-rank digests, bit for bit."""

from __future__ import annotations

import numpy as np

from gradaudit.results.replicas import ReplicaCheck, first_divergence

NAMES = ["a", "b", "c"]


def digests(world: int) -> np.ndarray:
    """``[world, 3, 7]`` float64 rows, the same on every rank."""
    row = np.arange(21, dtype=np.float64).reshape(3, 7) / 3.0
    return np.repeat(row[None], world, axis=0)


def test_identical_digests_agree() -> None:
    assert first_divergence(NAMES, digests(4)) is None
    assert ReplicaCheck(4, 3).agree


def test_the_first_differing_tensor_and_the_minority_ranks() -> None:
    rows = digests(4)
    rows[2, 2, 6] = np.nextafter(rows[2, 2, 6], np.inf)  # one ulp of c's sum of squares
    rows[2, 1, 4] += 1.0  # b's peak on rank 2
    rows[3, 1, 4] += 1.0  # ... and on rank 3: a 2-2 tie, rank 0's side is the reference
    found = first_divergence(NAMES, rows)
    assert found is not None
    assert (found.tensor, found.ranks, found.reference, found.tensors) == (
        "b",
        (2, 3),
        (0, 1),
        ("b", "c"),
    )
    assert found.describe() == (
        "replicated gradient b differs on ranks 2, 3 from ranks 0, 1 (and 1 more tensor)"
    )


def test_the_majority_is_the_reference_even_against_rank_0() -> None:
    rows = digests(3)
    rows[0, 0, 0] = 5.0
    found = first_divergence(NAMES, rows)
    assert found is not None
    assert (found.ranks, found.reference) == ((0,), (1, 2))


def test_bits_not_values_are_compared() -> None:
    rows = digests(2)
    rows[1, 0, 3] = -0.0  # equal to 0.0 as a value, not as bits
    rows[0, 0, 3] = 0.0
    found = first_divergence(NAMES, rows)
    assert found is not None
    assert found.tensor == "a"
    same_nan = digests(2)
    same_nan[:, 2, 5] = np.nan  # the same NaN on both ranks: the same bits
    assert first_divergence(NAMES, same_nan) is None
