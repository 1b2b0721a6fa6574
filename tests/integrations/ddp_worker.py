"""One rank of the framework DDP tests: ``python -m tests.integrations.ddp_worker RANK WORLD DIR``.

``GRADAUDIT_FRAMEWORK`` picks the framework (``transformers``, ``lightning``, ``accelerate``);
each trains a tiny model for :data:`STEPS` optimizer steps under real gloo DDP on the CPU
(the framework's own DDP set-up, from the torchrun variables this sets), audited by the
framework's gradaudit hook with ``every=1, on_divergence="warn"``. After the backward of
step :data:`PERTURBED_STEP`, when DDP has all-reduced the gradients and before the hook
reads them, rank 1 adds 1e-3 to one element of :data:`PERTURBED` [framework]: the other
steps are healthy. Each rank writes what its monitor(s) saw to ``DIR/rank{RANK}.json``; the
assertions live in ``tests/integrations/test_ddp.py``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.ranks import finish_rank

#: Optimizer steps trained; the step (numbered as the hook numbers it) whose gradient
#: rank 1 perturbs.
STEPS = 4
PERTURBED_STEP = {"transformers": 3, "lightning": 2, "accelerate": 2}
#: The parameter whose gradient rank 1 perturbs, by framework (the hook's names).
PERTURBED = {
    "transformers": "classifier.weight",
    "lightning": "net.2.weight",
    "accelerate": "2.weight",
}


def _perturb(parameter: torch.Tensor) -> None:
    assert parameter.grad is not None
    parameter.grad[0, 0] += 1e-3


def _seen(monitor: Any) -> list[dict[str, Any] | None]:
    from tests.training.replica_worker import describe

    return [describe(record) for record in monitor.history]


def transformers_run(rank: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from gradaudit.integrations.hf import GradauditTrainerCallback
    from tests.models import tiny_hf_bert

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(index)
            return {
                "input_ids": torch.randint(0, 50, (8,), generator=gen),
                "labels": torch.tensor(index % 2),
            }

    class PerturbingTrainer(Trainer):  # type: ignore[misc]
        """Rank 1 perturbs one gradient after the step's backward (DDP has all-reduced it),
        before the Trainer's clip, inside which the callback reads the gradients."""

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().training_step(model, inputs, *args, **kwargs)
            if rank == 1 and self.state.global_step + 1 == PERTURBED_STEP["transformers"]:
                _perturb(self.model.classifier.weight)
            return loss

    callback = GradauditTrainerCallback(every=1, dump_dir=None, on_divergence="warn")
    args = TrainingArguments(
        output_dir=str(Path(sys.argv[3]) / f"out{rank}"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = PerturbingTrainer(
        model=tiny_hf_bert(), args=args, train_dataset=Data(), callbacks=[callback]
    )
    trainer.train()
    assert callback.monitor is not None
    return {
        "wrapper": type(trainer.model_wrapped).__name__,
        "seen": _seen(callback.monitor),
        "logged": [
            row.get("gradaudit/replicas/differing")
            for row in trainer.state.log_history
            if "loss" in row
        ],
    }


def lightning_run(rank: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    from gradaudit.integrations.lightning import GradauditLightningCallback

    class Regressor(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
            )

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_after_backward(self) -> None:
            # The callback numbers each optimizer's steps from 0: global_step is that.
            if rank == 1 and self.trainer.global_step == PERTURBED_STEP["lightning"]:
                _perturb(self.net[2].weight)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 6, generator=gen), torch.randn(64, 2, generator=gen)
    )
    callback = GradauditLightningCallback(every=1, dump_dir=None, on_divergence="warn", log=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=4))
    return {"seen": _seen(callback.monitors[0])}


def accelerate_run(rank: int) -> dict[str, Any]:
    from accelerate import Accelerator

    from gradaudit import GradientMonitor
    from gradaudit.integrations.accelerate import accelerate_step

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    options: dict[str, Any] = {"every": 1, "sync": True, "dump_dir": None}
    # Built before prepare, over the module DDP will wrap: accelerate_step says it cannot
    # check across ranks (Accelerate keeps no reference to the wrapper).
    before = GradientMonitor(module, **options)
    model, optimizer = accelerator.prepare(module, optimizer)
    after = GradientMonitor(model, on_divergence="warn", **options)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    for step in range(STEPS):
        accelerator.backward(model(torch.randn(4, 6, generator=gen)).pow(2).mean())
        if rank == 1 and step == PERTURBED_STEP["accelerate"]:
            _perturb(module[2].weight)
        accelerate_step(accelerator, before, optimizer)
        accelerate_step(accelerator, after, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "wrapper": type(model).__name__,
        "seen": _seen(before),
        "seen_prepared": _seen(after),
    }


RUNS = {"transformers": transformers_run, "lightning": lightning_run, "accelerate": accelerate_run}


def main() -> None:
    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    framework = os.environ["GRADAUDIT_FRAMEWORK"]
    # What torchrun sets for each rank: every framework sets DDP up from these.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = RUNS[framework](rank)
    import gradaudit

    result["warnings"] = [
        str(w.message) for w in caught if w.category is gradaudit.ReplicaDivergenceWarning
    ]
    result["told"] = [str(w.message) for w in caught if "across ranks" in str(w.message)]
    finish_rank(out, rank, result)


if __name__ == "__main__":
    main()
