"""A bounded, seeded byte-mutation fuzz of the two binary formats, through the CLI.

300 mutated files (200 safetensors, 100 torch zip checkpoints) made with a fixed
seed, so every run and every machine tests the same bytes. They are scanned by
one worker process (``tests/fuzz_worker.py``) so that a signal kills the worker,
not pytest, and names the case in flight. For every file: no traceback, no hang,
no signal, the file unchanged, and an exit code of 0, 1 or 3 — with exactly one
``gradaudit: error: FILE: …`` line for 3 and nothing on stderr otherwise.

The mutations aim where parsers break: most land in the safetensors header (its
length field included) or anywhere in the zip (local headers, the central
directory); some rewrite ``data.pkl`` with its CRC fixed so the bytes reach the
unpickler; others truncate or extend the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.hostile import data_pkl, member_span, patch_member

#: Slow (not in the quick loop): hundreds of mutated files through a worker process.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SEED = 20261125
SAFETENSORS_CASES = 200
ZIP_CASES = 100


def _flip(rng: random.Random, data: bytearray, start: int, end: int) -> None:
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(start, end)] = rng.randrange(256)


def mutate_safetensors(rng: random.Random, base: bytes) -> bytes:
    data = bytearray(base)
    header_end = 8 + int.from_bytes(base[:8], "little")
    kind = rng.random()
    if kind < 0.45:
        _flip(rng, data, 0, header_end)
    elif kind < 0.6:
        _flip(rng, data, 0, len(data))
    elif kind < 0.72:
        del data[rng.randrange(1, len(data)) :]
    elif kind < 0.8:
        data += rng.randbytes(rng.randint(1, 16))
    elif kind < 0.9:
        length = rng.choice([0, 1, 7, header_end - 9, header_end + 1, 2**63, 2**64 - 1])
        length = rng.choice([length, rng.randrange(2**64)])
        data[:8] = length.to_bytes(8, "little")
    else:
        start = rng.randrange(8, header_end)
        del data[start : start + rng.randint(1, 8)]
    return bytes(data)


def mutate_zip(rng: random.Random, base: bytes, path: Path, pickle_name: str) -> None:
    """Write a mutated copy of the checkpoint ``base`` to ``path``."""
    data = bytearray(base)
    kind = rng.random()
    if kind < 0.45:
        _flip(rng, data, 0, len(data))
    elif kind < 0.65:
        path.write_bytes(base)
        start, size = member_span(path, pickle_name)
        member = bytearray(base[start : start + size])
        _flip(rng, member, 0, size)
        patch_member(path, pickle_name, bytes(member))  # CRC fixed: the unpickler sees it
        return
    elif kind < 0.8:
        del data[rng.randrange(1, len(data)) :]
    else:
        _flip(rng, data, max(0, len(data) - 200), len(data))  # central directory, end record
    path.write_bytes(bytes(data))


def build_cases(folder: Path) -> list[Path]:
    rng = random.Random(SEED)
    # Exact values (no random tensors: their last bits may differ between CPUs), so the
    # same bytes are mutated the same way on every machine.
    ramp = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.75
    base_st = folder / "base.safetensors"
    save_file(
        {
            "a.weight": ramp,
            "b.bias": torch.tensor([float("nan"), 1.0]),
            "c.half": ramp[0].half(),
            "d.bf16": ramp[1:].bfloat16(),
            "steps": torch.arange(3),
        },
        str(base_st),
    )
    base_zip = folder / "base.pt"
    torch.save({"model": {"w": ramp.t(), "b": torch.ones(2)}, "step": 3}, base_zip)
    st_bytes, zip_bytes = base_st.read_bytes(), base_zip.read_bytes()
    pickle_name = data_pkl(base_zip)
    cases = []
    for index in range(SAFETENSORS_CASES):
        path = folder / f"st{index:03d}.safetensors"
        path.write_bytes(mutate_safetensors(rng, st_bytes))
        cases.append(path)
    for index in range(ZIP_CASES):
        path = folder / f"zip{index:03d}.pt"
        mutate_zip(rng, zip_bytes, path, pickle_name)
        cases.append(path)
    return cases


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], dict[str, str], Any]:
    folder = tmp_path_factory.mktemp("fuzz")
    cases = build_cases(folder)
    before = {str(path): digest(path) for path in cases}
    manifest = folder / "manifest.txt"
    manifest.write_text("\n".join(map(str, cases)) + "\n", encoding="utf-8")
    worker = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_worker", str(manifest)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
        check=False,
    )
    return cases, before, worker


def test_the_worker_ends_normally(fuzzed: tuple[list[Path], dict[str, str], Any]) -> None:
    _, _, worker = fuzzed
    starts = [line for line in worker.stdout.splitlines() if line.startswith("start ")]
    in_flight = starts[-1] if starts else "before the first case"
    # A negative code is a signal (-7 SIGBUS, -11 SIGSEGV) while scanning ``in_flight``.
    assert worker.returncode == 0, (worker.returncode, in_flight, worker.stderr[-2000:])


def test_every_mutation_is_audited_or_refused_cleanly(
    fuzzed: tuple[list[Path], dict[str, str], Any],
) -> None:
    cases, _, worker = fuzzed
    outcomes = [json.loads(line) for line in worker.stdout.splitlines() if line.startswith("{")]
    assert [o["path"] for o in outcomes] == [str(path) for path in cases]
    codes: Counter[int] = Counter()
    for outcome in outcomes:
        path = outcome["path"]
        assert not outcome.get("hang"), f"{path}: still running after 20 s"
        assert outcome["exception"] is None, (path, outcome["exception"])
        code = outcome["exit_code"]
        codes[code] += 1
        assert code in (0, 1, 3), (path, code, outcome["stderr"])
        assert "Traceback" not in outcome["stdout"] + outcome["stderr"], path
        lines = outcome["stderr"].splitlines()
        if code == 3:
            assert len(lines) == 1, (path, outcome["stderr"])
            assert lines[0].startswith(f"gradaudit: error: {path}: ") or (
                lines[0].startswith("gradaudit: error: nothing to audit")
            ), lines[0]
        else:
            assert lines == [], (path, outcome["stderr"])
            assert json.loads(outcome["stdout"])["exit_code"] == code
    # The mutations really reach both outcomes: some files still audit, most are refused.
    assert codes[3] > 0
    assert codes[0] + codes[1] > 0


def test_no_input_was_modified(fuzzed: tuple[list[Path], dict[str, str], Any]) -> None:
    cases, before, _ = fuzzed
    assert {str(path): digest(path) for path in cases} == before


def test_the_cases_are_the_same_on_every_run(tmp_path: Path) -> None:
    """Seeded: the same bytes each time."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = [digest(p) for p in build_cases(tmp_path / "one")]
    second = [digest(p) for p in build_cases(tmp_path / "two")]
    assert first == second
