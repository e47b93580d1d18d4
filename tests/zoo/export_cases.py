"""Models that torch.export captures differently from how they run: custom autograd Functions,
data-dependent shapes, hooks on tensors. Each factory returns ``(model, example_args, target)``
for one micro-batch of 2 rows; ``batch(kind, rows)`` gives a whole batch of the same kind.

Example:
    >>> from zoo.export_cases import build
    >>> model, (x,), y = build("ste")
    >>> tuple(model(x).shape) == tuple(y.shape)
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["CASES", "build", "batch"]


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: rounds in the forward, passes the gradient unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class GradReverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): identity forward, ``-alpha`` times the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.alpha * grad, None


class FusedBiasGelu(torch.autograd.Function):
    """A fused kernel's stand-in: tanh-GELU of ``x + bias`` forward, the erf-GELU derivative back, as fused
    kernels' hand-written backwards differ from autograd's of their forward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        return F.gelu(x + bias, approximate="tanh")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors
        y = x + bias
        cdf = 0.5 * (1 + torch.erf(y / 2 ** 0.5))
        pdf = torch.exp(-0.5 * y * y) / (2 * torch.pi) ** 0.5
        d = grad * (cdf + y * pdf)
        return d, d.reshape(-1, d.shape[-1]).sum(0)


class FunctionBlock(nn.Module):
    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, width))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.kind == "ste":
            h = RoundSTE.apply(h)
        elif self.kind == "grl":
            h = GradReverse.apply(h, 0.5)
        elif self.kind == "fused":
            h = FusedBiasGelu.apply(h, self.bias)
        return x + h


class FunctionNet(nn.Module):
    """Four residual blocks, every other one applying a custom Function."""

    def __init__(self, kind: str, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FunctionBlock(width, kind if i % 2 else "plain") for i in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TopKMoE(nn.Module):
    """Top-2 mixture of experts routed the usual way: topk, nonzero per expert, index_add back."""

    def __init__(self, width: int = 16, n_experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(width, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(n_experts))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(F.softmax(self.gate(tokens), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.reshape(x.shape)


class MoELayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.moe = TopKMoE(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoENet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(MoELayer(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MaskedTokens(nn.Module):
    """Drops padding tokens with a boolean mask (``x[mask]``), then works on the tokens left.

    With ``pool=True`` the kept tokens are averaged per sequence before the head, so the head's
    input has a fixed size again and can start a stage; without it every later tensor's length
    depends on the data.
    """

    def __init__(self, width: int = 8, pool: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, 2)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        keep = x[..., 0] > 0  # the "real" tokens
        kept = torch.relu(self.mix(h[keep]))
        if not self.pool:
            return self.head(kept).sum(0, keepdim=True).expand(x.shape[0], -1)
        row = torch.arange(x.shape[0]).unsqueeze(1).expand(keep.shape)[keep]
        pooled = torch.zeros(x.shape[0], h.shape[-1]).index_add(0, row, kept)
        pooled = pooled / keep.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled)


class HookedNet(nn.Module):
    """Halves the gradient flowing into its first layer's output with a hook registered in forward."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if h.requires_grad:
            h.register_hook(lambda grad: grad * 0.5)
        return self.head(self.second(h))


#: kind -> (model factory, input shape for 2 rows, target shape for 2 rows)
CASES = {
    "ste": (lambda: FunctionNet("ste"), (2, 8), (2, 3)),
    "grl": (lambda: FunctionNet("grl"), (2, 8), (2, 3)),
    "fused": (lambda: FunctionNet("fused"), (2, 8), (2, 3)),
    "moe": (MoENet, (2, 6, 16), (2, 6, 5)),
    "masked": (MaskedTokens, (2, 6, 8), (2, 2)),
    "masked_unpooled": (lambda: MaskedTokens(pool=False), (2, 6, 8), (2, 2)),
    "hooked": (HookedNet, (2, 4), (2, 3)),
}


def batch(kind: str, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of inputs and targets for ``kind``, the same on every rank."""
    _, x_shape, y_shape = CASES[kind]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, *x_shape[1:], generator=g), torch.randn(rows, *y_shape[1:], generator=g)


def build(kind: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """The model of ``kind`` (seeded, training mode), one micro-batch of 2 rows, and its target."""
    factory = CASES[kind][0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    x, y = batch(kind, 2, seed=seed + 100)
    return model, (x,), y
