"""``python -m gradaudit``."""

from gradaudit.cli import run

run()
