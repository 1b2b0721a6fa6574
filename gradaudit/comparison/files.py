"""The comparison of two sides, whatever collected them: read, routed, judged.

Both sides are collected into ONE :class:`~gradaudit.scan.collected.Collected`, each
tensor labelled with its side (``"host"`` / ``"seed"``) as its ``source``, and
materialised once: a single host read for both sides together. The per-source merge that
a scan does per file (the overflow-safe ``merge_rows``) then gives each side's global
norm; :mod:`gradaudit.comparison.checks` the per-parameter table and the findings.

The collection is the torch path's :class:`~gradaudit.scan.pending.PendingStats`
(:func:`gradaudit.comparison.api.compare_paths`, in-memory ``compare``) or the torch-free
:class:`~gradaudit.scan.torch_free.NativeScan` (:func:`compare_paths_torch_free`): this
module imports no torch, so both paths share every line after the reading.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradaudit.comparison.checks import compare_tensors, comparison_findings
from gradaudit.errors import InputError, UsageError
from gradaudit.io.discover import FileInput
from gradaudit.policy import FindingKind, Role, Thresholds
from gradaudit.results import InputProblem, Report, Skipped
from gradaudit.results.comparison import (
    HOST,
    SEED,
    ComparePolicy,
    Comparison,
    DualGradientStats,
    SideStats,
)
from gradaudit.results.stats_table import ROLES, StatsTable
from gradaudit.scan import torch_free
from gradaudit.scan.collected import Collected
from gradaudit.scan.finding_table import flagged_indices


@dataclass(frozen=True)
class Side:
    """One side of a comparison: its label, and its file and name prefix when read from one."""

    label: str
    path: str | None = None
    prefix: str | None = None

    def key(self, name: str) -> str:
        """The name the per-parameter comparison matches on: without the side's prefix."""
        return name[len(self.prefix) :] if self.prefix else name


def compare_files(
    collected: Collected,
    host_path: str | Path,
    seed_path: str | Path | None = None,
    *,
    host_prefix: str | None = None,
    seed_prefix: str | None = None,
    thresholds: Thresholds | None = None,
    policy: ComparePolicy | None = None,
) -> Comparison:
    """Compare two dumps, or the two prefixes of one dump, read into ``collected`` (see
    :func:`gradaudit.comparison.api.compare_paths`, which documents the arguments)."""
    if seed_path is None:
        if host_prefix is None or seed_prefix is None:
            raise UsageError("comparing within one file needs both --host-prefix and --seed-prefix")
        if host_prefix == seed_prefix:
            raise UsageError("--host-prefix and --seed-prefix must differ")
    host = Side(HOST, str(host_path), host_prefix)
    seed = Side(SEED, str(host_path if seed_path is None else seed_path), seed_prefix)
    errors: list[InputProblem] = []
    collected.add_file(HOST)
    collected.add_file(SEED)
    if seed_path is None:
        _read(collected, (host, seed), errors)
    else:
        _read(collected, (host,), errors)
        _read(collected, (seed,), errors)
    return build_comparison(collected, (host, seed), errors, thresholds, policy)


def compare_paths_torch_free(
    host_path: str | Path,
    seed_path: str | Path | None = None,
    *,
    host_prefix: str | None = None,
    seed_prefix: str | None = None,
    thresholds: Thresholds | None = None,
    policy: ComparePolicy | None = None,
) -> Comparison:
    """:func:`~gradaudit.comparison.api.compare_paths` without torch, on the CPU with the
    native kernel; the caller checks :func:`gradaudit.scan.torch_free.applies` first.

    Raises :class:`~gradaudit.scan.torch_free.NeedsTorch` when an input is not what the
    torch-free scan takes (:func:`~gradaudit.scan.torch_free.takes`), or not a regular file
    (compare does not expand directories: those, and missing files, take the torch path and
    its messages), or holds a dtype only torch reports as it should, or is a ``torch.save``
    file the torch-free reader declines (:mod:`gradaudit.io.zip_checkpoint`).
    """
    paths = [str(host_path)] + ([] if seed_path is None else [str(seed_path)])
    if not all(os.path.isfile(path) for path in paths):
        raise torch_free.NeedsTorch(paths)
    if not torch_free.takes(FileInput(path) for path in paths):
        raise torch_free.NeedsTorch(paths)
    return compare_files(
        torch_free.NativeScan(),
        host_path,
        seed_path,
        host_prefix=host_prefix,
        seed_prefix=seed_prefix,
        thresholds=thresholds,
        policy=policy,
    )


def _read(
    collected: Collected,
    sides: tuple[Side, ...],
    errors: list[InputProblem],
) -> None:
    """Collect one file into its side(s); a file that fails half-way contributes nothing."""
    path = sides[0].path
    assert path is not None
    problem = collected.read_file(path, routing=_Routes(sides))
    if problem is not None:
        errors.append(problem)


class _Routes:
    """Each tensor of a file to its side: by name prefix, the longer prefix first.

    The :class:`~gradaudit.scan.reading.Routing` of a compare; a name that matches no
    side's prefix is skipped ("not compared").
    """

    def __init__(self, sides: tuple[Side, ...]) -> None:
        self.labels = tuple(side.label for side in sides)
        self._routes = sorted(sides, key=lambda side: len(side.prefix or ""), reverse=True)
        self._outside = _outside_reason(sides)
        self._within = sides[0].label if len(sides) == 1 else None
        #: A file that is one side, whole (no prefix): read as runs, no call per name.
        self.whole = sides[0].label if len(sides) == 1 and not sides[0].prefix else None

    def route(self, name: str) -> str | Skipped:
        side = next((s for s in self._routes if name.startswith(s.prefix or "")), None)
        return Skipped(name, self._outside, self._within) if side is None else side.label


def _outside_reason(sides: tuple[Side, ...]) -> str:
    options = " nor ".join(f"--{side.label}-prefix {side.prefix!r}" for side in sides)
    if len(sides) == 1:
        return f"name does not start with {options}; not compared"
    return f"name matches neither {options}; not compared"


def build_comparison(
    collected: Collected,
    sides: tuple[Side, Side],
    errors: list[InputProblem],
    thresholds: Thresholds | None,
    policy: ComparePolicy | None,
) -> Comparison:
    policy = policy or ComparePolicy()
    report = collected.materialize(thresholds)  # the one device->host read
    _check_same_role(report, sides)
    host, seed = (_side_stats(report, side) for side in sides)
    failed = {problem.path for problem in errors}
    for stats, side in ((host, sides[0]), (seed, sides[1])):
        if not stats.params and side.path not in failed:
            errors.append(InputProblem(side.path or side.label, _empty_message(side)))
    report = dataclasses.replace(report, errors=tuple(errors))
    dual = DualGradientStats(host=host, seed=seed)
    table = StatsTable.from_stats(report.tensors)
    parameters = compare_tensors(
        table, _keyed(table, sides[0]), _keyed(table, sides[1]), policy.max_change
    )
    return Comparison(
        dual=dual,
        parameters=parameters,
        findings=comparison_findings(dual, parameters, policy),
        report=report,
        policy=policy,
    )


def _check_same_role(report: Report, sides: tuple[Side, Side]) -> None:
    """Refuse to compare weights with gradients: their ratio means nothing.

    Each side's role is what most of its tensors were read as (optimizer state and
    buffers aside); ``--kind`` makes both sides one role when the evidence misleads.
    """
    table = StatsTable.from_stats(report.tensors)
    compared = [ROLES.index(Role.GRADIENT), ROLES.index(Role.WEIGHT)]
    main: list[tuple[Role, str]] = []
    for side in sides:
        mask = _on_side(table, side) & np.isin(table.role_codes, compared)
        # Counted on the columns: (role, evidence) pairs in first-seen order, as Counter
        # breaks ties.
        pairs = Counter(
            zip(table.role_codes[mask].tolist(), table.evidence_codes[mask].tolist(), strict=True)
        )
        if not pairs:
            return
        role, evidence = pairs.most_common(1)[0][0]
        main.append((ROLES[role], table.evidences[evidence]))
    (host_role, host_why), (seed_role, seed_why) = main
    if host_role is not seed_role:
        raise UsageError(
            f"cannot compare {host_role.value}s ({sides[0].label}: {host_why}) with "
            f"{seed_role.value}s ({sides[1].label}: {seed_why}); compare like with like, "
            "or say what both hold with --kind"
        )


def _empty_message(side: Side) -> str:
    if side.path is None:
        return (
            f"the {side.label} side has no floating-point gradient element to compare "
            "(an empty input, or parameters whose .grad is None)"
        )
    where = f" starting with --{side.label}-prefix {side.prefix!r}" if side.prefix else ""
    return f"no floating-point tensor{where} for the {side.label} side; nothing to compare"


def _on_side(table: StatsTable, side: Side) -> np.ndarray:
    """A mask of the tensors of ``side`` (its file, or its label in memory)."""
    if side.label not in table.sources:
        return np.zeros(len(table), dtype=bool)
    mask: np.ndarray = table.source_codes == table.sources.index(side.label)
    return mask


def _side_stats(report: Report, side: Side) -> SideStats:
    file = next(f for f in report.files if f.path == side.label)
    table = StatsTable.from_stats(report.tensors)
    mine = _on_side(table, side)

    def flagged(kind: FindingKind) -> int:
        # Like a scan's summary: a tensor whose finding is --ignore'd is not counted as flagged
        # (its NaN/Inf elements still are, and still stop the ratio: ignoring edits nothing).
        # Counted on the columns: a million findings build no object.
        flagged = flagged_indices(table, report.findings, (kind,), ignored=False)
        return int(mine[flagged].sum())

    return SideStats(
        label=side.label,
        path=side.path,
        prefix=side.prefix,
        tensors=file.tensors,
        skipped=file.skipped,
        params=file.elements,
        norm=file.global_norm or 0.0,
        nan=int(table.nan[mine].sum()),
        inf=int(table.pos_inf[mine].sum() + table.neg_inf[mine].sum()),
        nan_tensors=flagged(FindingKind.NAN),
        inf_tensors=flagged(FindingKind.INF),
        vanishing_tensors=flagged(FindingKind.VANISHING),
        exploding_tensors=flagged(FindingKind.EXPLODING),
    )


def _keyed(table: StatsTable, side: Side) -> tuple[list[str], np.ndarray]:
    """The names ``side``'s tensors are matched on (prefix removed), and their positions.

    A name twice on one side is an error: it could match only one of its namesakes.
    """
    rows = table.source_indices(side.label)
    names = table.names
    keys = [side.key(names[i]) for i in rows.tolist()]
    if len(set(keys)) == len(keys):
        return keys, rows
    seen: set[str] = set()
    for key in keys:  # the first name seen twice
        if key in seen:
            raise InputError(
                side.path,
                f"the {side.label} side names {key!r} twice; "
                "names must be unique to compare per parameter",
            )
        seen.add(key)
    raise AssertionError("unreachable: a repeated name was counted")


__all__ = ["Side", "build_comparison", "compare_files", "compare_paths_torch_free"]
