"""``--format``'s choices, apart from the renderers: the CLI declares its options with this
at start-up and imports the renderers (numpy, the scan's finding table) only when a
command renders a result."""

from __future__ import annotations

from enum import Enum

__all__ = ["OutputFormat"]


class OutputFormat(str, Enum):
    """``--format`` of ``scan``, ``compare`` and ``trend``."""

    TABLE = "table"
    JSON = "json"
    MARKDOWN = "markdown"
    GITHUB = "github"
    JUNIT = "junit"
