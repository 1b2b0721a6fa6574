"""The output formats, one module each, behind one registry keyed by :class:`OutputFormat`.

Each format module renders every result type: ``render_scan`` (a
:class:`~gradaudit.results.Report`), ``render_compare`` (a
:class:`~gradaudit.results.comparison.Comparison`) and ``render_trend`` (a
:class:`~gradaudit.results.trend.TrendReport`), offered as its ``RENDERERS``.
:func:`renderers` is the one map from a format to them: ``assert_never`` makes
mypy reject a format that is not mapped, and a test renders every result type
in every format.

A renderer yields text in chunks (a table, a block, one JSON tensor) and the
CLI writes each as it comes, so a report of a million tensors is never one
string in memory. :func:`render_text` joins them, for tests and library users.
"""

from __future__ import annotations

from collections.abc import Iterator

from gradaudit._compat import assert_never
from gradaudit.report.base import Renderers, RenderOptions
from gradaudit.report.output_format import OutputFormat as OutputFormat
from gradaudit.results import Report
from gradaudit.results.comparison import Comparison
from gradaudit.results.trend import TrendReport


def renderers(output_format: OutputFormat) -> Renderers:
    """The format's renderer for each result type.

    Each format's module is imported when it is asked for: a run renders one format, and
    the others cost start-up (JUnit's ``xml.etree`` alone ~5 ms of a 0.3 s ``scan``).
    """
    if output_format is OutputFormat.TABLE:
        from gradaudit.report.formats import table  # start-up: only the format asked for

        return table.RENDERERS
    if output_format is OutputFormat.JSON:
        from gradaudit.report.formats import json  # start-up: only the format asked for

        return json.RENDERERS
    if output_format is OutputFormat.MARKDOWN:
        from gradaudit.report.formats import markdown  # start-up: only the format asked for

        return markdown.RENDERERS
    if output_format is OutputFormat.GITHUB:
        from gradaudit.report.formats import github  # start-up: only the format asked for

        return github.RENDERERS
    if output_format is OutputFormat.JUNIT:
        from gradaudit.report.formats import junit  # start-up: only the format asked for

        return junit.RENDERERS
    assert_never(output_format)


def render(
    result: Report | Comparison | TrendReport, output_format: OutputFormat, options: RenderOptions
) -> Iterator[str]:
    """``result`` in ``output_format``, chunk by chunk."""
    chosen = renderers(output_format)
    if isinstance(result, Report):
        return chosen.scan(result, options)
    if isinstance(result, Comparison):
        return chosen.compare(result, options)
    return chosen.trend(result, options)


def render_text(
    result: Report | Comparison | TrendReport,
    output_format: OutputFormat,
    options: RenderOptions | None = None,
) -> str:
    """``result`` in ``output_format`` as one string (a million-tensor JSON is a large one)."""
    return "".join(render(result, output_format, options or RenderOptions()))
