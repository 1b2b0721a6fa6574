"""``--format json``: one strictly valid JSON document with everything a result holds.

A scan, a comparison and a trend each have their own document, described by a
JSON Schema shipped in ``gradaudit/schema/`` (``report``, ``comparison`` and
``trend.schema.json``; :func:`json_schema` loads one). JSON has no NaN or
Infinity: non-finite numbers are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``, and a value that does not exist (the RMS of
a tensor without finite elements) as ``null``. Unlike the human formats, every
tensor, shared name and finding is listed.

The comparison's dual stats sit under ``"dual"`` with the keys ``host_norm``,
``seed_norm``, ``host_params``, ``seed_params``, ``raw_ratio`` and
``normalized_ratio``. A ratio that is not defined is ``null`` and
``ratio_note`` says why.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any, Literal

from gradaudit import __version__
from gradaudit.grouping import GroupMode
from gradaudit.policy import DEFAULT_OUTLIER_DECADES, FindingKind, Thresholds
from gradaudit.precision.formats import FORMATS
from gradaudit.precision.headroom import Headroom
from gradaudit.precision.judging import PrecisionReport
from gradaudit.report.base import Renderers, RenderOptions
from gradaudit.report.compare_text import (
    ALL,
    FORMULA,
    ab_mode,
    compared,
    failing_count,
    ignored_count,
    interpretation,
    ordered_changes,
    side_of,
    warning_count,
)
from gradaudit.report.verdict import (
    any_finite,
    findings_by_tensor,
    history_findings,
    tensor_findings,
)
from gradaudit.results import (
    Finding,
    GradientEstimate,
    InputProblem,
    LimitFinding,
    LoggedHistory,
    OutlierReference,
    Report,
    TensorStats,
)
from gradaudit.results.comparison import (
    ComparePolicy,
    Comparison,
    DualGradientStats,
    ParameterChange,
    ParameterComparison,
    SideStats,
)
from gradaudit.results.trend import MIN_COLLAPSE_STEPS, MIN_SPIKE_HISTORY, TrendKind, TrendReport
from gradaudit.results.verdict import comparison_exit_code, exit_code, trend_exit_code

#: Each document's version, bumped whenever a field changes meaning or disappears
#: (adding a field keeps it). The documents are described by ``gradaudit/schema/``.
#: Scan 2: tensors have roles, and findings depend on them (a weight has no norm thresholds).
SCHEMA_VERSION = 2
#: Comparison 1. An exceeded limit is a scan's limit object (``"file"``: the side's
#: file) plus ``"side"``; ``"file"`` was added, nothing removed, so the version stays.
COMPARISON_SCHEMA_VERSION = 1
TREND_SCHEMA_VERSION = 1

Document = Literal["report", "comparison", "trend"]


def _error(problem: InputProblem) -> dict[str, Any]:
    """An input that could not be audited; ``internal`` only when a defect in gradaudit
    cost it (exit code 4), so documents of ordinary runs are unchanged."""
    entry: dict[str, Any] = {"file": problem.path, "message": problem.message}
    if problem.internal:
        entry["internal"] = True
    return entry


def json_schema(document: Document = "report") -> dict[str, Any]:
    """The JSON Schema of a scan's (``report``), a comparison's or a trend's document.

    Shipped with the package, in ``gradaudit/schema/<document>.schema.json``.
    """
    text = (
        resources.files("gradaudit")
        .joinpath("schema")
        .joinpath(f"{document}.schema.json")
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


def _history(report: Report, history: LoggedHistory) -> dict[str, Any]:
    return {
        "file": history.file,
        "steps": history.rows,
        "note": history.note,
        "findings": [{"name": f.tensor, **_finding(f)} for f in history_findings(report, history)],
    }


def _limit(finding: LimitFinding, file: str | None) -> dict[str, Any]:
    return {
        "kind": finding.kind.value,
        "severity": finding.severity.value,
        "file": file,
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
        # No finite element: null, never a 0 that reads as a dead layer (the counts say why).
        "max_abs": None if stats.unmeasured else encode_float(stats.max_abs),
        "norm": None if stats.unmeasured else encode_float(stats.norm),
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
    by_tensor = findings_by_tensor(report, kinds=(FindingKind.SKIPPED,))
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
        "limits": [_limit(f, f.source) for f in report.limit_findings],
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
        "errors": [_error(e) for e in report.errors],
        "history": [_history(report, h) for h in report.histories],
        "summary": {
            "tensors": summary.tensors,
            "skipped": summary.skipped,
            "elements": summary.elements,
            # Nothing audited has no norm; 0 would read as "all gradients are zero".
            "global_norm": (encode_float(summary.global_norm) if any_finite(report) else None),
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
    } | ({} if report.headroom is None else {"headroom": _headroom(report.headroom)})


def _headroom_row(row: Headroom) -> dict[str, Any]:
    return {
        "name": row.name,
        "file": row.source,
        "nonzero": row.nonzero,
        "flushed": row.flushed,
        "subnormal": row.subnormal,
        "overflowed": row.overflowed,
        "flushed_fraction": encode_float(row.flushed_fraction),
        "subnormal_fraction": encode_float(row.subnormal_fraction),
        "overflowed_fraction": encode_float(row.overflowed_fraction),
        "min_exponent": row.min_exponent,
        "max_exponent": row.max_exponent,
        "scale_log2": row.scale_log2,
    }


def _headroom(headroom: PrecisionReport) -> dict[str, Any]:
    """``scan --precision``: what the table format prints after the report, as data."""
    spec = FORMATS[headroom.precision]
    histogram = headroom.histogram
    return {
        "precision": headroom.precision.value,
        "dtype": spec.dtype,
        "max_underflow": encode_float(headroom.max_underflow),
        "format": {
            "min_subnormal": spec.min_subnormal,
            "min_normal": spec.min_normal,
            "max": spec.max,
            "flush_from": spec.flush_from,
            "normal_from": spec.normal_from,
            "overflow_from": spec.overflow_from,
            "overflow_result": spec.overflow_result,
        },
        "total": _headroom_row(headroom.total),
        "layers": [_headroom_row(row) for row in headroom.layers],
        "tensors": [_headroom_row(row) for row in headroom.tensors],
        "histogram": {
            "zeros": histogram.zeros,
            "nonfinite": histogram.nonfinite,
            "exponents": [
                {"exponent": e, "count": c} for e, c in sorted(histogram.exponents().items())
            ],
        },
        "findings": [
            {
                "kind": f.kind,
                "tensor": f.tensor,
                "file": f.source,
                "fraction": encode_float(f.fraction),
                "message": f.message,
            }
            for f in headroom.findings
        ],
    }


def _tensors(report: Report) -> Iterator[dict[str, Any]]:
    policy = report.thresholds
    for t, found in tensor_findings(report):
        yield _tensor(t, found, policy.ignored_by(t.name) if policy.ignore else None)


#: The top-level ``tensors`` key as ``json.dumps(indent=2)`` writes an empty list. Nothing
#: else can produce this line: strings never hold a raw newline, nested keys are indented deeper.
_TENSORS_LINE = '\n  "tensors": [],\n'


def render_scan(report: Report, options: RenderOptions) -> Iterator[str]:
    """The document, indented, with one line per tensor, yielded tensor by tensor.

    ``json.dumps(indent=...)`` runs the pure-Python encoder: a million tensors
    (a LoRA or MoE dump) took most of a minute and gigabytes of objects. Each
    tensor is written by the C encoder on its own line instead, from a
    generator, and the rest of the document keeps its indentation; the text of
    a million tensors is never one string.
    """
    head, tail = json.dumps(to_document(report, tensors=False), indent=2, allow_nan=False).split(
        _TENSORS_LINE
    )
    if not report.tensors:
        yield f"{head}{_TENSORS_LINE}{tail}\n"
        return
    encode = json.JSONEncoder(allow_nan=False).encode
    yield f'{head}\n  "tensors": [\n    '
    for index, tensor in enumerate(_tensors(report)):
        yield (",\n    " if index else "") + encode(tensor)
    yield f"\n  ],\n{tail}\n"


# ---------------------------------------------------------------------------- compare


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


class _Streamed(list):  # type: ignore[type-arg]
    """A list as json's indenting encoder sees it, whose items are made as it writes them.

    ``json.JSONEncoder(indent=...)`` walks lists with a Python ``for`` and tests them
    with ``len``, so a million shared tensors or findings are written as they are
    built, in the very text ``json.dumps`` gives, and never all exist at once. Only
    for that encoder: the C one (no indent) would see an empty list.
    """

    def __init__(self, count: int, items: Callable[[], Iterator[Any]]) -> None:
        super().__init__()
        self._count = count
        self._items = items

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        return self._items()


def _parameters(
    parameters: ParameterComparison | None, stream: bool = False
) -> dict[str, Any] | None:
    if parameters is None:
        return None
    changes = parameters.changes

    def ordered() -> Iterator[dict[str, Any]]:
        return map(_change, ordered_changes(parameters, ALL, None, stream=True)[0])

    return {
        "max_change": encode_float(parameters.max_change),
        "shared": len(changes),
        "flagged": len(parameters.flagged),
        "changes": _Streamed(len(changes), ordered) if stream else list(ordered()),
        "only_in_a": list(parameters.only_in_a),
        "only_in_b": list(parameters.only_in_b),
        "identical": parameters.identical,
        "first_difference": parameters.first_difference,
        "differing": parameters.differing,
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


def _side_limit(comparison: Comparison, finding: LimitFinding) -> dict[str, Any]:
    """A limit one side exceeded: the scan's limit object, its ``file`` that side's input."""
    side = side_of(comparison, finding.source)
    return {**_limit(finding, None if side is None else side.path), "side": finding.source}


def _compare_policy(policy: ComparePolicy) -> dict[str, Any]:
    return {
        "min_ratio": encode_float(policy.min_ratio),
        "max_ratio": encode_float(policy.max_ratio),
        "max_change": encode_float(policy.max_change),
        "fail_on_change": policy.fail_on_change,
    }


def to_comparison_document(comparison: Comparison, *, stream: bool = False) -> dict[str, Any]:
    """The JSON document as Python data (also handy for library users).

    ``stream=True`` makes the shared tensors and the per-tensor findings lists that
    are built as ``json.JSONEncoder(indent=2)`` writes them (:func:`render_compare`).
    """
    report = comparison.report
    findings = comparison.tensor_findings

    def tensor_findings() -> Iterator[dict[str, Any]]:
        for f in findings:
            yield {
                "side": f.source,
                "tensor": f.tensor,
                "kind": f.kind.value,
                "severity": f.severity.value,
                "message": f.message,
            }

    return {
        "schema_version": COMPARISON_SCHEMA_VERSION,
        "kind": "comparison",
        "gradaudit_version": __version__,
        "device": report.device,
        "engine": report.engine,
        "elapsed_s": round(report.elapsed_s, 6),
        "thresholds": thresholds_document(report.thresholds),
        "policy": _compare_policy(comparison.policy),
        "host": _side(comparison.dual.host),
        "seed": _side(comparison.dual.seed),
        "dual": _dual(comparison.dual),
        "interpretation": interpretation(
            comparison.dual, ab_mode(comparison), compared(comparison)
        ),
        "parameters": _parameters(comparison.parameters, stream),
        "findings": [
            {"kind": f.kind.value, "severity": f.severity.value, "message": f.message}
            for f in comparison.findings
        ],
        "tensor_findings": (
            _Streamed(len(findings), tensor_findings) if stream else list(tensor_findings())
        ),
        "limits": [_side_limit(comparison, f) for f in report.limit_findings],
        "skipped": [{"side": s.source, "name": s.name, "reason": s.reason} for s in report.skipped],
        "errors": [_error(e) for e in comparison.errors],
        "summary": {
            "failing_findings": failing_count(comparison),
            "warnings": warning_count(comparison),
            "ignored_findings": ignored_count(comparison),
            "input_errors": len(comparison.errors),
        },
        "exit_code": int(comparison_exit_code(comparison)),
    }


def render_compare(comparison: Comparison, options: RenderOptions) -> Iterator[str]:
    """The comparison document, indented; every shared tensor, name and finding.

    The text ``json.dumps(indent=2)`` gives, yielded as it is encoded, in pieces of
    :data:`_PIECE` chunks: a million shared tensors are never one string.
    """
    encoder = json.JSONEncoder(indent=2, allow_nan=False)
    chunks = encoder.iterencode(to_comparison_document(comparison, stream=True))
    while piece := "".join(itertools.islice(chunks, _PIECE)):
        yield piece
    yield "\n"


#: The encoder's chunks joined per piece of output (a few per JSON value).
_PIECE = 1 << 14


# ---------------------------------------------------------------------------- trend


def _floats(values: Sequence[float | None]) -> list[float | str | None]:
    return [encode_float(v) for v in values]


def trend_document(report: TrendReport) -> dict[str, Any]:
    """The trend JSON document as Python data."""
    policy = report.policy
    spec = report.group_by
    first_nonfinite = next((f.step for f in report.findings if f.kind is TrendKind.NONFINITE), None)
    return {
        "schema_version": TREND_SCHEMA_VERSION,
        "gradaudit_version": __version__,
        "command": "trend",
        "device": report.device,
        "engine": report.engine,
        "elapsed_s": round(report.elapsed_s, 6),
        "group_by": {
            "mode": spec.mode.value,
            "depth": spec.depth if spec.mode is GroupMode.DEPTH else None,
            "auto": spec.chosen,
        },
        "policy": {
            "spike_factor": encode_float(policy.spike_factor),
            "vanishing": encode_float(policy.vanishing),
            "fail_on": sorted(kind.value for kind in policy.fail_on),
            "min_spike_history": MIN_SPIKE_HISTORY,
            "min_collapse_steps": MIN_COLLAPSE_STEPS,
        },
        "steps": [
            {
                "step": s.step,
                "file": s.path,
                "tensors": s.tensors,
                "global_norm": encode_float(s.global_norm),
                "nonfinite_tensors": s.nonfinite_tensors,
                "gradient_health": encode_float(s.gradient_health),
                "read_as": s.read_as,
            }
            for s in report.steps
        ],
        "layers": [
            {
                "name": layer.name,
                "norms": _floats(layer.norms),
                "max_abs": _floats(layer.max_abs),
                "nonfinite": list(layer.nonfinite),
                "spikes": [
                    {
                        "step": s.step,
                        "norm": encode_float(s.norm),
                        "median": encode_float(s.median),
                        "ratio": encode_float(s.ratio),
                    }
                    for s in layer.spikes
                ],
                "first_nonfinite_step": layer.first_nonfinite_step,
                "collapse_step": layer.collapse_step,
            }
            for layer in report.layers
        ],
        "findings": [
            {
                "kind": f.kind.value,
                "severity": f.severity.value,
                "layer": f.layer,
                "step": f.step,
                "file": f.path,
                "message": f.message,
                "tensors": [
                    {
                        "name": t.name,
                        "layer": t.layer,
                        "nan": t.nan,
                        "pos_inf": t.pos_inf,
                        "neg_inf": t.neg_inf,
                    }
                    for t in f.tensors
                ],
            }
            for f in report.findings
        ],
        "errors": [_error(e) for e in report.errors],
        "summary": {
            "dumps": len(report.steps),
            "layers": len(report.layers),
            "first_nonfinite_step": first_nonfinite,
            "failing_findings": sum(1 for f in report.findings if f.failing),
            "warnings": sum(1 for f in report.findings if not f.failing),
            "input_errors": len(report.errors),
        },
        "exit_code": int(trend_exit_code(report)),
    }


def render_trend(report: TrendReport, options: RenderOptions) -> Iterator[str]:
    """The trend document, indented: every step, layer and finding."""
    yield json.dumps(trend_document(report), indent=2, allow_nan=False) + "\n"


RENDERERS = Renderers(scan=render_scan, compare=render_compare, trend=render_trend)
