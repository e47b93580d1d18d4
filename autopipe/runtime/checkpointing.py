"""Per-stage activation checkpointing: trade a second forward for the stage's activation memory.

A pipeline stage keeps the activations of every micro-batch in flight until its backward
runs (GPipe: all of them; 1F1B: up to the number of stages). With checkpointing, a stage
keeps only its inputs and recomputes the rest during backward, as in the pipeline-manager
sketch autopipe grew from. It costs about one extra forward of that stage per micro-batch,
so it is worth turning on only for the stages whose memory is the limit.

    >>> import torch, torch.nn as nn
    >>> stage = checkpoint_stage(nn.Linear(4, 4))
    >>> stage(torch.ones(2, 4, requires_grad=True)).sum().backward()

:class:`autopipe.Pipeline` applies it with ``checkpoint_stages=True`` (every stage), a list
of stage indices, or ``"plan"``: the stages the planner chose to recompute so the plan fits
memory (``plan.recompute_stages``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_stage", "resolve_checkpoint_stages", "FOLLOW_PLAN"]

#: The ``checkpoint_stages`` value that takes the plan's choice (``plan.recompute_stages``):
#: the stages the planner found must recompute to fit memory, none when everything fits.
FOLLOW_PLAN = "plan"


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


def resolve_checkpoint_stages(checkpoint_stages: bool | Sequence[int] | str | None, num_stages: int,
                              plan_stages: Sequence[int] | None = None) -> list[int]:
    """Turn the ``checkpoint_stages`` option into the sorted list of stage indices to checkpoint.

    Args:
        checkpoint_stages: ``"plan"`` (:data:`FOLLOW_PLAN`: the planner's choice,
            ``plan_stages``), False/None (none), True (all) or stage indices in
            ``range(num_stages)``.
        num_stages: number of stages of the pipeline.
        plan_stages: the plan's ``recompute_stages`` (None: the plan chose none).

    Returns:
        Sorted stage indices.

    Raises:
        ValueError: if an index is out of range (the user's or the plan's), or a string other
            than ``"plan"``; TypeError for any other type.

    Example:
        >>> resolve_checkpoint_stages(True, 3), resolve_checkpoint_stages([2, 0], 3)
        ([0, 1, 2], [0, 2])
        >>> resolve_checkpoint_stages("plan", 3, plan_stages=[1]), resolve_checkpoint_stages("plan", 3)
        ([1], [])
    """
    if isinstance(checkpoint_stages, str):
        if checkpoint_stages != FOLLOW_PLAN:
            raise ValueError(f"checkpoint_stages={checkpoint_stages!r} is not an option; use {FOLLOW_PLAN!r} (the "
                             "plan's recompute_stages), True (every stage), False (none) or a list of stage indices")
        if not plan_stages:
            return []
        try:
            return resolve_checkpoint_stages(list(plan_stages), num_stages)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the plan's recompute_stages={list(plan_stages)!r} do not fit this pipeline of "
                             f"{num_stages} stages ({e}); re-plan, or pass checkpoint_stages explicitly") from None
    if checkpoint_stages is None or checkpoint_stages is False:
        return []
    if checkpoint_stages is True:
        return list(range(num_stages))
    if isinstance(checkpoint_stages, bytes) or not isinstance(checkpoint_stages, Sequence):
        raise TypeError(
            f"checkpoint_stages must be 'plan', True, False or a list of stage indices, got {checkpoint_stages!r}"
        )
    bad = [s for s in checkpoint_stages if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_stages]
    if bad:
        raise ValueError(
            f"checkpoint_stages={list(checkpoint_stages)!r} has {bad}, which are not stage indices; "
            f"this pipeline has stages 0..{num_stages - 1}"
        )
    return sorted(set(checkpoint_stages))
