"""What each rank runs in tests/test_step_guards.py: steps that must give the unsplit model's
numbers or raise a clear error on every rank, never a wrong number in silence.

Each ``*_run`` function is one scenario; :func:`scenarios_run` runs several in one world.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autopipe.models import seed_transformer
from autopipe.runtime import Pipeline
from autopipe import PlannerOptions

N_MICROBATCHES = 4


def scenarios_run(rank: int, world_size: int, scenarios: list[tuple[str, str, tuple]]) -> dict:
    """Several scenarios in one world: ``{key: worker(rank, world_size, *args)}``."""
    return {key: globals()[worker](rank, world_size, *args) for key, worker, args in scenarios}


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) ** 2).mean()


def token_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.float().flatten(0, 1), target.flatten())


def _mlp_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[str], object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.randn(8, 8), torch.randn(8, 4), ["2"], mse


def _transformer_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[str], object]:
    torch.manual_seed(0)
    model, (x,) = seed_transformer(64, d_model=16, num_heads=2, d_ff=32, num_layers=2, batch=8, seq_len=6)
    return model, x, torch.randint(0, 64, x.shape), ["layers.1.ffn.fc2"], token_loss


def autocast_run(rank: int, world_size: int, kind: str) -> dict:
    """One bfloat16-autocast step (a tensor crosses the cut in bfloat16) against the unsplit model's."""
    model, x, y, split_points, loss_fn = {"mlp": _mlp_case, "transformer": _transformer_case}[kind]()
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    with Pipeline(model, example_args=(x[:2],), loss_fn=loss_fn, schedule="1F1B", n_microbatches=N_MICROBATCHES,
                  split_points=split_points) as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.step(x, target=y)
        ref = dict(reference.named_parameters())
        grad_diff = max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters())
        grad_scale = max(ref[n].grad.abs().max().item() for n, _ in pipe.named_parameters())
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_diff": grad_diff, "grad_scale": grad_scale}


class FunctionalDropout(nn.Module):
    """Dropout as BART writes it (``F.dropout(x, p, self.training)``) and a branch on ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.a(x)), 0.5, self.training)
        h = torch.tanh(self.b(h))
        if self.training:  # SpecAugment-style: only in training
            h = h * (torch.arange(8) % 2)
        return self.c(h)


def eval_mode_run(rank: int, world_size: int) -> dict:
    """evaluate() and pipe(x) in eval mode against the unsplit model in eval mode."""
    torch.manual_seed(0)
    model = FunctionalDropout()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    reference = copy.deepcopy(model).eval()
    with Pipeline(model, example_args=(x[:2],), loss_fn=mse, schedule="1F1B", n_microbatches=N_MICROBATCHES,
                  split_points=["b"]) as pipe:
        pipe.eval()
        loss = pipe.evaluate(x, target=y).item()
        out = pipe(x)
    with torch.no_grad():
        expected = reference(x)
    return {"loss_diff": abs(loss - mse(expected, y).item()),
            "out_diff": None if out is None else (out - expected).abs().max().item()}


def outcome(fn) -> str:
    """``"ok"`` or ``"<ErrorType>: message"``."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads which error it was
        return f"{type(e).__name__}: {e}"
    return "ok"


def rank_local_errors_run(rank: int, world_size: int) -> dict:
    """Calls that one rank (or every rank) refuses, caught by the loop; later steps against the unsplit model.

    The unsplit model takes the steps that ran on every rank: after the refused calls the
    pipeline's losses must still be the unsplit model's.
    """
    model, x, y, split_points, _ = _mlp_case()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def per_element(output, target):
        return (output - target) ** 2

    losses = {"mse": mse, "per_element": per_element, "python_float": lambda o, t: float(mse(o, t))}
    chosen = {"name": "mse"}
    out: dict = {"outcomes": {}, "losses": [], "ref_losses": []}
    with Pipeline(model, example_args=(x[:2],), loss_fn=lambda o, t: losses[chosen["name"]](o, t),
                  schedule="1F1B", n_microbatches=N_MICROBATCHES, split_points=split_points) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)

        def train_step(target) -> None:
            opt.zero_grad()
            out["losses"].append(pipe.step(x, target=target).item())
            opt.step()
            ref_opt.zero_grad()
            ref_loss = mse(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            out["ref_losses"].append(ref_loss.item())

        train_step(y)
        # Only the last stage's rank is given a target it cannot take.
        bad = y.tolist() if rank == world_size - 1 else y
        out["outcomes"]["one_rank_bad_target"] = outcome(lambda: train_step(bad))
        out["outcomes"]["numpy_target"] = outcome(lambda: train_step(y.numpy()))
        out["outcomes"]["wrong_batch_on_rank_0"] = outcome(
            lambda: pipe.step(x[:3] if rank == 0 else x, target=y))
        # Two whole micro-batches on rank 0 (a short last batch) but four on rank 1: the ranks disagree.
        out["outcomes"]["different_counts"] = outcome(lambda: pipe.step(x[:4] if rank == 0 else x, target=y))
        # Another width on rank 0 only: the ranks disagree; on every rank: the layers cannot take it.
        out["outcomes"]["different_widths"] = outcome(lambda: pipe.step(x[:, :3] if rank == 0 else x, target=y))
        out["outcomes"]["untraceable_width"] = outcome(lambda: pipe.step(x[:, :3], target=y))
        out["outcomes"]["another_rank"] = outcome(lambda: pipe.step(x[:, :, None], target=y))
        for name in ("per_element", "python_float"):
            chosen["name"] = name
            out["outcomes"][name] = outcome(lambda: pipe.step(x, target=y))
            chosen["name"] = "mse"
        opt.zero_grad()  # the failed steps' partial gradients
        train_step(y)
        train_step(y)
        # Rank 0 evaluates while rank 1 steps: out of step.
        out["outcomes"]["out_of_step"] = outcome(
            lambda: pipe.evaluate(x, target=y) if rank == 0 else pipe.step(x, target=y))
        out["outcomes"]["after_out_of_step"] = outcome(lambda: pipe.step(x, target=y))
    return out


def inference_mode_run(rank: int, world_size: int, schedule: str) -> dict:
    """pipe(x) inside torch.inference_mode() under a V schedule (inference runs a backward), then a step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)), nn.Linear(8, 4))
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    out: dict = {}
    with Pipeline(model, example_args=(x[:2],), loss_fn=mse, schedule=schedule, n_microbatches=N_MICROBATCHES,
                  split_points=["1", "2", "3"], planner=PlannerOptions(stages_per_rank=2)) as pipe:
        with torch.inference_mode():
            output = pipe(x)
        with torch.no_grad():
            expected = reference(x)
        out["out_diff"] = None if output is None else (output - expected).abs().max().item()
        loss = pipe.step(x, target=y).item()
        out["step_diff"] = abs(loss - mse(reference(x), y).item())
    return out
