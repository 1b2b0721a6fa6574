"""Real gradients for the compare tests: a small host model with a seed module grafted on.

In morphogenetic training a small *seed* is grafted onto a large *host*; here the host
is the fixtures' TinyLM and the seed a bottleneck adapter added residually after the
first block. One forward and backward pass on fixed random tokens gives real
gradients for both. Kept tiny so the tests stay fast; the benchmark builds a
~100M-parameter version of the same thing.
"""

from __future__ import annotations

import torch
from torch import nn

from fixtures.make_fixtures import VOCAB, WIDTH, TinyLM


class Seed(nn.Module):
    """A bottleneck adapter: the grafted module whose learning is judged."""

    def __init__(self, width: int = WIDTH, bottleneck: int = 4) -> None:
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(x)))


class Grafted(nn.Module):
    """``host`` (a TinyLM) with ``seed`` applied after its first block."""

    def __init__(self) -> None:
        super().__init__()
        self.host = TinyLM()
        self.seed = Seed()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.host.embed(tokens)
        for index, layer in enumerate(self.host.layers):
            x = layer(x)
            if index == 0:
                x = self.seed(x)
        logits: torch.Tensor = self.host.head(x)
        return logits


def grafted_model(seed: int = 0, steps: int = 1) -> Grafted:
    """A Grafted model after ``steps`` SGD steps, holding the last step's gradients."""
    torch.manual_seed(seed)
    model = Grafted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        optimizer.zero_grad()
        tokens = torch.randint(0, VOCAB, (4, 9))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
    return model


def grads(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {
        prefix + name: p.grad.detach().clone()
        for name, p in module.named_parameters()
        if p.grad is not None
    }
