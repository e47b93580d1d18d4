"""What each rank runs in tests/test_export_fidelity.py (spawned by tests/_dist_utils.run_world)."""

from __future__ import annotations

import copy

import torch

from autopipe import Pipeline, PlannerOptions, ProfileOptions
from zoo.export_cases import batch, build

N_MICROBATCHES = 4


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def _train_one(rank: int, kind: str, schedule: str) -> dict:
    model, example, _ = build(kind)
    reference = copy.deepcopy(model)
    x, y = batch(kind, 2 * N_MICROBATCHES)
    with Pipeline(model, example_args=example, loss_fn=_loss, schedule=schedule, n_microbatches=N_MICROBATCHES,
                  planner=PlannerOptions(cost="flops", profiling=ProfileOptions(progress=False))) as pipe:
        loss = pipe.step(x, target=y)
        grads = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    micro = zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES))
    reference_loss = torch.stack([_loss(reference(xm), ym) for xm, ym in micro]).mean()
    reference_loss.backward()
    wanted = dict(reference.named_parameters())
    errors = [(g - (wanted[n].grad if wanted[n].grad is not None else torch.zeros_like(g))).abs().max().item()
              for n, g in grads.items()]
    return {"loss": float(loss.detach()), "reference_loss": float(reference_loss.detach()), "grads": len(grads),
            "max_grad_error": max(errors, default=float("inf"))}


def train_cases(rank: int, world_size: int, runs: list[tuple[str, str]]) -> list[dict]:
    return [_train_one(rank, kind, schedule) for kind, schedule in runs]


def hooked_pipeline(rank: int, world_size: int) -> None:
    model, example, _ = build("hooked")
    with Pipeline(model, example_args=example, loss_fn=_loss, split_points=["second"], n_microbatches=2):
        raise AssertionError("the pipeline was built")


def split_across_a_masked_tensor(rank: int, world_size: int) -> None:
    model, example, _ = build("masked_unpooled")
    with Pipeline(model, example_args=example, loss_fn=_loss, split_points=["mix"], n_microbatches=2):
        raise AssertionError("the pipeline was built")
