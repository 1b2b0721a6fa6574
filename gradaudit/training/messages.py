"""What a monitor says: its warnings' and errors' text, and the metadata of its dumps.

The text names at most :data:`NAMES_SHOWN` tensors or findings ("and N more"): a step
with a thousand NaN gradients must still give a readable warning. A dump's metadata
says why it was written (the step whose stats showed NaN/Inf, a divergence, failing
findings), so ``gradaudit trend`` can place a dump written one call late.
"""

from __future__ import annotations

from gradaudit.results import Finding
from gradaudit.results.trend import NONFINITE_STEP_KEY
from gradaudit.training.locate import Location
from gradaudit.training.record import MonitorRecord

#: Names listed in a warning or error message before "and N more".
NAMES_SHOWN = 5


def nonfinite_metadata(record: MonitorRecord) -> dict[str, str]:
    return {NONFINITE_STEP_KEY: str(record.step), "nonfinite_tensors": nonfinite_names(record)}


def divergence_metadata(record: MonitorRecord) -> dict[str, str]:
    assert record.replicas is not None
    assert record.replicas.divergence is not None
    divergence = record.replicas.divergence
    return {
        "divergence_step": str(record.step),
        "divergent_tensor": divergence.tensor,
        "divergent_ranks": ",".join(map(str, divergence.ranks)),
    }


def finding_metadata(record: MonitorRecord) -> dict[str, str]:
    return {"finding_step": str(record.step), "findings": finding_names(record.failing_findings)}


def finding_names(findings: tuple[Finding, ...]) -> str:
    shown = [f"{f.kind.value} {f.tensor} ({f.message})" for f in findings[:NAMES_SHOWN]]
    more = len(findings) - NAMES_SHOWN
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def finding_message(
    record: MonitorRecord, findings: tuple[Finding, ...] | list[Finding], now: int, *, new: bool
) -> str:
    count = len(findings)
    what = "gradient finding" if new else "failing gradient finding"
    text = (
        f"step {record.step}: {count} {what}{'s' if count != 1 else ''} "
        f"(global norm {record.global_norm:.4g}): {finding_names(tuple(findings))}"
    )
    return text + dump_note(record, now)


def dump_note(record: MonitorRecord, now: int) -> str:
    """Where the step's gradients were written, or why they were not (empty: no dump)."""
    if record.dump is not None:
        return f"; gradients of step {now} written to {record.dump}"
    if record.dump_error is not None:
        return f"; no dump written ({record.dump_error})"
    return ""


def nonfinite_names(record: MonitorRecord) -> str:
    shown = [
        f"{t.name} ({_counts(t.nan, t.pos_inf, t.neg_inf)})"
        for t in record.report.tensors
        if t.nonfinite
    ]
    more = len(shown) - NAMES_SHOWN
    return ", ".join(shown[:NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _counts(nan: int, pos_inf: int, neg_inf: int) -> str:
    parts = [f"{n} {label}" for n, label in ((nan, "NaN"), (pos_inf, "+Inf"), (neg_inf, "-Inf"))]
    return ", ".join(p for p in parts if not p.startswith("0 "))


def nonfinite_message(record: MonitorRecord, now: int, location: Location | None = None) -> str:
    count = len(record.nonfinite)
    text = (
        f"step {record.step}: NaN/Inf gradients in {count} tensor"
        f"{'s' if count != 1 else ''}: {nonfinite_names(record)}"
    )
    if location is not None:
        text += "; located: " + location.describe().replace("\n", "; ")
    return text + dump_note(record, now)
