"""Calibrate the GPU's efficiency shares on one measured Transformer block.

The shares of :class:`~autopipe.layouts.gpu.Efficiency` come from published runs; on the
GPU a user actually has, one block timed there says more. :func:`calibrate_on_block` finds
the factor on the GEMM and attention shares that makes the block's charged forward and
backward time equal the measured one, and returns the costs with those shares: every
layout predicted afterwards is charged at this GPU's measured speed. The measurement is
what :func:`autopipe.planning.profile.profile_segments` gives for one block segment of the
model, on the GPU (``device="cuda"``), at the micro-batch's token count.

Example:
    >>> from autopipe.layouts.gpu import GpuCosts
    >>> from autopipe.layouts.shapes import TransformerShape
    >>> from autopipe.machine.topology import Topology
    >>> gpu = GpuCosts("H100", Topology(gpus_per_node=8))
    >>> shape = TransformerShape.named("llama3-8b")
    >>> charged = block_seconds(shape, gpu, tokens=8192)
    >>> slower = calibrate_on_block(gpu, shape, tokens=8192, measured_s=1.25 * charged)
    >>> round(block_seconds(shape, slower, tokens=8192) / charged, 3)
    1.25
"""

from __future__ import annotations

from dataclasses import replace

from .gpu import GpuCosts
from .shapes import TransformerShape
from .layout import Layout
from .step import block_times


def block_seconds(shape: TransformerShape, gpu: GpuCosts, *, tokens: int, layout: Layout | None = None) -> float:
    """Forward plus backward seconds one block is charged for ``tokens`` tokens on one GPU."""
    times = block_times(shape, layout or Layout(), gpu, tokens)
    return times["fwd"] + times["bwd"]


def _scaled(gpu: GpuCosts, factor: float) -> GpuCosts:
    e = gpu.efficiency
    # The attention and float8 rates are ratios to the GEMM's, so they follow it.
    return gpu.with_efficiency(replace(e, gemm={**e.gemm, gpu.name: min(1.0, e.gemm_share(gpu.name) * factor)}))


def calibrate_on_block(gpu: GpuCosts, shape: TransformerShape, *, tokens: int, measured_s: float,
                       layout: Layout | None = None) -> GpuCosts:
    """``gpu`` with its GEMM, attention and float8 shares scaled so one block of ``shape``
    is charged ``measured_s`` (forward plus backward) for ``tokens`` tokens.

    Args:
        gpu: the costs to calibrate (their accelerator is the one measured).
        shape: the model whose block was timed.
        tokens: tokens in the timed micro-batch (micro-batch size x sequence length).
        measured_s: the block's measured forward plus backward seconds.
        layout: the runtime options it was timed with (fused attention, float8, compile);
            default: a plain bf16 layout with fused attention.

    Returns:
        New :class:`~autopipe.layouts.gpu.GpuCosts`; ``gpu`` is left as it was.

    Raises:
        ValueError: ``measured_s`` not a positive number, or faster than the data sheet allows
            (shares above 1 would be needed: the measurement cannot be this block's).
    """
    if isinstance(measured_s, bool) or not isinstance(measured_s, (int, float)) or not measured_s > 0:
        raise ValueError(f"calibrate_on_block measured_s={measured_s!r} must be seconds > 0")
    lo, hi = 1e-6, 1.0 / max(gpu.efficiency.gemm_share(gpu.name), 1e-9)
    if block_seconds(shape, _scaled(gpu, hi), tokens=tokens, layout=layout) > measured_s:
        raise ValueError(f"calibrate_on_block measured_s={measured_s:.3g} is faster than {gpu.name}'s data sheet "
                         f"allows for this block at {tokens} tokens: time one block of this model on this GPU")
    for _ in range(60):  # the charged time falls as the factor grows
        mid = (lo * hi) ** 0.5
        if block_seconds(shape, _scaled(gpu, mid), tokens=tokens, layout=layout) > measured_s:
            lo = mid
        else:
            hi = mid
    return _scaled(gpu, (lo * hi) ** 0.5)

