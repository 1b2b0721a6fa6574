"""One registry of output formats: every format renders every result type, chunk by chunk.

Each ``report/formats/<format>.py`` renders a scan, a comparison and a trend;
:func:`~gradaudit.report.formats.renderers` maps each :class:`OutputFormat` to
that module's renderers (mypy checks it is exhaustive through ``assert_never``;
this checks it at run time). No format module imports another's renderer.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
from pathlib import Path

import pytest
import torch

from gradaudit import audit
from gradaudit.cli.config import Settings
from gradaudit.cli.output import emit
from gradaudit.report import OutputFormat, RenderOptions, render, render_text, renderers
from gradaudit.results import Report
from gradaudit.results.comparison import Comparison
from gradaudit.results.trend import TrendReport
from gradaudit.trend.builder import TrendBuilder
from tests.samples import sample_comparison, sample_report

FORMATS_DIR = Path(__file__).resolve().parents[2] / "gradaudit" / "report" / "formats"


def sample_trend() -> TrendReport:
    builder = TrendBuilder()
    for step, scale in enumerate((1.0, 1.1, 0.9, 1.0, 50.0)):
        builder.add(step, f"step_{step}.safetensors", audit({"layer.w": torch.full((4,), scale)}))
    return builder.finish()


def results() -> list[Report | Comparison | TrendReport]:
    return [sample_report(), sample_comparison(), sample_trend()]


@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_format_renders_every_result_type(fmt: OutputFormat) -> None:
    module = importlib.import_module(f"gradaudit.report.formats.{fmt.value}")
    assert renderers(fmt) is module.RENDERERS
    for result in results():
        chunks = list(render(result, fmt, RenderOptions()))
        assert chunks
        assert all(isinstance(chunk, str) for chunk in chunks)
        text = "".join(chunks)
        assert text.endswith("\n")
        assert text == render_text(result, fmt, RenderOptions())


def test_the_registry_has_one_module_per_format() -> None:
    modules = {p.stem for p in FORMATS_DIR.glob("*.py") if p.stem != "__init__"}
    assert modules == {fmt.value for fmt in OutputFormat}


def test_no_format_module_imports_another_format() -> None:
    for path in FORMATS_DIR.glob("*.py"):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = [
            node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
        ]
        assert not [m for m in imported if m.startswith("gradaudit.report.formats")], path.name


def test_scan_json_is_yielded_tensor_by_tensor() -> None:
    report = audit({f"layer.{i}.weight": torch.full((3,), float(i)) for i in range(200)})
    chunks = list(render(report, OutputFormat.JSON, RenderOptions()))
    # The head (everything before the tensors), one chunk per tensor, the tail.
    assert len(chunks) == len(report.tensors) + 2
    assert max(len(chunk) for chunk in chunks[1:-1]) < 1000
    document = json.loads("".join(chunks))
    assert [t["name"] for t in document["tensors"]] == [t.name for t in report.tensors]


class _Recording(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_the_cli_writes_each_chunk_as_it_comes(monkeypatch: pytest.MonkeyPatch) -> None:
    report = audit({f"t{i}": torch.ones(2) for i in range(50)})
    stdout = _Recording()
    monkeypatch.setattr("sys.stdout", stdout)
    emit(render(report, OutputFormat.JSON, RenderOptions()), Settings())
    assert len(stdout.writes) == 52
    assert stdout.getvalue() == render_text(report, OutputFormat.JSON)


def test_output_files_are_written_chunk_by_chunk(tmp_path: Path) -> None:
    report = audit({f"t{i}": torch.ones(2) for i in range(50)})
    target = tmp_path / "report.json"
    emit(render(report, OutputFormat.JSON, RenderOptions()), Settings(output=target, quiet=True))
    assert target.read_text(encoding="utf-8") == render_text(report, OutputFormat.JSON)
