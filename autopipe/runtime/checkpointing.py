"""Per-stage activation checkpointing: trade a second forward for the stage's activation memory.

Example:
        >>> import torch, torch.nn as nn
        >>> stage = checkpoint_stage(nn.Linear(4, 4))
        >>> stage(torch.ones(2, 4, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

#: The ``PlannerOptions.recompute`` value that takes the plan's choice (``plan.recompute_stages``):
#: the stages the planner found must recompute to fit memory, none when everything fits.
FOLLOW_PLAN = "auto"


def checkpoint_stage(stage_module: nn.Module) -> nn.Module:
    """Make ``stage_module`` recompute its activations in backward instead of storing them.

    Example:
        >>> m = checkpoint_stage(nn.Linear(2, 2))
        >>> m.forward.__name__
        'checkpointed_forward'
    """
    plain_forward = stage_module.forward

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(plain_forward, *args, use_reentrant=False, **kwargs)

    # An instance attribute wins over the class's forward in nn.Module.__call__.
    stage_module.forward = checkpointed_forward
    return stage_module


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
