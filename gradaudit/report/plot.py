"""``--plot FILE.png|FILE.svg``: the gradient-flow chart and the trend as images (matplotlib).

matplotlib is an optional extra (``pip install 'gradaudit[plot]'``) and is
imported only here, only when a plot is asked for. Renderers return the image
bytes; the CLI writes them.

Output is deterministic, so tests can check it and a committed image does not
change on every run: a fixed size (:data:`FIGURE_INCHES` at :data:`DPI`, i.e.
1200×600 px for PNG, 864×432 pt for SVG), matplotlib's own default style
whatever the user's ``matplotlibrc`` says, the DejaVu Sans font that ships
with matplotlib, text as paths in SVG, a fixed ``svg.hashsalt`` for SVG ids,
and no date or software-version metadata.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradaudit.errors import UsageError
from gradaudit.grouping import Layer
from gradaudit.policy import Severity, Thresholds
from gradaudit.report.chart import LogAxis, drawn_severity, layer_status
from gradaudit.report.fit import shorten_left
from gradaudit.results.trend import TrendReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGURE_INCHES = (12.0, 6.0)
DPI = 100
INSTALL_HINT = "pip install 'gradaudit[plot]'"
_COLORS = {Severity.ERROR: "#d62728", Severity.WARNING: "#e0a500", None: "#2ca02c"}
#: Share of the figure's height under the flow plot's axes, for the rotated layer names.
_FLOW_BOTTOM = 0.34
#: Layers drawn in colour with a legend entry; beyond this only flagged layers are.
MAX_LEGEND_LAYERS = 10


class PlotFormat(str, Enum):
    PNG = "png"
    SVG = "svg"

    @classmethod
    def of(cls, path: str | Path) -> PlotFormat:
        """The format named by ``path``'s suffix; a usage error for anything else."""
        suffix = Path(path).suffix.lower().removeprefix(".")
        try:
            return cls(suffix)
        except ValueError:
            raise UsageError(
                f"--plot {str(path)!r}: the file name must end in .png or .svg"
            ) from None


def require_matplotlib() -> None:
    """Fail early, before any work, when ``--plot`` cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from None


@contextmanager
def _style() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context():
        matplotlib.rcdefaults()  # ignore the user's matplotlibrc and style
        matplotlib.rcParams.update(
            {
                "font.family": "DejaVu Sans",
                "font.size": 9,
                "svg.fonttype": "path",
                "svg.hashsalt": "gradaudit",
                "path.simplify": False,
            }
        )
        yield


def _figure() -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=FIGURE_INCHES, dpi=DPI, layout=None)


def _save(figure: Figure, fmt: PlotFormat) -> bytes:
    buffer = io.BytesIO()
    metadata: dict[str, Any] = (
        {"Software": None} if fmt is PlotFormat.PNG else {"Date": None, "Creator": "gradaudit"}
    )
    figure.savefig(buffer, format=fmt.value, dpi=DPI, metadata=metadata)
    return buffer.getvalue()


def _short(label: str, limit: int = 40) -> str:
    return shorten_left(label, limit)


def _log_values(values: Sequence[float | None], top: float) -> list[float]:
    """Values for a log axis: zero and missing are left out (NaN), infinity is drawn at ``top``."""
    out = []
    for value in values:
        if value is None or math.isnan(value) or value <= 0:
            out.append(math.nan)
        else:
            out.append(min(value, top))
    return out


def flow_plot(
    layers: Sequence[Layer], thresholds: Thresholds, fmt: PlotFormat, *, title: str
) -> bytes:
    """Norm per layer as bars (log scale), max |g| as points, thresholds as lines."""
    with _style():
        return _save(flow_figure(layers, thresholds, title=title), fmt)


def flow_figure(layers: Sequence[Layer], thresholds: Thresholds, *, title: str) -> Figure:
    """The gradient-flow picture; bar colours follow the threshold lines drawn on it."""
    figure = _figure()
    figure.subplots_adjust(left=0.07, right=0.98, top=0.86, bottom=_FLOW_BOTTOM)
    ax: Axes = figure.add_subplot()
    several = len({layer.source for layer in layers}) > 1
    size = 8 if len(layers) <= 24 else 7 if len(layers) <= 40 else 6 if len(layers) <= 60 else 5
    # Rotated tick labels get the bottom margin: as many characters as fit in it
    # (DejaVu Sans averages about 0.62 em), shortened from the left beyond that.
    room = _FLOW_BOTTOM * FIGURE_INCHES[1] * DPI - 12
    limit = int(room / (0.62 * size * DPI / 72))
    labels = [
        _short(f"{Path(layer.source or '').name}:{layer.name}" if several else layer.name, limit)
        for layer in layers
    ]
    values = [layer.norm for layer in layers] + [layer.max_abs for layer in layers]
    values += [thresholds.exploding, thresholds.vanishing]
    axis = LogAxis.covering(values, 1)
    bottom, top = 10.0**axis.lo, 10.0**axis.hi
    x = list(range(len(layers)))
    norms = _log_values([layer.norm for layer in layers], top)
    heights = [n - bottom if not math.isnan(n) else 0.0 for n in norms]
    severities = [drawn_severity(layer, thresholds) for layer in layers]
    colors = [_COLORS[severity] for severity in severities]
    ax.set_yscale("log")
    ax.bar(
        x,
        heights,
        bottom=bottom,
        color=colors,
        width=0.7,
        zorder=2,
        label="norm (green ok, yellow warning, red failing)",
    )
    maxima = _log_values([layer.max_abs for layer in layers], top)
    ax.plot(
        x,
        maxima,
        linestyle="none",
        marker="D",
        markersize=4,
        color="#333333",
        label="max |g|",
        zorder=3,
    )
    if thresholds.vanishing > 0:
        ax.axhline(
            thresholds.vanishing,
            color=_COLORS[Severity.WARNING],
            linestyle="--",
            linewidth=1,
            label=f"vanishing < {thresholds.vanishing:.3g}",
            zorder=1,
        )
    ax.axhline(
        thresholds.exploding,
        color=_COLORS[Severity.ERROR],
        linestyle="--",
        linewidth=1,
        label=f"exploding > {thresholds.exploding:.3g}",
        zorder=1,
    )
    for index, layer in enumerate(layers):
        status = layer_status(layer, thresholds).plain
        if status:
            anchor = norms[index] if not math.isnan(norms[index]) else bottom
            ax.annotate(
                status,
                (index, anchor),
                xytext=(0, 4),
                textcoords="offset points",
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                color=_COLORS[severities[index]],
            )
    # Headroom above the tallest possible bar for the rotated annotations.
    ax.set_ylim(bottom, top * 10.0 ** (0.3 * (axis.hi - axis.lo)))
    ax.set_xlim(-0.6, len(layers) - 0.4)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=90, fontsize=size)
    for tick, severity in zip(ax.get_xticklabels(), severities, strict=True):
        if severity is not None:
            tick.set_color(_COLORS[severity])
    ax.set_ylabel("gradient L2 norm (log scale)")
    figure.suptitle(title, fontsize=10, x=0.07, ha="left")
    ax.grid(axis="y", which="major", linewidth=0.4, alpha=0.5, zorder=0)
    ax.legend(
        loc="lower left",
        bbox_to_anchor=(0.0, 1.01),
        fontsize=8,
        ncols=4,
        borderaxespad=0,
        frameon=False,
    )
    return figure


def trend_plot(report: TrendReport, fmt: PlotFormat) -> bytes:
    """Per-layer norms over steps (log scale), the global norm, the findings marked."""
    with _style():
        return _save(trend_figure(report), fmt)


def trend_figure(report: TrendReport) -> Figure:
    """The trend picture; its labels never overlap each other, the legend or the border."""
    from matplotlib.ticker import MaxNLocator

    figure = _figure()
    figure.subplots_adjust(left=0.07, right=0.74, top=0.92, bottom=0.1)
    ax: Axes = figure.add_subplot()
    ax.set_yscale("log")
    steps = [s.step for s in report.steps]
    flagged = {f.layer for f in report.findings}
    colored = len(report.layers) <= MAX_LEGEND_LAYERS
    others = 0
    values = [n for layer in report.layers for n in layer.norms if n is not None]
    values += [s.global_norm for s in report.steps if s.global_norm is not None]
    values += [report.policy.vanishing]
    axis = LogAxis.covering(values, 1)
    top = 10.0**axis.hi
    for layer in report.layers:
        norms = _log_values(layer.norms, top)
        if colored or layer.name in flagged:
            ax.plot(steps, norms, linewidth=1.2, marker=".", markersize=3, label=_short(layer.name))
        else:
            others += 1
            ax.plot(steps, norms, linewidth=0.6, color="#bbbbbb", zorder=1)
        for spike in layer.spikes:
            ax.plot(
                [spike.step],
                [min(spike.norm, top)],
                marker="o",
                markersize=9,
                markerfacecolor="none",
                markeredgecolor=_COLORS[Severity.ERROR],
                linestyle="none",
                zorder=4,
            )
    ax.plot(
        steps,
        _log_values([s.global_norm if s.tensors else None for s in report.steps], top),
        color="black",
        linewidth=2.2,
        label="global norm",
        zorder=3,
    )
    if others:
        ax.plot([], [], linewidth=0.6, color="#bbbbbb", label=f"{others} other layers")
    if report.policy.vanishing > 0:
        ax.axhline(
            report.policy.vanishing,
            color=_COLORS[Severity.WARNING],
            linestyle="--",
            linewidth=1,
            label=f"vanishing < {report.policy.vanishing:.3g}",
        )
    # Headroom above the highest norm so that labels of a spike fit inside the axes.
    ax.set_ylim(top=top * 10.0 ** (0.25 * max(1, axis.hi - axis.lo)))
    labels = []
    by_step: dict[tuple[str, int], list[str]] = {}
    for finding in report.findings:
        by_step.setdefault((finding.kind.value, finding.step), []).append(finding.layer)
    for (kind, step), names in by_step.items():
        severity = next(
            f.severity for f in report.findings if f.kind.value == kind and f.step == step
        )
        color = _COLORS[severity]
        listed = "\n".join(_short(n) for n in names[:3]) + (
            f"\n… and {len(names) - 3} more" if len(names) > 3 else ""
        )
        if kind == "nonfinite":
            ax.axvline(step, color=color, linestyle=":", linewidth=1.5)
            labels.append(
                ax.annotate(
                    f"first NaN/Inf: step {step}\n{listed}",
                    (step, 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(4, -4),
                    textcoords="offset points",
                    va="top",
                    fontsize=8,
                    color=color,
                )
            )
            continue
        heights = [
            layer.norms[steps.index(step)]
            for layer in report.layers
            if layer.name in names and layer.norms[steps.index(step)] is not None
        ]
        value = max((h for h in heights if h is not None and h > 0), default=None)
        if value is None:
            continue
        what = kind if len(names) == 1 else f"{kind} in {len(names)} layers"
        labels.append(
            ax.annotate(
                f"{what} at step {step}\n{listed}",
                (step, min(value, top)),
                xytext=(8, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color=color,
            )
        )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{report.subject} L2 norm (log scale)")
    ax.set_title(
        f"{report.subject.capitalize()} norm per layer over {len(steps)} steps "
        f"(group-by {report.group_by})",
        fontsize=10,
        loc="left",
    )
    ax.grid(which="major", linewidth=0.4, alpha=0.5)
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    _separate(figure, ax, labels, [legend])
    return figure


def _separate(figure: Figure, ax: Axes, labels: list[Any], fixed: list[Any]) -> None:
    """Move annotations down until none overlaps another, a fixed artist, or leaves the axes.

    Labels of findings at the same or nearby steps would otherwise print over each
    other (three spikes at one step made an unreadable stack).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()  # type: ignore[no-untyped-call]
    taken = [artist.get_window_extent(renderer) for artist in fixed]
    area = ax.get_window_extent(renderer)
    for label in labels:
        for _ in range(40):
            box = label.get_window_extent(renderer)
            clash = any(box.overlaps(other) for other in taken)
            if box.x1 > area.x1:  # past the right edge: put the label left of its point
                label.set_horizontalalignment("right")
                offset = label.xyann
                label.xyann = (-abs(offset[0]) - 4, offset[1])
                continue
            if box.y0 < area.y0:
                break
            if not clash:
                break
            offset = label.xyann
            label.xyann = (offset[0], offset[1] - box.height * 72.0 / figure.dpi - 3)
        taken.append(label.get_window_extent(renderer))
