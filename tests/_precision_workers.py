"""What each rank runs in tests/test_mixed_precision.py (spawned by tests/_dist_utils.run_world)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autopipe import PlannerOptions
from autopipe.planning.schedules import SCHEDULES, schedule_spec
from autopipe.runtime import Pipeline

N_MICROBATCHES = 4


class TwoDtypes(nn.Module):
    """Under bf16 autocast the cut before ``b`` carries a bfloat16 activation and a float32 one (``sin(x)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.e, self.d = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = torch.sin(x)  # not an autocast op: stays float32
        h = self.a(x)  # bfloat16
        h = torch.tanh(self.b(h))
        h = self.c(h) + self.e(r)
        return self.d(h)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) ** 2).mean()


def received_dtypes(pipe: Pipeline) -> dict[int, list[str]]:
    """The dtype of every tensor each of this rank's stages (but the first) receives."""
    return {s: [str(n.meta["val"].dtype) for n in module.graph.nodes if n.op == "placeholder"]
            for s, module in pipe._train_modules.items() if s > 0}


def mixed_precision_run(rank: int, world_size: int) -> dict:
    """Every schedule with PlannerOptions(mixed_precision='bf16'), against the unsplit model under bf16 autocast."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * N_MICROBATCHES, 8, generator=g), torch.randn(2 * N_MICROBATCHES, 4, generator=g)
    results = {}
    for schedule in SCHEDULES:
        model = TwoDtypes()
        reference = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = mse(reference(x), y)
        ref_loss.backward()
        two = schedule_spec(schedule).default_stages_per_rank == 1
        with Pipeline(model, example_args=(x[:2],), loss_fn=mse, schedule=schedule, n_microbatches=N_MICROBATCHES,
                      split_points=["b"] if two else ["b", "c", "d"],
                      planner=PlannerOptions(mixed_precision="bf16")) as pipe:
            loss = pipe.step(x, target=y)
            ref = dict(reference.named_parameters())
            results[schedule] = {
                "loss": loss.item(), "ref_loss": ref_loss.item(), "received": received_dtypes(pipe),
                "grad_diff": max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters()),
                "grad_scale": max(ref[n].grad.abs().max().item() for n, _ in pipe.named_parameters()),
                "eval_loss": pipe.evaluate(x, target=y).item()}
        # The user's own autocast around step() and evaluate(), on a pipeline planned without the option.
        with Pipeline(TwoDtypes(), example_args=(x[:2],), loss_fn=mse, schedule=schedule,
                      n_microbatches=N_MICROBATCHES, split_points=["b"] if two else ["b", "c", "d"]) as pipe:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pipe.step(x, target=y)
                eval_loss = pipe.evaluate(x, target=y)
            results[schedule].update(
                user_loss=loss.item(), user_eval_loss=eval_loss.item(),
                user_grad_diff=max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters()))
    return results


def compiled_run(rank: int, world_size: int, schedules: list[str]) -> dict:
    """PlannerOptions(compile={"backend": "aot_eager"}): a step against eager, and dynamo's graphs on this rank."""
    import torch._dynamo

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2 * N_MICROBATCHES, 8, generator=g), torch.randn(2 * N_MICROBATCHES, 4, generator=g)
    results = {}
    for schedule in schedules:
        torch._dynamo.reset()
        model = TwoDtypes()
        reference = copy.deepcopy(model)
        ref_loss = mse(reference(x), y)
        ref_loss.backward()
        two = schedule_spec(schedule).default_stages_per_rank == 1
        with Pipeline(model, example_args=(x[:2],), loss_fn=mse, schedule=schedule, n_microbatches=N_MICROBATCHES,
                      split_points=["b"] if two else ["b", "c", "d"],
                      planner=PlannerOptions(compile={"backend": "aot_eager"})) as pipe:
            torch._dynamo.utils.counters.clear()
            loss = pipe.step(x, target=y)
            ref = dict(reference.named_parameters())
            results[schedule] = {
                "loss": loss.item(), "ref_loss": ref_loss.item(),
                "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
                "grad_diff": max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters()),
                "eval_loss": pipe.evaluate(x, target=y).item()}
    try:
        Pipeline(TwoDtypes(), example_args=(x[:2],), loss_fn=mse, schedule="ZBVZeroBubble",
                 n_microbatches=N_MICROBATCHES, split_points=["b", "c", "d"], planner=PlannerOptions(compile=True))
        results["split_backward"] = "built"
    except ValueError as e:
        results["split_backward"] = str(e)
    return results
