"""What each rank runs in the global gradient-clipping tests (spawned by tests/_dist_utils.run_world).

The seed tutorial's Transformer with its embedding tied to the output layer, so one
parameter has a copy on the first and the last stage: a norm that counts it twice, or a
per-rank norm, gives another result than the unsplit model's.
"""

from __future__ import annotations

import math

import torch

import _runtime_workers as rw


def clip_run(rank: int, world_size: int, schedule: str, norm_type: float, max_norm: float) -> dict:
    """One step, global clipping, against the unsplit model clipped by torch's own function."""
    model = rw.tutorial_model(tied=True)
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    pipe = rw.build(model, schedule, world_size * stages_per_rank, stages_per_rank=stages_per_rank)
    x, y = rw.tutorial_batch(0)
    pipe.step(x, target=y)
    norm = pipe.clip_grad_norm_(max_norm, norm_type)
    model.zero_grad()
    rw.loss_fn(model(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    ref_grads = dict(model.named_parameters())
    local_norm = torch.nn.utils.get_total_norm([p.grad for p in pipe.parameters()], norm_type)
    return {
        "norm": norm.item(),
        "ref_norm": ref_norm.item(),
        "per_rank_norm": local_norm.item(),
        "grad_diff": max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pipe.named_parameters()),
        "clipped": ref_norm.item() > max_norm,
    }


def bad_clip_args_run(rank: int, world_size: int) -> list[str]:
    pipe = rw.build(rw.tutorial_model(), "1F1B", world_size)
    messages = []
    for kwargs in ({"max_norm": 0.0}, {"max_norm": math.inf}, {"max_norm": 1.0, "norm_type": -1.0}):
        try:
            pipe.clip_grad_norm_(**kwargs)
            messages.append("")
        except ValueError as e:
            messages.append(str(e))
    return messages
