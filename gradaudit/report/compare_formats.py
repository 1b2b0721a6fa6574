"""Each output format's comparison formatter: the :class:`OutputFormat` map for comparisons.

A function rather than a second method on :class:`OutputFormat`, so the enum's
module does not import every comparison renderer. ``assert_never`` makes mypy
reject a new format that has no comparison formatter; a test checks the same
at run time.
"""

from __future__ import annotations

from gradaudit._compat import assert_never
from gradaudit.report.base import ComparisonFormatter
from gradaudit.report.compare_github import render_comparison_github
from gradaudit.report.compare_json import render_comparison_json
from gradaudit.report.compare_junit import render_comparison_junit
from gradaudit.report.compare_markdown import render_comparison_markdown
from gradaudit.report.compare_table import render_comparison_table
from gradaudit.report.formats import OutputFormat


def comparison_formatter(output_format: OutputFormat) -> ComparisonFormatter:
    if output_format is OutputFormat.TABLE:
        return render_comparison_table
    if output_format is OutputFormat.JSON:
        return render_comparison_json
    if output_format is OutputFormat.MARKDOWN:
        return render_comparison_markdown
    if output_format is OutputFormat.GITHUB:
        return render_comparison_github
    if output_format is OutputFormat.JUNIT:
        return render_comparison_junit
    assert_never(output_format)
