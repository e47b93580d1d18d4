"""Counting attention as the fused kernel a GPU runs it as."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_SDPA = (torch.ops.aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention)
_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def attention_flops(query: Any, key: Any, value: Any, *, backward: bool = False) -> int:
    """FLOPs of one attention call (or of its backward) on tensors of these shapes.

    Example:
        >>> attention_flops((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4))  # 2 * 2 heads * 8 * 8 * (4 + 4)
        2048
        >>> attention_flops((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), backward=True)
        5120
    """
    *batch, heads, s_q, d_qk = query
    s_k, d_v = key[-2], value[-1]
    pairs = math.prod(batch) * heads * s_q * s_k
    return 2 * pairs * (3 * d_qk + 2 * d_v if backward else d_qk + d_v)


def _fused_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return attention_flops(query, key, value)


def _fused_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
                          **kwargs: Any) -> int:
    return attention_flops(query, key, value, backward=True)


# For FlopCounterMode(custom_mapping=...), keyed by operator (not overload) as its registry
# is; it hands the formulas shapes in place of tensors.
ATTENTION_FLOPS = {_FUSED.overloadpacket: _fused_flops, _FUSED_BACKWARD.overloadpacket: _fused_backward_flops}


class FusedAttention(TorchFunctionMode):
    """Within it, ``scaled_dot_product_attention`` runs as the CPU's fused kernel, on any device.

    Example:
        >>> q = torch.ones(1, 2, 8, 4, device="meta", requires_grad=True)
        >>> with FusedAttention():
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> type(out.grad_fn).__name__
        'ScaledDotProductFlashAttentionForCpuBackward0'
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        params = dict(zip(("attn_mask", "dropout_p", "is_causal"), rest))
        params.update(kwargs)
        why_not = _not_fused(query, key, value, params.get("attn_mask"))
        if why_not:
            warnings.warn(
                f"attention on query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} "
                f"is counted as torch runs it here, not as a fused kernel ({why_not}): on the meta device that "
                "is its unfused math, whose saved attention probabilities overstate its memory", stacklevel=2)
            return func(*args, **kwargs)
        mask = params.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        if mask is not None and mask.dim() < 4:  # the kernel takes a (batch, heads, query, key) mask
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        out, _ = _FUSED(query, key, value, 0.0, bool(params.get("is_causal", False)), attn_mask=mask,
                        scale=params.get("scale"))
        return out


def _not_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> str:
    """Why the CPU's fused kernel cannot stand in for this call ("" when it can)."""
    if not query.dim() == key.dim() == value.dim() == 4:
        return "inputs not of four dimensions (batch, heads, sequence, size)"
    if query.shape[-1] != value.shape[-1]:
        return "values of another head size than the queries"
    if query.dtype not in _FUSED_DTYPES:
        return f"{query.dtype}"
    if mask is not None and mask.requires_grad:
        return "a mask that takes a gradient, such as a learned position bias"
    return ""
