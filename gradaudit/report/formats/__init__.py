"""The output formats the CLI offers, each mapped to its formatter."""

from __future__ import annotations

from enum import Enum

from gradaudit._compat import assert_never
from gradaudit.report.base import Formatter
from gradaudit.report.formats.github import render_github
from gradaudit.report.formats.json import render_json
from gradaudit.report.formats.junit import render_junit
from gradaudit.report.formats.markdown import render_markdown
from gradaudit.report.formats.table import render_table


class OutputFormat(str, Enum):
    TABLE = "table"
    JSON = "json"
    MARKDOWN = "markdown"
    GITHUB = "github"
    JUNIT = "junit"

    def formatter(self) -> Formatter:
        if self is OutputFormat.TABLE:
            return render_table
        if self is OutputFormat.JSON:
            return render_json
        if self is OutputFormat.MARKDOWN:
            return render_markdown
        if self is OutputFormat.GITHUB:
            return render_github
        if self is OutputFormat.JUNIT:
            return render_junit
        assert_never(self)
