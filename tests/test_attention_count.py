"""Counted costs charge attention as a GPU's fused kernel, on the meta device and the CPU alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from autopipe.machine.passes import SavedBytes
from autopipe.planning.attention_count import ATTENTION_FLOPS, FusedAttention, attention_flops

B, H, S, D = 2, 4, 32, 8


def _qkv(device: str = "cpu", kv_heads: int = H) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = [(B, H, S, D), (B, kv_heads, S, D), (B, kv_heads, S, D)]
    return tuple(torch.randn(s, generator=g).to(device).requires_grad_(True) for s in shapes)


@pytest.mark.parametrize("case", ["causal", "bool mask", "float mask", "grouped-query", "scale"])
def test_the_fused_kernel_computes_what_torch_attention_does(case):
    q, k, v = _qkv(kv_heads=2 if case == "grouped-query" else H)
    kwargs = {
        "causal": dict(is_causal=True),
        "bool mask": dict(attn_mask=torch.ones(S, S, dtype=torch.bool).tril()),
        "float mask": dict(attn_mask=torch.randn(B, 1, 1, S)),
        "grouped-query": dict(is_causal=True, enable_gqa=True),
        "scale": dict(scale=0.5),
    }[case]
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with FusedAttention():
        out = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, **kwargs)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _saved_bytes(device: str, fused: bool) -> int:
    q, k, v = _qkv(device)
    counter = SavedBytes(set())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        if fused:
            with FusedAttention():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return sum(counter.saved.values())


def test_on_the_meta_device_the_attention_probabilities_are_not_saved():
    probs = B * H * S * S * 4
    kept = 4 * B * H * S * D * 4 + B * H * S * 4  # query, key, value, output; one log-sum-exp per row
    assert _saved_bytes("meta", fused=False) >= probs  # torch's unfused math on meta keeps them
    assert _saved_bytes("meta", fused=True) == kept == _saved_bytes("cpu", fused=True)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_fused_kernel_has_flops(device):
    q, k, v = _qkv(device)
    with FusedAttention(), FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) as counter:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        forward = counter.get_total_flops()
        out.sum().backward()
    assert forward == 2 * B * H * S * S * (D + D)
    assert counter.get_total_flops() - forward == 2 * B * H * S * S * (3 * D + 2 * D)
    assert attention_flops(q.shape, k.shape, v.shape) == forward


def test_inputs_the_kernel_does_not_take_run_as_torch_runs_them_with_a_warning():
    x = torch.randn(B, S, D)  # three dimensions: the fused kernel takes (batch, heads, sequence, size) only
    with FusedAttention(), pytest.warns(UserWarning, match=r"query \(2, 32, 8\).*not as a fused kernel"):
        out = F.scaled_dot_product_attention(x, x, x)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(x, x, x))
    # A learned bias (T5's, Swin's relative positions) takes a gradient the kernel does not give.
    q, k, v = _qkv()
    bias = torch.randn(1, H, S, S, requires_grad=True)
    with FusedAttention(), pytest.warns(UserWarning, match="a mask that takes a gradient"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert torch.autograd.grad(out.sum(), bias)[0].shape == bias.shape
