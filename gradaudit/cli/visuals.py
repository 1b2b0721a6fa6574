"""What ``scan`` and ``trend`` share for pictures: ``--chart``, ``--group-by``, ``--plot``.

Options are checked before any work (a typo in ``--plot`` must not cost a
ten-minute audit); pictures are produced after the report, by the renderers,
and only here are they written out.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from gradaudit.cli.output import check_not_read, replace_atomically
from gradaudit.errors import UsageError
from gradaudit.grouping import GroupBy, parse_group_by
from gradaudit.report.base import RenderOptions
from gradaudit.report.chart import MIN_AUTO_CHART_WIDTH, chart_title, render_chart, report_layers
from gradaudit.report.plot import PlotFormat, flow_plot, require_matplotlib, trend_plot
from gradaudit.results import Report
from gradaudit.results.trend import TrendReport

GroupByOption = Annotated[
    str,
    typer.Option(
        "--group-by",
        metavar="auto|module|'depth N'|none",
        help="Rows of scan's chart and of trend's table: parameters grouped by owning module, "
        "by the first N name components, or not at all; auto = module, or the deepest depth "
        "that fits 40 rows.",
    ),
]
ChartOption = Annotated[
    bool | None,
    typer.Option(
        "--chart/--no-chart",
        help="Gradient-flow chart (log10 norm per layer) above the table. "
        f"Default: on when stdout is a terminal at least {MIN_AUTO_CHART_WIDTH} columns wide.",
    ),
]
PlotOption = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE.png|FILE.svg",
        help="Also draw the chart into an image (needs the plot extra: "
        "pip install 'gradaudit[plot]').",
    ),
]


def group_by_option(spec: str) -> GroupBy:
    try:
        return parse_group_by(spec)
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_plot_target(
    plot: Path | None,
    inputs: Sequence[Path],
    *,
    recursive: bool = False,
    config: Path | None = None,
) -> PlotFormat | None:
    """Validate ``--plot`` before the audit: format, matplotlib, a writable place, not an input."""
    if plot is None:
        return None
    fmt = PlotFormat.of(plot)
    require_matplotlib()
    shown = str(plot)
    parent = plot.parent if str(plot.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--plot {shown!r}: directory {str(parent)!r} does not exist")
    try:
        info = os.stat(plot)
    except FileNotFoundError:
        info = None
    except OSError as error:
        raise UsageError(f"--plot {shown!r}: {error.strerror or error}") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise UsageError(f"--plot {shown!r}: exists and is not a regular file")
    check_not_read("--plot", plot, inputs, recursive=recursive, config=config)
    return fmt


def write_plot(plot: Path, data: bytes) -> None:
    """Write the image atomically, as ``--output`` writes a report: a full disk leaves the
    previous image in place, not a truncated one (an output failure, exit 5)."""
    replace_atomically(plot, data, "--plot")


@dataclass(frozen=True)
class ScanVisuals:
    """The chart and plot options of one ``scan``, already validated."""

    chart: bool | None
    group_by: GroupBy
    plot: Path | None
    plot_format: PlotFormat | None
    table: bool

    @classmethod
    def prepare(
        cls,
        *,
        chart: bool | None,
        group_by: str,
        plot: Path | None,
        inputs: Sequence[Path],
        table: bool,
        recursive: bool = False,
        config: Path | None = None,
    ) -> ScanVisuals:
        if chart and not table:
            raise UsageError("--chart goes with --format table (use --plot for an image)")
        spec = group_by_option(group_by)
        target = check_plot_target(plot, inputs, recursive=recursive, config=config)
        return cls(chart, spec, plot, target, table)

    def chart_text(self, report: Report, options: RenderOptions) -> str:
        """The chart for stdout, or "" when it is off."""
        shown = self.chart
        if shown is None:
            shown = self.table and sys.stdout.isatty() and options.width >= MIN_AUTO_CHART_WIDTH
        return render_chart(report, options, self.group_by) if shown else ""

    def write_plot(self, report: Report) -> None:
        if self.plot is None or self.plot_format is None or not report.tensors:
            return
        spec, layers = report_layers(report, self.group_by)
        title = chart_title(report, layers, spec)
        write_plot(self.plot, flow_plot(layers, report.thresholds, self.plot_format, title=title))


def write_trend_plot(plot: Path | None, fmt: PlotFormat | None, report: TrendReport) -> None:
    if plot is None or fmt is None or not report.layers:
        return
    write_plot(plot, trend_plot(report, fmt))
