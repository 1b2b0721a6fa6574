"""``--format json``: one strictly valid JSON document with everything the report holds.

JSON has no NaN or Infinity: non-finite numbers are written as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, and a value that does not exist
(the RMS of a tensor without finite elements) as ``null``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from importlib import resources
from typing import Any

from gradaudit import __version__
from gradaudit.policy import DEFAULT_OUTLIER_DECADES, FindingKind, Thresholds
from gradaudit.report.base import RenderOptions
from gradaudit.report.verdict import findings_by_tensor
from gradaudit.results import (
    Finding,
    GradientEstimate,
    LimitFinding,
    OutlierReference,
    Report,
    TensorStats,
)
from gradaudit.scan.judge import exit_code

#: Bumped whenever a field changes meaning or disappears; adding a field keeps it.
#: The document is described by ``gradaudit/schema/report.schema.json``.
#: 2: tensors have roles, and findings depend on them (a weight has no norm thresholds).
SCHEMA_VERSION = 2


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
        "role": stats.role.value,
        "role_evidence": stats.role_evidence,
    }


def _estimate(estimate: GradientEstimate) -> dict[str, Any]:
    return {
        "parameter": estimate.parameter,
        "tensor": estimate.tensor,
        "file": estimate.source,
        "basis": estimate.basis,
        "rms_norm": encode_float(estimate.rms_norm),
        "mean_norm": encode_float(estimate.mean_norm),
        "step": encode_float(estimate.step),
        "bias_corrected": estimate.bias_corrected,
    }


def _reference(reference: OutlierReference) -> dict[str, Any]:
    return {
        "role": reference.role.value,
        "shapes": reference.shapes,
        "file": reference.source,
        "tensors": reference.tensors,
        "median_log10_rms": encode_float(reference.median),
        "spread_decades": encode_float(reference.spread),
        "limit_decades": encode_float(reference.limit),
    }


def to_document(report: Report, *, tensors: bool = True) -> dict[str, Any]:
    """The JSON document as Python data (also handy for library users).

    ``tensors=False`` leaves the ``tensors`` list empty (:func:`render_json`
    writes it line by line).
    """
    summary = report.summary
    by_tensor = findings_by_tensor(report)
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
                "read_as": f.read_as,
                "read_as_evidence": f.read_as_evidence,
                "evidence_thin": f.evidence_thin,
            }
            for f in report.files
        ],
        "tensors": list(_tensors(report)) if tensors else [],
        "limits": [_limit(f) for f in report.limit_findings],
        "roles": {
            "kind": policy.kind.value,
            "cast_check": policy.cast_check,
            "outlier_decades": encode_float(policy.outlier_decades),
            "default_outlier_decades": {
                role.value: limit for role, limit in DEFAULT_OUTLIER_DECADES.items()
            },
        },
        "gradient_estimates": [_estimate(e) for e in report.estimates],
        "outlier_references": [_reference(r) for r in report.outlier_references],
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
            # Nothing audited has no norm; 0 would read as "all gradients are zero".
            "global_norm": encode_float(summary.global_norm) if summary.tensors else None,
            "nan_tensors": summary.nan_tensors,
            "inf_tensors": summary.inf_tensors,
            "vanishing_tensors": summary.vanishing_tensors,
            "exploding_tensors": summary.exploding_tensors,
            "failing_findings": summary.failing_findings,
            "warnings": summary.warnings,
            "ignored_findings": summary.ignored_findings,
            "input_errors": len(report.errors),
            "excluded": summary.excluded,
            "outlier_tensors": summary.outlier_tensors,
            "gradient_health": encode_float(summary.gradient_health),
        },
        "exit_code": int(exit_code(report)),
    }


def _tensors(report: Report) -> Iterator[dict[str, Any]]:
    by_tensor = findings_by_tensor(report)
    policy = report.thresholds
    for t in report.tensors:
        yield _tensor(t, by_tensor.get((t.source, t.name), []), policy.ignored_by(t.name))


#: The top-level ``tensors`` key as ``json.dumps(indent=2)`` writes an empty list. Nothing
#: else can produce this line: strings never hold a raw newline, nested keys are indented deeper.
_TENSORS_LINE = '\n  "tensors": [],\n'


def render_json(report: Report, options: RenderOptions) -> str:
    """The document, indented, with one line per tensor.

    ``json.dumps(indent=...)`` runs the pure-Python encoder: a million tensors
    (a LoRA or MoE dump) took most of a minute and gigabytes of objects. Each
    tensor is written by the C encoder on its own line instead, from a
    generator, and the rest of the document keeps its indentation.
    """
    head, tail = json.dumps(to_document(report, tensors=False), indent=2, allow_nan=False).split(
        _TENSORS_LINE
    )
    if not report.tensors:
        return f"{head}{_TENSORS_LINE}{tail}\n"
    encode = json.JSONEncoder(allow_nan=False).encode
    rows = ",\n    ".join(map(encode, _tensors(report)))
    return f'{head}\n  "tensors": [\n    {rows}\n  ],\n{tail}\n'
