"""Per-stage activation checkpointing: trade a second forward for the stage's activation memory.

A pipeline stage keeps the activations of every micro-batch in flight until its backward
runs (GPipe: all of them; 1F1B: up to the number of stages). With checkpointing, a stage
keeps only its inputs and recomputes the rest during backward, as in the pipeline-manager
sketch autopipe grew from. It costs about one extra forward of that stage per micro-batch,
so it is worth turning on only for the stages whose memory is the limit.

    >>> import torch, torch.nn as nn
    >>> stage = checkpoint_stage(nn.Linear(4, 4))
    >>> stage(torch.ones(2, 4, requires_grad=True)).sum().backward()

:class:`autopipe.Pipeline` applies it with ``PlannerOptions(recompute=True)`` (every stage), a list
of stage indices, or ``"auto"``: the stages the planner chose to recompute so the plan fits
memory (``plan.recompute_stages``).
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

    The module is changed in place (its ``forward`` is wrapped) and returned, so torch's
    pipeline stages, which call the module they were given, run the checkpointed forward.
    Uses non-reentrant checkpointing, which restores the RNG state for the recomputation
    (dropout draws the same mask twice) and works with the split input/weight backward of
    the zero-bubble schedules.

    Args:
        stage_module: a stage module (``pipe.get_stage_module(i)``) or any module.

    Returns:
        The same module.

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

    Args:
        recompute: ``"auto"`` (:data:`FOLLOW_PLAN`: the planner's choice,
            ``plan_stages``), False/None (none), True (all) or stage indices in
            ``range(num_stages)``.
        num_stages: number of stages of the pipeline.
        plan_stages: the plan's ``recompute_stages`` (None: the plan chose none).

    Returns:
        Sorted stage indices.

    Raises:
        ValueError: if an index is out of range (the user's or the plan's), or a string other
            than ``"auto"``; TypeError for any other type.

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
