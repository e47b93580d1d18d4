"""What each rank runs in tests/test_resume.py: the resume recipe of docs/training.md on a
Hugging Face Llama (its rotary ``inv_freq`` is a non-persistent buffer), and checkpoints
that do not fit the model.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from _guard_workers import outcome
from _materialize_workers import LLAMA, llama_loss
from autopipe.runtime import Pipeline
from autopipe import PlannerOptions

N_MICROBATCHES = 4
# name -> (schedule, stages_per_rank, split points): 2 and 4 pipeline stages on 2 ranks.
LAYOUTS = {
    "pp=2": ("1F1B", 1, ["model.layers.2"]),
    "pp=4": ("Interleaved1F1B", 2, ["model.layers.1", "model.layers.2", "model.norm"]),
}


def llama(seed: int, layers: int = LLAMA["num_hidden_layers"]) -> nn.Module:
    from zoo.hf import llama_from_config

    torch.manual_seed(seed)
    model, _ = llama_from_config(**{**LLAMA, "num_hidden_layers": layers})
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    shape = (LLAMA["batch"] * N_MICROBATCHES, LLAMA["seq_len"])
    return (torch.randint(0, LLAMA["vocab_size"], shape, generator=g),
            torch.randint(0, LLAMA["vocab_size"], shape, generator=g))


def build(model: nn.Module, layout: str) -> Pipeline:
    schedule, per_rank, split_points = LAYOUTS[layout]
    return Pipeline(model, example_args=(batch(0)[0][:LLAMA["batch"]],), loss_fn=llama_loss, schedule=schedule,
                    split_points=split_points, n_microbatches=N_MICROBATCHES,
                    planner=PlannerOptions(stages_per_rank=per_rank))


def resume_run(rank: int, world_size: int, first: str, then: str, checkpoint: str) -> dict:
    """2 AdamW steps as ``first``, save, resume as ``then`` from a differently seeded model, a third step.

    The unsplit model trained 3 steps straight through is the reference.
    """
    reference = llama(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_losses = []
    for step in range(3):
        x, y = batch(step)
        ref_opt.zero_grad()
        loss = llama_loss(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    with build(llama(0), first) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        for step in range(2):
            opt.zero_grad()
            pipe.step(*batch(step)[:1], target=batch(step)[1])
            opt.step()
        pipe.save_checkpoint(checkpoint, opt)
    with build(llama(7), then) as pipe:  # other values: all of them must come from the checkpoint
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.load_checkpoint(checkpoint, opt)
        opt.zero_grad()
        x, y = batch(2)
        loss = pipe.step(x, target=y).item()
        opt.step()
        ref = dict(reference.named_parameters())
        param_diff = max((p.detach() - ref[n].detach()).abs().max().item() for n, p in pipe.named_parameters())
        own = {n: t.clone() for n, t in pipe.state_dict().items()}
        pipe.load_state_dict(own)  # the pipeline's own state dict, without the rotary buffer
    return {"loss_diff": abs(loss - ref_losses[2]), "param_diff": param_diff}


def misfit_run(rank: int, world_size: int, checkpoint: str) -> dict:
    """Checkpoints and weights that do not fit: refused on every rank, nothing written."""
    out: dict = {}
    with build(llama(0, layers=4), "pp=2") as pipe:
        pipe.save_checkpoint(checkpoint)
    torch.distributed.barrier()
    with build(llama(1), "pp=2") as pipe:
        before = {n: t.clone() for n, t in pipe.state_dict().items()}
        out["other_model"] = outcome(lambda: pipe.load_checkpoint(checkpoint))
        out["unchanged"] = all(torch.equal(before[n], t) for n, t in pipe.state_dict().items())
        torch.distributed.barrier()
        if rank == 0:  # a checkpoint whose writing was cut short
            path = os.path.join(checkpoint, ".metadata")
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
        torch.distributed.barrier()
        out["truncated"] = outcome(lambda: pipe.load_checkpoint(checkpoint))
        # Only rank 1 is given a dict with a wrong shape: every rank raises.
        state = {n: t.clone() for n, t in pipe.state_dict(full=True).items()}
        if rank == 1:
            state["lm_head.weight"] = torch.zeros(3, 3)
        out["one_rank_bad_shape"] = outcome(lambda: pipe.load_state_dict(state))
    full = llama(2).state_dict()
    extra = {**full, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}
    out["weights_unknown_name"] = outcome(lambda: build_with_weights(extra))
    missing = {k: v for k, v in full.items() if k != "model.norm.weight"}
    out["weights_missing_name"] = outcome(lambda: build_with_weights(missing))
    return out


def build_with_weights(weights) -> None:
    schedule, per_rank, split_points = LAYOUTS["pp=2"]
    Pipeline(llama(3), example_args=(batch(0)[0][:LLAMA["batch"]],), loss_fn=llama_loss, schedule=schedule,
             split_points=split_points, n_microbatches=N_MICROBATCHES, weights=weights).close()


def nan_weights_run(rank: int, world_size: int) -> dict:
    """A meta model's weights holding NaN are loaded as given, not called unwritten."""
    full = llama(2).state_dict()
    full["model.norm.weight"] = torch.full_like(full["model.norm.weight"], float("nan"))
    with torch.device("meta"):
        model = llama(0)
    schedule, per_rank, split_points = LAYOUTS["pp=2"]
    with Pipeline(model, example_args=(batch(0)[0][:LLAMA["batch"]],), loss_fn=llama_loss, schedule=schedule,
                  split_points=split_points, n_microbatches=N_MICROBATCHES, weights=full) as pipe:
        held = dict(pipe.named_parameters())
        return {"norm_is_nan": bool(held["model.norm.weight"].isnan().all()) if "model.norm.weight" in held else None}

