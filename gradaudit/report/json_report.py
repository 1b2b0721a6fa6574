"""``--format json``: one strictly valid JSON document with everything the report holds.

JSON has no NaN or Infinity: non-finite numbers are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, and a value that does not exist
(the RMS of a tensor without finite elements) as ``null``.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

from gradaudit import __version__
from gradaudit.checks import exit_code
from gradaudit.policy import FindingKind, Thresholds
from gradaudit.report.base import RenderOptions
from gradaudit.report.verdict import findings_by_tensor
from gradaudit.results import Finding, LimitFinding, Report, TensorStats

#: Bumped whenever a field changes meaning or disappears; adding a field keeps it.
#: The document is described by ``gradaudit/schema/report.schema.json``.
SCHEMA_VERSION = 1


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the document :func:`render_json` writes (shipped with the package)."""
    text = (
        resources.files("gradaudit")
        .joinpath("schema")
        .joinpath("report.schema.json")
        .read_text("utf-8")
    )
    schema: dict[str, Any] = json.loads(text)
    return schema


def encode_float(value: float | None) -> float | str | None:
    """A float as JSON can carry it."""
    if value is None or math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def thresholds_document(thresholds: Thresholds) -> dict[str, Any]:
    """The ``thresholds`` object, shared by every JSON document that judged tensors."""
    return {
        "vanishing": encode_float(thresholds.vanishing),
        "exploding": encode_float(thresholds.exploding),
        "fail_on": sorted(kind.value for kind in thresholds.fail_on),
        "max_global_norm": encode_float(thresholds.max_global_norm),
        "max_vanishing_fraction": encode_float(thresholds.max_vanishing_fraction),
        "ignore": list(thresholds.ignore),
    }


def _finding(finding: Finding) -> dict[str, Any]:
    return {
        "kind": finding.kind.value,
        "severity": finding.severity.value,
        "message": finding.message,
    }


def _limit(finding: LimitFinding) -> dict[str, Any]:
    return {
        "kind": finding.kind.value,
        "severity": finding.severity.value,
        "file": finding.source,
        "value": encode_float(finding.value),
        "limit": encode_float(finding.limit),
        "message": finding.message,
    }


def _tensor(stats: TensorStats, findings: list[Finding], ignored_by: str | None) -> dict[str, Any]:
    return {
        "name": stats.name,
        "file": stats.source,
        "shape": list(stats.shape),
        "dtype": stats.dtype,
        "numel": stats.numel,
        "nan": stats.nan,
        "pos_inf": stats.pos_inf,
        "neg_inf": stats.neg_inf,
        "zeros": stats.zeros,
        "zero_fraction": encode_float(stats.zero_fraction),
        "max_abs": encode_float(stats.max_abs),
        "norm": encode_float(stats.norm),
        "rms": encode_float(stats.rms),
        "findings": [_finding(f) for f in findings],
        "ignored_by": ignored_by,
    }


def to_document(report: Report) -> dict[str, Any]:
    """The JSON document as Python data (also handy for library users)."""
    by_tensor = findings_by_tensor(report)
    summary = report.summary
    policy = report.thresholds
    return {
        "schema_version": SCHEMA_VERSION,
        "gradaudit_version": __version__,
        "device": report.device,
        "engine": report.engine,
        "elapsed_s": round(report.elapsed_s, 6),
        "thresholds": thresholds_document(report.thresholds),
        "files": [
            {
                "path": f.path,
                "tensors": f.tensors,
                "skipped": f.skipped,
                "elements": f.elements,
                "global_norm": encode_float(f.global_norm),
                "error": f.error,
                "excluded": f.excluded,
            }
            for f in report.files
        ],
        "tensors": [
            _tensor(t, by_tensor.get((t.source, t.name), []), policy.ignored_by(t.name))
            for t in report.tensors
        ],
        "limits": [_limit(f) for f in report.limit_findings],
        "skipped": [
            {
                "name": s.name,
                "file": s.source,
                "reason": s.reason,
                "unaudited": s.unaudited,
                "findings": [
                    _finding(f)
                    for f in by_tensor.get((s.source, s.name), [])
                    if f.kind is FindingKind.SKIPPED
                ],
            }
            for s in report.skipped
        ],
        "errors": [{"file": e.path, "message": e.message} for e in report.errors],
        "summary": {
            "tensors": summary.tensors,
            "skipped": summary.skipped,
            "elements": summary.elements,
            "global_norm": encode_float(summary.global_norm),
            "nan_tensors": summary.nan_tensors,
            "inf_tensors": summary.inf_tensors,
            "vanishing_tensors": summary.vanishing_tensors,
            "exploding_tensors": summary.exploding_tensors,
            "failing_findings": summary.failing_findings,
            "warnings": summary.warnings,
            "ignored_findings": summary.ignored_findings,
            "input_errors": len(report.errors),
            "excluded": summary.excluded,
        },
        "exit_code": int(exit_code(report)),
    }


def render_json(report: Report, options: RenderOptions) -> str:
    return json.dumps(to_document(report), indent=2, allow_nan=False) + "\n"
