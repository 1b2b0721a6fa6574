"""What ``per_layer=True`` costs a Lightning step: every parameter's norm is one ``pl_module.log``.

Times ``Trainer.fit`` with ``log_every_n_steps=1`` (every step logged) on a stack of small
``Linear`` layers, with and without ``per_layer``, in one process, and prints the difference
per parameter per logged step. ``python -m benchmarks.bench_lightning_per_layer``.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch


def _fit(layers: int, steps: int, *, per_layer: bool) -> float:
    import lightning as pl

    from gradaudit.integrations.lightning import GradauditLightningCallback

    class Stack(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return self.layers(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    callback = GradauditLightningCallback(per_layer=per_layer, dump_dir=None, on_finding="ignore")
    trainer = pl.Trainer(
        max_steps=steps,
        log_every_n_steps=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    data = torch.utils.data.DataLoader(torch.randn(steps * 2, 4), batch_size=2)
    start = time.perf_counter()
    trainer.fit(Stack(), data)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    params = 2 * args.layers
    for _ in range(2):  # interleaved, twice: a noisy neighbour slows both alike
        plain = _fit(args.layers, args.steps, per_layer=False)
        each = _fit(args.layers, args.steps, per_layer=True)
        print(
            f"{params} parameters: per_layer=False {plain * 1e3:.1f} ms/step, "
            f"per_layer=True {each * 1e3:.1f} ms/step: "
            f"{(each - plain) / params * 1e3:.3f} ms per parameter per logged step"
        )


if __name__ == "__main__":
    main()
