"""The seed tutorial's Transformer language model, rebuilt for autopipe's examples.

Example:
    >>> from autopipe.models import SeedTransformer
    >>> model = SeedTransformer(vocab_size=100, d_model=12, num_heads=4, d_ff=24, num_layers=2)
    >>> x = model.example_input(batch=2, seq_len=9)
    >>> tuple(model(x).shape)
    (2, 9, 100)
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal position signal of "Attention Is All You Need"."""

    def __init__(self, d_model: int, max_len: int = 5000) -> None:
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float).unsqueeze(1)
        # Frequencies fall geometrically from 1 to 1/10000 across the even channels.
        inv_freq = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2] = torch.sin(position * inv_freq)
        table[:, 1::2] = torch.cos(position * inv_freq)
        self.register_buffer("pe", table.unsqueeze(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, : x.size(1)]


class MultiHeadSelfAttention(nn.Module):
    """Plain scaled dot-product self-attention over ``num_heads`` heads."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.q_linear = nn.Linear(d_model, d_model)
        self.k_linear = nn.Linear(d_model, d_model)
        self.v_linear = nn.Linear(d_model, d_model)
        self.out_linear = nn.Linear(d_model, d_model)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        # (batch, seq, d_model) -> (batch, heads, seq, d_k)
        return t.view(t.shape[0], -1, self.num_heads, self.d_k).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._heads(self.q_linear(x)), self._heads(self.k_linear(x)), self._heads(self.v_linear(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-1e9"))
        context = F.softmax(scores, dim=-1) @ v
        merged = context.transpose(1, 2).contiguous().view(x.shape[0], -1, self.num_heads * self.d_k)
        return self.out_linear(merged)


class FeedForward(nn.Module):
    """Two linear layers with a ReLU between them."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Post-norm Transformer block: attention and feed-forward, each with a residual."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.attention = MultiHeadSelfAttention(d_model, num_heads)
        self.norm1 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, d_ff)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attention(x, mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class SeedTransformer(nn.Module):
    """The tutorial's decoder-style language model: token ids in, vocabulary logits out.

    Args:
        vocab_size: Number of tokens; the output layer ``out_linear`` has this many
            outputs, so a large vocabulary makes the last layer far heavier than the rest.

    Keyword Args:
        d_model, num_heads, d_ff, num_layers, max_len: The usual Transformer sizes.
        dropout: Dropout inside each block (use 0.0 for exact comparisons).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 2048,
        num_layers: int = 6,
        max_len: int = 5000,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len)
        self.layers = nn.ModuleList(
            [TransformerBlock(d_model, num_heads, d_ff, dropout) for _ in range(num_layers)]
        )
        self.out_linear = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.pos_encoding(self.embedding(x))
        for layer in self.layers:
            h = layer(h)
        return self.out_linear(h)

    def example_input(self, batch: int = 2, seq_len: int = 32) -> torch.Tensor:
        """A batch of token ids of the right type for this model (one micro-batch)."""
        return torch.randint(0, self.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))


def seed_transformer(
    vocab_size: int = 10000,
    *,
    d_model: int = 128,
    num_heads: int = 4,
    d_ff: int = 512,
    num_layers: int = 4,
    batch: int = 4,
    seq_len: int = 64,
    dropout: float = 0.0,
) -> tuple[SeedTransformer, tuple[torch.Tensor]]:
    """Factory used by the CLI demo and the examples: the model and one micro-batch of input.

    The default vocabulary (10,000) makes ``out_linear`` the heaviest layer by far, the
    case where an equal-layer split wastes most of every device.

    Example:
        >>> model, (x,) = seed_transformer(vocab_size=1000, num_layers=2, seq_len=8)
        >>> tuple(x.shape)
        (4, 8)
    """
    with torch.random.fork_rng(devices=[]):  # same weights every call; caller's RNG untouched
        torch.manual_seed(0)
        model = SeedTransformer(
            vocab_size, d_model=d_model, num_heads=num_heads, d_ff=d_ff,
            num_layers=num_layers, max_len=max(seq_len, 64), dropout=dropout,
        )
    return model, (model.example_input(batch, seq_len),)
