"""The layout a monitor keeps between reports: taken only for equal facts, never changing one."""

from __future__ import annotations

import torch

from gradaudit.policy import Thresholds
from gradaudit.results import Report
from gradaudit.results.stats_table import StatsTable
from gradaudit.scan.layout import LayoutCache, LayoutKey
from gradaudit.scan.pending import PendingStats


def _tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {f"layers.{i}.weight": torch.randn(4, 4) * scale for i in range(9)}
    out |= {f"layers.{i}.bias": torch.randn(4) * scale for i in range(9)}
    out["layers.3.weight"] = out["layers.3.weight"] * 1e5  # an outlier, and exploding
    return out


def _report(
    tensors: dict[str, torch.Tensor],
    layouts: LayoutCache | None,
    thresholds: Thresholds | None = None,
    source: str | None = None,
) -> Report:
    pending = PendingStats()
    pending.add_all(tensors, source)
    return pending.materialize(thresholds or Thresholds(), layouts=layouts)


def _facts(report: Report) -> tuple[object, ...]:
    return (
        list(report.tensors),
        list(report.findings),
        report.summary,
        report.outlier_references,
        report.files,
    )


def test_a_report_made_with_a_kept_layout_is_the_report_made_without() -> None:
    layouts = LayoutCache()
    first = _report(_tensors(), layouts)
    kept = layouts.get(_key_of(_tensors()))
    assert kept is not None
    second = _report(_tensors(2.0), layouts)
    assert layouts.get(_key_of(_tensors())) is kept  # taken again, not made again
    assert _facts(first) == _facts(_report(_tensors(), None))
    assert _facts(second) == _facts(_report(_tensors(2.0), None))
    assert second.summary.outlier_tensors + second.summary.exploding_tensors > 0


def test_other_facts_take_no_kept_layout() -> None:
    layouts = LayoutCache()
    _report(_tensors(), layouts)
    renamed = {name.replace("layers", "blocks"): t for name, t in _tensors().items()}
    reshaped = dict(_tensors(), **{"layers.0.bias": torch.ones(2, 2)})
    retyped = dict(_tensors(), **{"layers.0.bias": torch.ones(4, dtype=torch.float64)})
    for tensors in (renamed, reshaped, retyped):
        assert layouts.get(_key_of(tensors)) is None
        assert _facts(_report(tensors, layouts)) == _facts(_report(tensors, None))
    assert layouts.get(_key_of(_tensors(), Thresholds(exploding=1.0))) is None
    strict = Thresholds(exploding=1.0)
    assert _facts(_report(_tensors(), layouts, strict)) == _facts(_report(_tensors(), None, strict))


def test_roles_guessed_from_the_values_are_not_kept() -> None:
    # A file with no metadata is read as gradients or weights from its values
    # (gradaudit.roles.stats_evidence): that reading holds for those values only.
    layouts = LayoutCache()
    _report(_tensors(), layouts, source="dump.bin")
    assert layouts.get(_key_of(_tensors(), source="dump.bin")) is None


def test_a_kept_layout_cannot_be_changed_through_a_report() -> None:
    layouts = LayoutCache()
    report = _report(_tensors(), layouts)
    table = report.tensors
    assert isinstance(table, StatsTable)
    for column in (table.role_codes, table.dims, table.starts, table.numel):
        assert not column.flags.writeable


def _key_of(
    tensors: dict[str, torch.Tensor],
    thresholds: Thresholds | None = None,
    source: str | None = None,
) -> LayoutKey:
    """The layout key of a collection of ``tensors`` (what a report of them looks up)."""
    pending = PendingStats()
    pending.add_all(tensors, source)
    return pending._layout_key(thresholds or Thresholds())
