"""Rich styles of the terminal formats, defined once so the table, the chart and every
result type (scan, compare, trend) colour the same severity the same way."""

from __future__ import annotations

from gradaudit.errors import ExitCode
from gradaudit.policy import Severity

#: A finding's words: failing red, warnings yellow, ignored ones dimmed.
SEVERITY_STYLE: dict[Severity, str] = {
    Severity.ERROR: "bold red",
    Severity.WARNING: "yellow",
    Severity.IGNORED: "dim",
}
#: A row (a tensor's name, a layer's sparkline) holding findings of that severity.
ROW_STYLE: dict[Severity, str] = {
    Severity.ERROR: "red",
    Severity.WARNING: "yellow",
    Severity.IGNORED: "",
}
#: The closing verdict line, by exit code.
VERDICT_STYLE: dict[ExitCode, str] = {
    ExitCode.OK: "bold green",
    ExitCode.FINDINGS: "bold red",
    ExitCode.INPUT_ERROR: "bold red",
    ExitCode.INTERNAL_ERROR: "bold red",
}
