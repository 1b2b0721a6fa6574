"""``gradaudit compare --format json``: one strictly valid JSON document, same content as the table.

The dual stats sit under ``"dual"`` with the keys ``host_norm``, ``seed_norm``,
``host_params``, ``seed_params``, ``raw_ratio`` and ``normalized_ratio``. A ratio
that is not defined is ``null`` and ``ratio_note`` says why; an infinite one is
the string ``"Infinity"`` (JSON has no Infinity, see :func:`encode_float`).
Unlike the table, every shared tensor, name and finding is listed. The document
is described by ``gradaudit/schema/comparison.schema.json``.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from gradaudit import __version__
from gradaudit.compare.checks import comparison_exit_code
from gradaudit.compare.model import (
    ComparePolicy,
    Comparison,
    DualGradientStats,
    ParameterChange,
    ParameterComparison,
    SideStats,
)
from gradaudit.report.base import RenderOptions
from gradaudit.report.compare_text import (
    FORMULA,
    ab_mode,
    change_order,
    failing_count,
    ignored_count,
    interpretation,
    warning_count,
)
from gradaudit.report.json_report import encode_float, thresholds_document
from gradaudit.results import LimitFinding

#: Bumped whenever a field changes meaning or disappears; adding a field keeps it.
COMPARISON_SCHEMA_VERSION = 1


def comparison_json_schema() -> dict[str, Any]:
    """The JSON Schema of the document :func:`render_comparison_json` writes (shipped)."""
    files = resources.files("gradaudit").joinpath("schema").joinpath("comparison.schema.json")
    schema: dict[str, Any] = json.loads(files.read_text("utf-8"))
    return schema


def _dual(dual: DualGradientStats) -> dict[str, Any]:
    return {
        "host_norm": encode_float(dual.host_norm),
        "seed_norm": encode_float(dual.seed_norm),
        "host_params": dual.host_params,
        "seed_params": dual.seed_params,
        "raw_ratio": encode_float(dual.raw_ratio),
        "normalized_ratio": encode_float(dual.normalized_ratio),
        "formula": FORMULA,
        "ratio_note": dual.ratio_note,
    }


def _side(side: SideStats) -> dict[str, Any]:
    return {
        "path": side.path,
        "prefix": side.prefix,
        "tensors": side.tensors,
        "skipped": side.skipped,
        "params": side.params,
        "norm": encode_float(side.norm),
        "norm_per_sqrt_param": encode_float(side.norm_per_sqrt_param),
        "nan": side.nan,
        "inf": side.inf,
        "nan_tensors": side.nan_tensors,
        "inf_tensors": side.inf_tensors,
        "vanishing_tensors": side.vanishing_tensors,
        "exploding_tensors": side.exploding_tensors,
    }


def _change(change: ParameterChange) -> dict[str, Any]:
    return {
        "name": change.name,
        "shape": list(change.shape),
        "dtype_a": change.dtype_a,
        "dtype_b": change.dtype_b,
        "norm_a": encode_float(change.norm_a),
        "norm_b": encode_float(change.norm_b),
        "ratio": encode_float(change.ratio),
        "relative_change": encode_float(change.relative_change),
        "flagged": change.flagged,
        "note": change.note,
    }


def _parameters(parameters: ParameterComparison | None) -> dict[str, Any] | None:
    if parameters is None:
        return None
    return {
        "max_change": encode_float(parameters.max_change),
        "shared": len(parameters.changes),
        "flagged": len(parameters.flagged),
        "changes": [_change(c) for c in sorted(parameters.changes, key=change_order)],
        "only_in_a": list(parameters.only_in_a),
        "only_in_b": list(parameters.only_in_b),
        "mismatches": [
            {
                "name": m.name,
                "shape_a": list(m.shape_a),
                "shape_b": list(m.shape_b),
                "dtype_a": m.dtype_a,
                "dtype_b": m.dtype_b,
                "differs": [
                    what
                    for what, yes in (("shape", m.shape_differs), ("dtype", m.dtype_differs))
                    if yes
                ],
            }
            for m in parameters.mismatches
        ],
    }


def _limit(finding: LimitFinding) -> dict[str, Any]:
    return {
        "kind": finding.kind.value,
        "severity": finding.severity.value,
        "side": finding.source,
        "value": encode_float(finding.value),
        "limit": encode_float(finding.limit),
        "message": finding.message,
    }


def _policy(policy: ComparePolicy) -> dict[str, Any]:
    return {
        "min_ratio": encode_float(policy.min_ratio),
        "max_ratio": encode_float(policy.max_ratio),
        "max_change": encode_float(policy.max_change),
        "fail_on_change": policy.fail_on_change,
    }


def to_comparison_document(comparison: Comparison) -> dict[str, Any]:
    """The JSON document as Python data (also handy for library users)."""
    report = comparison.report
    return {
        "schema_version": COMPARISON_SCHEMA_VERSION,
        "kind": "comparison",
        "gradaudit_version": __version__,
        "device": report.device,
        "engine": report.engine,
        "elapsed_s": round(report.elapsed_s, 6),
        "thresholds": thresholds_document(report.thresholds),
        "policy": _policy(comparison.policy),
        "host": _side(comparison.dual.host),
        "seed": _side(comparison.dual.seed),
        "dual": _dual(comparison.dual),
        "interpretation": interpretation(comparison.dual, ab_mode(comparison)),
        "parameters": _parameters(comparison.parameters),
        "findings": [
            {"kind": f.kind.value, "severity": f.severity.value, "message": f.message}
            for f in comparison.findings
        ],
        "tensor_findings": [
            {
                "side": f.source,
                "tensor": f.tensor,
                "kind": f.kind.value,
                "severity": f.severity.value,
                "message": f.message,
            }
            for f in comparison.tensor_findings
        ],
        "limits": [_limit(f) for f in report.limit_findings],
        "skipped": [{"side": s.source, "name": s.name, "reason": s.reason} for s in report.skipped],
        "errors": [{"file": e.path, "message": e.message} for e in comparison.errors],
        "summary": {
            "failing_findings": failing_count(comparison),
            "warnings": warning_count(comparison),
            "ignored_findings": ignored_count(comparison),
            "input_errors": len(comparison.errors),
        },
        "exit_code": int(comparison_exit_code(comparison)),
    }


def render_comparison_json(comparison: Comparison, options: RenderOptions) -> str:
    return json.dumps(to_comparison_document(comparison), indent=2, allow_nan=False) + "\n"
