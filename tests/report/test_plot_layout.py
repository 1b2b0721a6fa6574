"""Pictures a person can read: labels that do not overlap, colours that match the lines drawn.

Bounding boxes come from matplotlib itself (``get_window_extent`` after a draw),
so the checks hold for the pixels a user gets, not for assumed font metrics.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from gradaudit import Thresholds, audit
from gradaudit.grouping import GroupBy, GroupMode
from gradaudit.policy import Severity
from gradaudit.report.chart import drawn_severity, layer_status, report_layers
from gradaudit.trend.builder import trend_paths

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg

from gradaudit.report.plot import flow_figure, trend_figure


def _boxes(figure: Any, artists: list[Any]) -> list[Any]:
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    return [artist.get_window_extent(renderer) for artist in artists]


def _spiking_series(directory: Path) -> Path:
    """Three layers spike at the same step and the last layer turns NaN near the end."""
    directory.mkdir()
    layers = [f"encoder.layer.{i}.intermediate.dense.weight" for i in range(3)]
    for step in range(20):
        grads = {
            name: torch.ones(8) * (1e4 if step == 12 else 1.0 + 0.01 * step) for name in layers
        }
        grads["encoder.layer.3.output.dense.weight"] = torch.full(
            (8,), float("nan") if step >= 18 else 0.5
        )
        path = directory / f"step_{step}.safetensors"
        save_file(grads, str(path), metadata={"step": str(step)})
    return directory


def test_trend_labels_overlap_nothing_and_stay_in_the_picture(tmp_path: Path) -> None:
    report = trend_paths([_spiking_series(tmp_path / "s")], device="cpu")
    assert sum(1 for f in report.findings if f.kind.value == "spike") == 3
    figure = trend_figure(report)
    ax = figure.axes[0]
    labels = list(ax.texts)
    assert len(labels) == 2  # three spikes at one step share one label; first NaN/Inf
    legend = ax.get_legend()
    boxes = _boxes(figure, [*labels, legend])
    whole = figure.bbox
    for box in boxes:
        assert whole.x0 <= box.x0
        assert box.x1 <= whole.x1
        assert whole.y0 <= box.y0
        assert box.y1 <= whole.y1
    for first, second in combinations(boxes, 2):
        assert not first.overlaps(second), (first, second)
    spike = next(t for t in labels if "spike" in t.get_text())
    for i in range(3):  # every spiking layer is named
        assert f"encoder.layer.{i}.intermediate.dense" in spike.get_text()


def test_flow_plot_tick_labels_are_readable_and_whole() -> None:
    grads = {
        f"encoder.layer.{i}.{part}": torch.ones(4) * 0.1
        for i in range(8)
        for part in ("attention.self.query.weight", "attention.output.dense.weight")
    }
    report = audit(grads)
    _, layers = report_layers(report, GroupBy(GroupMode.NONE))
    figure = flow_figure(layers, report.thresholds, title="t")
    ticks = figure.axes[0].get_xticklabels()
    assert all(t.get_fontsize() >= 7 for t in ticks)
    for tick, box in zip(ticks, _boxes(figure, ticks), strict=True):
        assert box.y0 >= figure.bbox.y0, f"{tick.get_text()} is cut at the bottom"
    texts = [t.get_text() for t in ticks]
    assert len(set(texts)) == len(texts)  # shortened, each still tells its layer apart
    for i, text in enumerate(texts):
        assert f"{i // 2}." in text
        assert text.endswith(".weight")


def test_a_group_status_says_how_many_members_and_colours_follow_the_lines() -> None:
    grads = {
        "encoder.layer.0.attention.self.query.weight": torch.ones(64) * 0.01,
        "encoder.layer.0.attention.self.key.weight": torch.ones(64) * 0.01,
        "encoder.layer.0.attention.self.key.bias": torch.zeros(8),
        # no tensor above 100, but the group's combined norm is
        "big.a": torch.ones(100) * 8.0,
        "big.b": torch.ones(100) * 8.0,
    }
    report = audit(grads)
    _, layers = report_layers(report, GroupBy(GroupMode.DEPTH, 3))
    by_name = {layer.name: layer for layer in layers}
    key = by_name["encoder.layer.0"]
    assert layer_status(key, report.thresholds).plain == "1 of 3 vanishing"
    assert drawn_severity(key, report.thresholds) is Severity.WARNING
    thresholds = Thresholds()
    big = by_name["big.a"] if "big.a" in by_name else by_name["big"]
    assert big.norm > thresholds.exploding
    assert drawn_severity(big, report.thresholds) is Severity.ERROR  # red above the red line
    assert "group > 100" in layer_status(big, report.thresholds).plain
