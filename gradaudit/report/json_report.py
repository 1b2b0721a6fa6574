"""``--format json``: one strictly valid JSON document with everything the report holds.

JSON has no NaN or Infinity: non-finite numbers are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, and a value that does not exist
(the RMS of a tensor without finite elements) as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gradaudit import __version__
from gradaudit.checks import exit_code
from gradaudit.policy import Thresholds
from gradaudit.report.base import RenderOptions
from gradaudit.results import Finding, Report, TensorStats

#: Bumped whenever a field changes meaning or disappears; adding a field keeps it.
SCHEMA_VERSION = 1


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
    }


def _finding(finding: Finding) -> dict[str, Any]:
    return {
        "kind": finding.kind.value,
        "severity": finding.severity.value,
        "message": finding.message,
    }


def _tensor(stats: TensorStats, findings: list[Finding]) -> dict[str, Any]:
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
    }


def to_document(report: Report) -> dict[str, Any]:
    """The JSON document as Python data (also handy for library users)."""
    by_tensor: dict[tuple[str | None, str], list[Finding]] = {}
    for finding in report.findings:
        by_tensor.setdefault((finding.source, finding.tensor), []).append(finding)
    summary = report.summary
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
            }
            for f in report.files
        ],
        "tensors": [_tensor(t, by_tensor.get((t.source, t.name), [])) for t in report.tensors],
        "skipped": [{"name": s.name, "file": s.source, "reason": s.reason} for s in report.skipped],
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
            "input_errors": len(report.errors),
        },
        "exit_code": int(exit_code(report)),
    }


def render_json(report: Report, options: RenderOptions) -> str:
    return json.dumps(to_document(report), indent=2, allow_nan=False) + "\n"
