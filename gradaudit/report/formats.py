"""The output formats the CLI offers, each mapped to its formatter."""

from __future__ import annotations

from enum import Enum
from typing import assert_never

from gradaudit.report.base import Formatter
from gradaudit.report.json_report import render_json
from gradaudit.report.table import render_table


class OutputFormat(str, Enum):
    TABLE = "table"
    JSON = "json"

    def formatter(self) -> Formatter:
        if self is OutputFormat.TABLE:
            return render_table
        if self is OutputFormat.JSON:
            return render_json
        assert_never(self)
