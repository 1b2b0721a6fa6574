"""Every command's table at real terminal widths, with real-length parameter names.

Each flagged tensor's name (whole, or its distinguishing end after ``…``) must be
on its row next to its numbers, no line may exceed the width, and no number may
be cut. The names are those of a BERT encoder (~45 characters), as a user sees
them; the CLI runs through ``CliRunner`` with a fixed ``COLUMNS``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rich.cells import cell_len
from safetensors.torch import save_file

from gradaudit.cli import app
from gradaudit.report.fit import DEFAULT_WIDTH, Column, fit, sane_width, shorten_left
from gradaudit.report.text import number
from tests.conftest import runner

WIDTHS = (60, 80, 100, 120, 200)


def bert_gradients(layers: int = 4, hidden: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gradients named like a BERT encoder's, with three planted problems."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1e-2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    grads = {
        "embeddings.word_embeddings.weight": rand(50, hidden),
        "embeddings.position_embeddings.weight": rand(32, hidden),
        "embeddings.LayerNorm.weight": rand(hidden),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in ("attention.self.query", "attention.self.value", "attention.output.dense"):
            grads[p + part + ".weight"] = rand(hidden, hidden)
            grads[p + part + ".bias"] = rand(hidden)
        grads[p + "attention.self.key.weight"] = rand(hidden, hidden)
        grads[p + "attention.self.key.bias"] = rand(hidden, scale=1e-12)  # vanishing
        grads[p + "intermediate.dense.weight"] = rand(4 * hidden, hidden)
        grads[p + "output.dense.weight"] = rand(hidden, 4 * hidden)
        grads[p + "output.LayerNorm.weight"] = rand(hidden)
    if layers >= 4:
        grads["encoder.layer.3.output.dense.weight"][0, 0] = float("nan")
        grads["encoder.layer.2.intermediate.dense.weight"] *= 1e5  # exploding
    return grads


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("widths")
    grads = bert_gradients()
    save_file(grads, str(root / "a.safetensors"))
    changed = {k: v.clone() for k, v in grads.items()}
    changed["encoder.layer.1.attention.output.dense.weight"] *= 50
    changed["encoder.layer.0.intermediate.dense.weight"] *= 1e21
    save_file(changed, str(root / "b.safetensors"))
    both = {f"host.{k}": v for k, v in grads.items()}
    both.update({f"seed.{k}": v * 3 for k, v in list(grads.items())[:12]})
    save_file(both, str(root / "hostseed.safetensors"))
    series = root / "series"
    series.mkdir()
    for step in range(20):
        g = {k: v * (1 + 0.01 * step) for k, v in bert_gradients(layers=2).items()}
        if step == 12:
            g = {k: v * 1e4 if "intermediate" in k else v for k, v in g.items()}
        save_file(g, str(series / f"step_{step}.safetensors"), metadata={"step": str(step)})
    return {"a": root / "a.safetensors", "b": root / "b.safetensors", "hs": both_path(root)}


def both_path(root: Path) -> Path:
    return root / "hostseed.safetensors"


def invoke(width: int, *args: str) -> str:
    result = runner.invoke(app, list(args), env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code in (0, 1), result.output
    return result.stdout


def _lines_fit(text: str, width: int) -> None:
    for line in text.splitlines():
        assert cell_len(line) <= width, f"line wider than {width}: {line!r}"


def _matches(short: str, name: str) -> bool:
    """Whether ``short`` (``…end`` or ``…3.…end``) is ``name`` with parts elided by ``…``."""
    pieces = [p for p in short.split("…") if p]
    if not pieces or not name.endswith(pieces[-1]):
        return False
    at = 0
    for piece in pieces:
        found = name.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def _row_of(text: str, name: str, names: list[str]) -> str:
    """The line holding ``name`` whole, or shortened with ``…`` into a form no other name has."""
    for line in text.splitlines():
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", line):
            return line
        for match in re.finditer(r"…[\w.…]+", line):
            short = match.group(0)
            if _matches(short, name) and len(short) >= 12:
                assert [n for n in names if _matches(short, n)] == [name], (
                    f"{short!r} does not tell {name} apart"
                )
                return line
    raise AssertionError(f"{name} is on no row:\n{text}")


def _whole(line: str, value: str) -> None:
    """``value`` stands whole in a cell of ``line``: not cut, not glued to something else."""
    assert re.search(rf"[\s│]{re.escape(value)}[\s│]", line), f"{value!r} cut in {line!r}"


@pytest.mark.parametrize("width", WIDTHS)
def test_scan_table_keeps_flagged_names_and_numbers(dumps: dict[str, Path], width: int) -> None:
    grads = bert_gradients()
    names = list(grads)
    text = invoke(width, "scan", str(dumps["a"]), "--no-chart")
    _lines_fit(text, width)
    flagged = {
        "encoder.layer.2.intermediate.dense.weight": "exploding",
        "encoder.layer.3.output.dense.weight": "nan",
        **{f"encoder.layer.{i}.attention.self.key.bias": "vanishing" for i in range(4)},
    }
    for name, status in flagged.items():
        row = _row_of(text, name, names)
        assert status in row
        norm = torch.linalg.vector_norm(grads[name][grads[name].isfinite()].double()).item()
        _whole(row, number(norm))
    assert "┏┳┳" not in text  # the name column never collapses


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_tables_keep_flagged_names_and_ratios(dumps: dict[str, Path], width: int) -> None:
    names = list(bert_gradients())
    text = invoke(width, "compare", str(dumps["a"]), str(dumps["b"]))
    _lines_fit(text, width)
    row = _row_of(text, "encoder.layer.0.intermediate.dense.weight", names)
    assert "changed" in row
    _whole(row, "1e+21")
    row = _row_of(text, "encoder.layer.1.attention.output.dense.weight", names)
    _whole(row, "50")
    hs = invoke(
        width, "compare", str(dumps["hs"]), "--host-prefix", "host.", "--seed-prefix", "seed."
    )
    _lines_fit(hs, width)
    assert "host (A)" in hs
    assert "seed (B)" in hs


@pytest.mark.parametrize("width", WIDTHS)
def test_trend_table_keeps_flagged_layers(dumps: dict[str, Path], width: int) -> None:
    series = dumps["a"].parent / "series"
    layers = sorted({n.rsplit(".", 1)[0] for n in bert_gradients(layers=2)})
    text = invoke(width, "trend", str(series))
    _lines_fit(text, width)
    for layer in ("encoder.layer.0.intermediate.dense", "encoder.layer.1.intermediate.dense"):
        row = _row_of(text, layer, layers)
        assert "spike@12" in row
    spark = next(line for line in text.splitlines() if "(global)" in line)
    assert "█" in spark  # the spike stays visible however narrow


def test_a_width_of_zero_or_an_absurd_one_falls_back() -> None:
    assert sane_width(0) == sane_width(-3) == sane_width(None) == DEFAULT_WIDTH
    assert sane_width(10**6) == DEFAULT_WIDTH
    assert sane_width(5) == 40
    assert sane_width(97) == 97


def test_a_terminal_of_zero_columns_still_gets_the_report(dumps: dict[str, Path]) -> None:
    """``script -qc "gradaudit scan …" /dev/null`` reports 0 columns: output must not vanish."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gradaudit", "scan", str(dumps["a"]), "--no-chart"],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    chunks = list(_read_all(master))
    os.close(master)
    assert process.wait(timeout=60) == 1
    text = b"".join(chunks).decode("utf-8", "replace")
    assert "encoder.layer.2.intermediate.dense.weight" in text
    assert "FAIL" in text


def _read_all(fd: int) -> Iterator[bytes]:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed its end
            return
        if not chunk:
            return
        yield chunk


def test_shorten_left_keeps_the_distinguishing_end() -> None:
    name = "encoder.layer.0.attention.self.key.bias"
    assert shorten_left(name, 80) == name
    short = shorten_left(name, 32)
    assert short == "…layer.0.attention.self.key.bias"
    assert len(shorten_left(name, 20)) <= 20
    assert shorten_left(name, 20).endswith("key.bias")
    # The layer index tells rows apart: it stays even when the middle has to go.
    assert shorten_left("encoder.layer.0.intermediate.dense.weight", 20) == "…0.…dense.weight"
    for cells in range(12, 41):
        short = shorten_left("encoder.layer.0.intermediate.dense.weight", cells)
        assert len(short) <= cells
        assert "0." in short
        assert short.endswith("weight")
    assert shorten_left("x" * 50 + ".bias", 12) == "…" + ("x" * 50 + ".bias")[-11:]


def test_a_ten_thousand_character_name_takes_one_row(tmp_path: Path) -> None:
    long = "x" * 9_990 + ".key.bias"
    path = tmp_path / "long.safetensors"
    save_file({long: torch.zeros(3), "fine.weight": torch.ones(3)}, str(path))
    text = invoke(80, "scan", str(path), "--no-chart")
    _lines_fit(text, 80)
    rows = [line for line in text.splitlines() if "vanishing" in line and "│" in line]
    assert len(rows) == 1
    assert rows[0].split("│")[1].strip().endswith("x.key.bias")
    assert len(text.splitlines()) < 20


def test_fit_drops_low_priority_columns_before_cutting_a_name() -> None:
    name = "encoder.layer.3.attention.self.query.weight"
    columns = [
        Column("name", [name], kind="name"),
        Column("norm", ["1.23e+04"], "right"),
        Column("low", ["x" * 10], priority=1),
        Column("high", ["y" * 10], priority=2),
    ]
    layout = fit(columns, 90)
    assert layout.dropped == ()
    layout = fit(columns, 80)
    assert layout.dropped == ("low",)
    assert layout.columns[0].cells == (name,)
    layout = fit(columns, 40)
    assert set(layout.dropped) == {"low", "high"}
    assert str(layout.columns[0].cells[0]).startswith("…")
    assert [c.header for c in layout.columns] == ["name", "norm"]


def test_json_is_unaffected_by_width(dumps: dict[str, Path]) -> None:
    narrow = json.loads(invoke(60, "scan", str(dumps["a"]), "-f", "json"))
    wide = json.loads(invoke(200, "scan", str(dumps["a"]), "-f", "json"))
    assert [t["name"] for t in narrow["tensors"]] == [t["name"] for t in wide["tensors"]]


def test_paths_keep_the_file_name() -> None:
    from gradaudit.report.fit import shorten_path

    assert shorten_path("/tmp/runs/exp-3/hostseed.safetensors", 24) == "…hostseed.safetensors"
    assert shorten_path("hostseed.safetensors", 14) == "…d.safetensors"  # never "…safetensors"
    assert shorten_path("a.safetensors", 24) == "a.safetensors"
