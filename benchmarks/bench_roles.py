"""How reliable the role decision is, and what reading a checkpoint's optimizer state costs.

Three measurements, all on models built from configs (nothing is downloaded):

1. The guess from the values (:func:`gradaudit.roles.stats_evidence`) on randomly initialised
   ``torch.nn`` stacks and their gradients: how often each is misread.
2. The outlier limits on a BERT-style encoder after a few AdamW steps: warnings on the healthy
   weights and gradients, and how often one layer scaled by 1e3 or 1e-4 is flagged.
3. The cost of a training checkpoint's scan (with its derived rows: second-moment sums and
   minima, step counters) against the same tensors in a flat safetensors file, in one run.

    python -m benchmarks.bench_roles [--models 600] [--seeds 3] [--hidden 384]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from gradaudit import Thresholds, audit, scan_paths
from gradaudit.policy import InputKind, Role
from gradaudit.roles import stats_evidence
from tests.models import BertLike, bert_like, gradients, train, weights

SCALED = (
    "encoder.layer.0.intermediate.dense.weight",
    "encoder.layer.1.attention.output.dense.weight",
    "pooler.dense.weight",
    "encoder.layer.1.output.dense.weight",
    "encoder.layer.0.attention.self.value.weight",
    "embeddings.word_embeddings.weight",
    "encoder.layer.1.intermediate.dense.bias",
    "encoder.layer.0.output.LayerNorm.weight",
)


def _random_stack(rng: random.Random) -> tuple[nn.Sequential, bool, bool]:
    width = rng.choice([8, 16, 32, 64, 128])
    embed = rng.random() < 0.3
    use_norm = rng.random() < 0.7
    layers: list[nn.Module] = [nn.Embedding(50, width)] if embed else []
    for _ in range(rng.randint(1, 4)):
        out = rng.choice([8, 16, 32, 64, 128])
        layers.append(nn.Linear(width, out))
        if use_norm:
            norm = nn.LayerNorm if embed else rng.choice([nn.LayerNorm, nn.BatchNorm1d])
            layers.append(norm(out))
        layers.append(nn.ReLU())
        width = out
    layers.append(nn.Linear(width, rng.choice([1, 4, 10])))
    return nn.Sequential(*layers), embed, use_norm


def value_guess(models: int) -> None:
    rng = random.Random(1)
    torch.manual_seed(1)
    weights_misread = gradients_misread = with_norm = with_norm_misread = 0
    for _ in range(models):
        model, embed, use_norm = _random_stack(rng)
        batch = rng.choice([2, 8, 32])
        first = model[0]
        assert isinstance(first, nn.Embedding | nn.Linear)
        x = (
            torch.randint(0, 50, (batch,))
            if embed
            else torch.randn(batch, first.weight.shape[1]) * rng.choice([0.1, 1.0, 10.0])
        )
        out = model(x)
        loss = (out - torch.randn_like(out)).pow(2)
        (loss.sum() if rng.random() < 0.3 else loss.mean()).backward()
        state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        weight_role = stats_evidence(audit(state).tensors).role
        gradient_role = stats_evidence(audit(gradients(model)).tensors).role
        weights_misread += weight_role is not Role.WEIGHT
        gradients_misread += gradient_role is not Role.GRADIENT
        with_norm += use_norm
        with_norm_misread += use_norm and weight_role is not Role.WEIGHT
    print(
        f"guess from values, {models} random stacks: gradient files read as weights "
        f"{gradients_misread}/{models}; weight files with a norm layer read as gradients "
        f"{with_norm_misread}/{with_norm}; all weight files read as gradients "
        f"{weights_misread}/{models} ({weights_misread / models:.1%}, said to be thin)"
    )


def outliers(seeds: int) -> None:
    print("role | healthy outlier warnings | scaled layer: outlier | any magnitude finding")
    for kind in (InputKind.WEIGHTS, InputKind.GRADIENTS):
        healthy = tensors = as_outlier = flagged = trials = 0
        policy = Thresholds(kind=kind)
        for seed in range(seeds):
            model = bert_like(seed)
            train(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), seed=seed)
            source = weights(model) if kind is InputKind.WEIGHTS else gradients(model)
            state = {k: v for k, v in source.items() if v.is_floating_point()}
            report = audit(state, thresholds=policy)
            healthy += sum(f.kind.value == "outlier" for f in report.findings)
            tensors += len(report.tensors)
            for factor in (1e3, 1e-4):
                for name in SCALED:
                    scaled = dict(state, **{name: state[name] * factor})
                    kinds = {
                        f.kind.value
                        for f in audit(scaled, thresholds=policy).findings
                        if f.tensor == name
                    }
                    as_outlier += "outlier" in kinds
                    flagged += bool(kinds & {"outlier", "exploding", "vanishing"})
                    trials += 1
        print(f"{kind.value} | {healthy} of {tensors} | {as_outlier}/{trials} | {flagged}/{trials}")


def checkpoint_cost(hidden: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = BertLike(vocab=30522, hidden=hidden, layers=6, heads=12)
    optimizer = train(model, lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-4))
    state = optimizer.state_dict()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Path(folder) / "ckpt.pt"
        flat = Path(folder) / "flat.safetensors"
        torch.save({"model": model.state_dict(), "optimizer": state}, checkpoint)
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        for index, entry in state["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"optimizer.{index}.{key}"] = entry[key]
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(flat))
        every = list(tensors.values())

        def best(run: object) -> float:
            assert callable(run)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            return min(times)

        summed = best(lambda: [t.sum() for t in every])
        report = scan_paths([checkpoint], device="cpu")
        assert len(report.estimates) == len(list(model.parameters()))
        scan_checkpoint = best(lambda: scan_paths([checkpoint], device="cpu"))
        scan_flat = best(lambda: scan_paths([flat], device="cpu"))
    mib = sum(t.numel() * t.element_size() for t in every) / 2**20
    print(
        f"checkpoint of {mib:.0f} MiB, best of {repeats}: one torch.sum pass {summed:.3f} s; "
        f"flat file {scan_flat:.3f} s ({scan_flat / summed:.1f}x sum); checkpoint with "
        f"estimates {scan_checkpoint:.3f} s ({scan_checkpoint / summed:.1f}x sum, "
        f"{scan_checkpoint / scan_flat:.2f}x the flat file)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    value_guess(args.models)
    outliers(args.seeds)
    checkpoint_cost(args.hidden, args.repeats)


if __name__ == "__main__":
    main()
