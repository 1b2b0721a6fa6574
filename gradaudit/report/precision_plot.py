"""``scan --precision FMT --plot FILE``: the figure of Mixed Precision Training, for your values.

A histogram of ``floor(log2|x|)`` over every non-zero value (fraction of
values per binade, log scale) with the target format's ranges shaded: normal,
subnormal, and the region that flushes to zero; the largest finite value is a
line. The suggested power-of-two scale is drawn as the histogram would sit
after scaling. Same deterministic style as :mod:`gradaudit.report.plot`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gradaudit.precision.formats import FORMATS
from gradaudit.precision.judging import PrecisionReport
from gradaudit.report.plot import PlotFormat, _figure, _save, _style

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_NORMAL = "#2ca02c"
_SUBNORMAL = "#e0a500"
_FLUSH = "#d62728"


def precision_plot(report: PrecisionReport, fmt: PlotFormat, *, title: str | None = None) -> bytes:
    """The log2 magnitude histogram of ``report``'s values against its format's ranges."""
    spec = FORMATS[report.precision]
    total = report.total
    exponents = report.histogram.exponents()
    with _style():
        figure = _figure()
        figure.subplots_adjust(left=0.07, right=0.98, top=0.9, bottom=0.1)
        ax: Axes = figure.add_subplot()
        low_format = math.log2(spec.min_subnormal)
        high_format = math.log2(spec.max)
        if exponents:
            shift = total.scale_log2 or 0
            lo = min(min(exponents), min(exponents) + shift, math.floor(low_format)) - 2
            hi = max(max(exponents), max(exponents) + shift, math.ceil(high_format)) + 2
        else:
            lo, hi = math.floor(low_format) - 2, math.ceil(high_format) + 2
        ax.axvspan(lo, low_format - 1, color=_FLUSH, alpha=0.08, lw=0)
        ax.axvspan(low_format - 1, math.log2(spec.min_normal), color=_SUBNORMAL, alpha=0.15, lw=0)
        ax.axvspan(math.log2(spec.min_normal), high_format, color=_NORMAL, alpha=0.12, lw=0)
        ax.axvline(
            high_format, color=_FLUSH, lw=1, ls="--", label=f"largest {spec.label} ({spec.max:.5g})"
        )
        nonzero = max(total.nonzero, 1)
        xs = sorted(exponents)
        ax.set_yscale("log")
        ax.bar(
            [x + 0.5 for x in xs],
            [exponents[x] / nonzero for x in xs],
            width=0.9,
            color="#1f77b4",
            zorder=2,
            label="values per binade (this run)",
        )
        if total.scale_log2 is not None and total.scale_log2 != 0 and xs:
            shift = total.scale_log2
            span = range(xs[0], xs[-1] + 1)
            # Empty binades break the line instead of bridging the gap.
            heights = [exponents[x] / nonzero if x in exponents else math.nan for x in span]
            ax.step(
                [x + shift for x in span] + [xs[-1] + 1 + shift],
                [*heights, heights[-1]],
                where="post",
                color="#333333",
                lw=1,
                ls=":",
                zorder=3,
                label=f"after scaling by 2^{shift}",
            )
        ax.set_xlim(lo, hi)
        bottom = min([exponents[x] / nonzero for x in xs] + [1.0]) / 3
        ax.set_ylim(bottom, 1.5)
        for text, x in (
            (f"flush to zero (≤ 2^{low_format - 1:g})", (lo + low_format - 1) / 2),
            ("subnormal", low_format - 0.5),
            (f"{spec.label} normal range", (math.log2(spec.min_normal) + high_format) / 2),
        ):
            ax.annotate(
                text,
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, -4),
                textcoords="offset points",
                ha="center",
                va="top",
                fontsize=8,
                rotation=90 if text == "subnormal" else 0,
            )
        ax.set_xlabel("log2 |x| (binary exponent; zeros not shown)")
        ax.set_ylabel("fraction of non-zero values (log scale)")
        ax.grid(axis="y", which="major", linewidth=0.4, alpha=0.5, zorder=0)
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.94), fontsize=8, frameon=False)
        summary = (
            f"{total.nonzero:,} non-zero values in {spec.label}: "
            f"{total.flushed_fraction:.2%} flush to zero, {total.subnormal_fraction:.2%} "
            f"subnormal, {total.overflowed:,} overflow"
        )
        if total.scale_log2 is not None:
            summary += f"; largest scale without overflow 2^{total.scale_log2}"
        figure.suptitle((title + "\n" if title else "") + summary, fontsize=10, x=0.07, ha="left")
        return _save(figure, fmt)
