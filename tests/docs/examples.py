"""The documentation as the tests read it: the README (the front door) and every page in docs/.

Examples may stand on any page; the tests that run them read them all, in this order, so an
example moved between pages is still executed.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def text() -> str:
    """Every page, README first."""
    return "\n".join(page.read_text(encoding="utf-8") for page in PAGES)


def blocks(language: str) -> list[tuple[Path, str]]:
    """``(page, body)`` of every fenced block in ``language``, in page order."""
    return [
        (page, body)
        for page in PAGES
        for body in re.findall(
            rf"```{language}\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S
        )
    ]
