"""Small real models and real training steps for the role tests (built from configs, no downloads).

``bert_like`` is a two-layer BERT-style encoder made of plain ``torch.nn`` layers with the
parameter names a ``transformers`` BERT has (``embeddings.word_embeddings.weight``,
``encoder.layer.0.attention.self.query.weight`` …), so checkpoints made from it look like
the real thing to every rule that reads names and structure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.self = nn.Module()
        self.self.query = nn.Linear(hidden, hidden)
        self.self.key = nn.Linear(hidden, hidden)
        self.self.value = nn.Linear(hidden, hidden)
        self.output = nn.Module()
        self.output.dense = nn.Linear(hidden, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        split = (batch, length, self.heads, hidden // self.heads)
        q = self.self.query(x).view(split).transpose(1, 2)
        k = self.self.key(x).view(split).transpose(1, 2)
        v = self.self.value(x).view(split).transpose(1, 2)
        mixed = torch.softmax(q @ k.transpose(-1, -2) / (hidden // self.heads) ** 0.5, -1) @ v
        mixed = mixed.transpose(1, 2).reshape(batch, length, hidden)
        out: torch.Tensor = self.output.LayerNorm(x + self.output.dense(mixed))
        return out


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention = _Attention(hidden, heads)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden, 4 * hidden)
        self.output = nn.Module()
        self.output.dense = nn.Linear(4 * hidden, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        inner = torch.nn.functional.gelu(self.intermediate.dense(x))
        out: torch.Tensor = self.output.LayerNorm(x + self.output.dense(inner))
        return out


class BertLike(nn.Module):
    """Embeddings, ``layers`` encoder layers and a pooler, named as in ``transformers``."""

    def __init__(self, vocab: int = 200, hidden: int = 32, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(vocab, hidden)
        self.embeddings.position_embeddings = nn.Embedding(64, hidden)
        self.embeddings.token_type_embeddings = nn.Embedding(2, hidden)
        self.embeddings.LayerNorm = nn.LayerNorm(hidden)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(hidden, heads) for _ in range(layers))
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(hidden, hidden)
        # Like BERT's initialisation: normal(0, 0.02) matrices, zero biases, unit norms.
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        x = (
            self.embeddings.word_embeddings(ids)
            + self.embeddings.position_embeddings(positions)
            + self.embeddings.token_type_embeddings(torch.zeros_like(ids))
        )
        x = self.embeddings.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x)
        return torch.tanh(self.pooler.dense(x[:, 0]))


def bert_like(seed: int = 0, **config: int) -> BertLike:
    torch.manual_seed(seed)
    return BertLike(**config)


def train(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    steps: int = 3,
    seed: int = 0,
) -> torch.optim.Optimizer:
    """Real optimizer steps on random token batches; returns the optimizer (gradients kept)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model)
    for _ in range(steps):
        optimizer.zero_grad()
        ids = torch.randint(0, 200, (4, 12), generator=generator)
        loss = model(ids).pow(2).mean()
        loss.backward()
        optimizer.step()
    return optimizer


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def tiny_hf_bert() -> torch.nn.Module:
    """A one-layer ``transformers`` BERT classifier from a config (vocabulary 50, width 16),
    seeded: the same model for every Trainer test, never downloaded."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = BertForSequenceClassification(config)
    return model


def tiny_hf_gpt2() -> torch.nn.Module:
    """A two-layer ``transformers`` GPT-2 from a config (vocabulary 50, width 16: 28
    parameters, ``transformer.h.1.mlp.c_fc.weight`` among them), seeded, never downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = GPT2LMHeadModel(config)
    return model
