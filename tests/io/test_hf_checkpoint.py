"""A real ``transformers`` Trainer checkpoint directory, scanned as one checkpoint."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaudit import scan_paths
from gradaudit.io.hf_checkpoint import trainer_grad_norms
from gradaudit.results.verdict import exit_code
from tests.conftest import runner
from tests.hostile import OpenMarker, marker
from tests.models import tiny_hf_bert

# The Trainer writes these checkpoints: the `transformers` extra (CI's main leg installs it;
# the torch-floor leg, on a torch that transformers 5 refuses, does not).
pytest.importorskip("transformers", reason="the transformers extra is not installed")
pytest.importorskip("accelerate", reason="the transformers extra is not installed")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Three optimizer steps of a tiny config-built BERT, checkpointed at step 3."""
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("hf")
    model = tiny_hf_bert()
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, 50, (8,), generator=gen), "labels": torch.tensor(i % 2)}
        for i in range(12)
    ]
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        save_steps=3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return out / "checkpoint-3", trainer.state.log_history


def test_scanned_as_one_checkpoint_with_the_same_stats_as_its_files(
    checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, _ = checkpoint
    report = scan_paths([directory], device="cpu")
    assert not report.errors
    assert [f.path for f in report.files] == [str(directory)]
    whole = {t.name: t for t in report.tensors}
    model = scan_paths([directory / "model.safetensors"], device="cpu")
    optimizer = scan_paths([directory / "optimizer.pt"], device="cpu")
    expected = {t.name: t for t in model.tensors}
    expected.update({f"optimizer.{t.name}": t for t in optimizer.tensors})
    assert sorted(whole) == sorted(expected)
    assert "classifier.weight" in whole
    assert "optimizer.state.0.exp_avg" in whole  # two param groups: no parameter name guessed
    for name, stats in whole.items():
        other = expected[name]
        assert (stats.shape, stats.nan, stats.zeros, stats.max_abs, stats.norm) == (
            other.shape,
            other.nan,
            other.zeros,
            other.max_abs,
            other.norm,
        )
    skipped = {s.name: s.reason for s in report.skipped}
    assert "never unpickled" in skipped["training_args.bin"]
    assert "not read" in skipped["scheduler.pt"]
    assert "not read" in skipped["rng_state.pth"]


def test_logged_grad_norms_are_judged_beside_the_report(
    checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    directory, history = checkpoint
    logged = [(row["step"], row["grad_norm"]) for row in history if "grad_norm" in row]
    assert len(logged) == 3
    assert trainer_grad_norms(str(directory)) == logged
    report = scan_paths([directory], device="cpu")
    assert exit_code(report) == 0
    (judged,) = report.histories
    assert (judged.file, judged.rows) == (str(directory), 3)
    step, last = logged[-1]
    assert f"grad_norm {last:.4g} at step {step}" in judged.note
    assert "trainer_state.json" not in {s.name for s in report.skipped}
    alone = scan_paths([directory / "trainer_state.json"], device="cpu")
    assert exit_code(alone) == 0  # a log judged is something audited, not "nothing to audit"
    assert [h.rows for h in alone.histories] == [3]

    from gradaudit.cli import app

    both = runner.invoke(
        app,
        ["scan", str(directory / "trainer_state.json"), str(directory / "model.safetensors")],
        env={"COLUMNS": "200"},
    )
    assert "nothing to audit" not in both.stdout  # the files table: the log was judged


def _train(out: Path, learning_rate: float, steps: int) -> Path:
    from transformers import Trainer, TrainingArguments

    model = tiny_hf_bert()
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, 50, (8,), generator=gen), "labels": torch.tensor(i % 2)}
        for i in range(4 * steps)
    ]
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=steps,
        logging_steps=1,
        save_steps=steps,
        learning_rate=learning_rate,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return out / f"checkpoint-{steps}"


def test_a_run_that_diverged_fails_on_its_own_log_with_the_step(tmp_path: Path) -> None:
    """Learning rate 1e4: the loss climbs to ~1e5 within a few steps, every tensor stays
    finite, and the Trainer's log says so; the directory and the log alone both fail."""
    import json

    directory = _train(tmp_path, learning_rate=1e4, steps=8)
    history = json.loads((directory / "trainer_state.json").read_text())["log_history"]
    first = history[0]["loss"]
    worst = max((row for row in history if "loss" in row), key=lambda row: row["loss"])
    assert worst["loss"] > 100 * first  # the premise: the real Trainer's run diverged
    for path in (directory, directory / "trainer_state.json"):
        report = scan_paths([path], device="cpu")
        assert exit_code(report) == 1
        (finding,) = [f for f in report.findings if f.tensor == "log_history.loss"]
        assert finding.failing
        assert finding.kind.value == "exploding"
        assert f"at step {worst['step']}" in finding.message


def test_training_args_are_never_unpickled(
    checkpoint: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    source, _ = checkpoint
    directory = tmp_path / "checkpoint-3"
    directory.mkdir()
    for path in source.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    with (directory / "training_args.bin").open("wb") as handle:
        pickle.dump(OpenMarker(marker(tmp_path)), handle)
    report = scan_paths([tmp_path], device="cpu", recursive=True)
    assert not report.errors
    assert [f.path for f in report.files] == [str(directory)]
    assert not marker(tmp_path).exists()


def test_include_selects_the_optimizer_state(
    checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    report = scan_paths([checkpoint[0]], device="cpu", include=["optimizer.*.exp_avg_sq"])
    names = [t.name for t in report.tensors]
    assert names
    assert all(n.startswith("optimizer.state.") and n.endswith(".exp_avg_sq") for n in names)


def test_a_checkpoints_bookkeeping_files_scanned_alone_say_what_they_are(
    checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    """rng_state.pth was "refused as unsafe" and scheduler.pt printed "Audited 0 tensors …
    health 0.000" before INCOMPLETE: scary or empty words for files every Trainer writes."""

    from gradaudit.cli import app

    directory, _ = checkpoint
    for name, what in (
        ("rng_state.pth", "random-number-generator state"),
        ("training_args.bin", "TrainingArguments"),
    ):
        result = runner.invoke(app, ["scan", str(directory / name), "--no-config"])
        assert result.exit_code == 3
        assert what in result.stderr
        assert "unsafe" not in result.stderr
        assert "scan its checkpoint directory" in result.stderr
    result = runner.invoke(app, ["scan", str(directory / "scheduler.pt"), "--no-config"])
    assert result.exit_code == 3
    assert "Audited 0 tensors" not in result.stdout
    assert "health" not in result.stdout
    assert "INCOMPLETE: nothing to audit" in result.stdout


def test_every_role_of_a_trainer_checkpoint_survives_the_directory(
    checkpoint: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Scanned as a directory the optimizer state was read as weights (84 wrong roles, no
    gradient estimates, 65 outlier warnings); as optimizer.pt alone it was right."""
    from gradaudit.policy import InputKind, Role, Thresholds

    directory, _ = checkpoint
    report = scan_paths([directory], device="cpu")
    alone = scan_paths([directory / "optimizer.pt"], device="cpu")
    roles = {t.name: t.role for t in report.tensors}
    for stats in alone.tensors:
        assert roles[f"optimizer.{stats.name}"] is stats.role
    assert {roles[n] for n in roles if n.endswith(".exp_avg_sq")} == {Role.OPTIMIZER_SECOND_MOMENT}
    model = {t.name for t in scan_paths([directory / "model.safetensors"], device="cpu").tensors}
    assert {roles[n] for n in model} == {Role.WEIGHT}
    assert len(report.estimates) == len(alone.estimates) > 0
    assert exit_code(report) == 0
    assert report.summary.warnings <= 3
    # --kind says what model files hold; optimizer state keeps its role.
    forced = scan_paths([directory], device="cpu", thresholds=Thresholds(kind=InputKind.GRADIENTS))
    assert {t.role for t in forced.tensors if t.name in model} == {Role.GRADIENT}
    assert {t.role for t in forced.tensors if t.name.endswith(".exp_avg")} == {
        Role.OPTIMIZER_MOMENT
    }
