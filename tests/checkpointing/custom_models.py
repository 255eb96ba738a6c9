"""Small hand-written models for discovery and wrapping tests (no transformers involved)."""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attn)


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Block(nn.Module):
    """A pre-norm block; its attention and MLP are found by name (``attn``, ``mlp``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = x + self.attn(hidden_states=self.norm1(x))
        return x + scale * self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A custom causal LM whose blocks live in ``trunk.blocks`` (an nn.ModuleList)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.trunk = nn.Module()
        self.trunk.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.trunk.blocks:
            x = block(x, scale=0.5)
        return self.head(x)


class MixerBlock(nn.Module):
    """A block with neither an attention nor an MLP sub-module by name or class."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.token_mix = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.token_mix(x))


class MixerLM(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MixerBlock(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class NoStack(nn.Module):
    """No repeated blocks anywhere: discovery must give up with a clear message."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
