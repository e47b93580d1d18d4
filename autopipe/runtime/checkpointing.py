"""Activation checkpointing: trade a second forward for activation memory, per stage or per block.

Example:
        >>> import torch, torch.nn as nn
        >>> stage = checkpoint_stage(nn.Linear(4, 4))
        >>> stage(torch.ones(2, 4, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)

from .._checks import check_choice
from ..layouts.blocks import RECOMPUTE_MODES
from ..planning.options import BLOCK_RECOMPUTE

#: The matmuls of torchtitan's op-level policy: every other one's output is kept.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
#: Ops whose outputs the selective policy always keeps: the attention kernels', and a tensor-parallel
#: reduction's, so the recomputation communicates nothing (torchtitan keeps its reduce-scatters too).
_ALWAYS_KEPT = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}

#: The ``PlannerOptions.recompute`` value that takes the plan's choice (``plan.recompute_stages``):
#: the stages the planner found must recompute to fit memory, none when everything fits.
FOLLOW_PLAN = "auto"


def checkpoint_stage(stage_module: nn.Module, context_fn: Callable[[], tuple] = noop_context_fn) -> nn.Module:
    """Make ``stage_module`` recompute its activations in backward instead of storing them
    (what it keeps for the recomputation: ``context_fn``, as ``torch.utils.checkpoint`` takes it).

    Example:
        >>> m = checkpoint_stage(nn.Linear(2, 2))
        >>> m.forward.__name__
        'checkpointed_forward'
    """
    plain_forward = stage_module.forward

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(plain_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    # An instance attribute wins over the class's forward in nn.Module.__call__.
    stage_module.forward = checkpointed_forward
    return stage_module


def checkpoint_blocks(stage_module: nn.Module, blocks: Sequence[str], mode: str) -> list[str]:
    """Checkpoint the named ``blocks`` of ``stage_module`` in place (absent names skipped) and
    return those checkpointed. ``mode="full"`` keeps each block's inputs only; ``"selective"`` is
    torchtitan's op-level policy, which the layout planner charges: the attention kernel's outputs,
    every other matmul's and tensor-parallel reductions' are kept, the rest recomputed; ``"none"``
    changes nothing.

    Example:
        >>> checkpoint_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ["0", "1", "2"], "selective")
        ['0', '1']
    """
    check_choice("mode", mode, RECOMPUTE_MODES)
    names = {name for name, _ in stage_module.named_modules()}
    done = [b for b in blocks if b in names] if mode != "none" else []
    context_fn = _selective_contexts if mode == "selective" else noop_context_fn
    for name in done:
        checkpoint_stage(stage_module.get_submodule(name), context_fn)
    return done


def block_names(model: nn.Module) -> list[str]:
    """The model's repeated blocks: the children of each ``nn.ModuleList`` of two or more modules
    of one class, outside another such block (a block's own lists, MoE experts, are inside it).

    Example:
        >>> block_names(nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])))
        ['0.0', '0.1']
    """
    blocks: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{b}.") for b in blocks)
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1 and not inside:
            blocks += [f"{name}.{i}" if name else str(i) for i in range(len(module))]
    return blocks


def _selective_contexts() -> tuple:
    """Fresh contexts of the op-level policy for one checkpointed call: matmuls counted anew."""
    counts = {"forward": 0, "recompute": 0}
    return create_selective_checkpoint_contexts(functools.partial(_keep_every_other_matmul, counts))


def _keep_every_other_matmul(counts: dict[str, int], ctx: object, op: object, *args: object,
                             **kwargs: object) -> CheckpointPolicy:
    if op in _ALWAYS_KEPT:
        return CheckpointPolicy.MUST_SAVE
    if op in _MATMULS:
        # The forward and its recomputation count separately, so both keep the same matmuls.
        phase = "recompute" if getattr(ctx, "is_recompute", False) else "forward"
        counts[phase] += 1
        if counts[phase] % 2 == 1:
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def resolve_recompute(recompute: bool | Sequence[int] | str | None, num_stages: int,
                      plan_stages: Sequence[int] | None = None) -> list[int]:
    """Turn the ``recompute`` option into the sorted list of stage indices to checkpoint.

    Example:
        >>> resolve_recompute(True, 3), resolve_recompute([2, 0], 3)
        ([0, 1, 2], [0, 2])
        >>> resolve_recompute("auto", 3, plan_stages=[1]), resolve_recompute("auto", 3)
        ([1], [])
    """
    if isinstance(recompute, str):
        if recompute in BLOCK_RECOMPUTE:  # blocks, not stages, are checkpointed
            return []
        if recompute != FOLLOW_PLAN:
            raise ValueError(f"planner.recompute={recompute!r} is not an option; use {FOLLOW_PLAN!r} (the "
                             "plan's recompute_stages), True (every stage), False (none) or a list of stage indices")
        if not plan_stages:
            return []
        try:
            return resolve_recompute(list(plan_stages), num_stages)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the plan's recompute_stages={list(plan_stages)!r} do not fit this pipeline of "
                             f"{num_stages} stages ({e}); re-plan, or give planner.recompute explicitly") from None
    if recompute is None or recompute is False:
        return []
    if recompute is True:
        return list(range(num_stages))
    if isinstance(recompute, bytes) or not isinstance(recompute, Sequence):
        raise TypeError(
            f"planner.recompute must be 'auto', True, False or a list of stage indices, got {recompute!r}"
        )
    bad = [s for s in recompute if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_stages]
    if bad:
        raise ValueError(
            f"planner.recompute={list(recompute)!r} has {bad}, which are not stage indices; "
            f"this pipeline has stages 0..{num_stages - 1}"
        )
    return sorted(set(recompute))
