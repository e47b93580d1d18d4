"""What each rank runs in tests/test_tuning.py: autopipe.tune on 2 gloo ranks."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import autopipe

N_MICROBATCHES = 4


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)), nn.Linear(16, 4))


def tune_run(rank: int, world_size: int, candidates: int) -> dict:
    """Plan with counted costs, tune, then one training step against the unsplit model's."""
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    plan = autopipe.partition(model, world_size, (x[:2],), n_microbatches=N_MICROBATCHES, loss_fn=mse,
                              example_target=y[:2], planner=autopipe.PlannerOptions(cost="flops"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pipe = autopipe.tune(model, x, target=y, plan=plan, candidates=candidates, rounds=2, loss_fn=mse,
                         example_args=(x[:2],))
    record = pipe.plan.tuning
    untouched = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    grads_clear = all(p.grad is None for p in pipe.parameters())
    loss = pipe.step(x, target=y)
    ref_loss = mse(reference(x), y)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    grad_diff = max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters())
    return {"splits": record.split_points, "measured": record.measured_step_s, "predicted": record.predicted_step_s,
            "chosen": record.chosen, "rounds": record.rounds, "vs_chosen": record.vs_chosen,
            "round_steps": record.round_steps_s,
            "pipe_split": list(pipe.plan.split_points), "plan_split": list(plan.split_points),
            "untouched": untouched, "grads_clear": grads_clear,
            "loss": loss.item(), "ref_loss": ref_loss.item(), "grad_diff": grad_diff}


def bad_arguments_run(rank: int, world_size: int) -> dict:
    """tune() refuses what it sets itself and a non-positive count, before building anything."""
    model = _model()
    x = torch.randn(8, 16)
    plan = autopipe.partition(model, world_size, (x[:2],), n_microbatches=N_MICROBATCHES,
                              planner=autopipe.PlannerOptions(cost="flops"))
    errors = {}
    for key, kwargs in {"split_points": {"split_points": ["2"]}, "rounds": {"rounds": 0},
                        "candidates": {"candidates": 0}}.items():
        try:
            autopipe.tune(model, x, target=torch.randn(8, 4), plan=plan, loss_fn=mse, example_args=(x[:2],), **kwargs)
        except ValueError as e:
            errors[key] = str(e)
    return errors
