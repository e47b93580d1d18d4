"""What each rank runs in tests/test_sharded_state.py (spawned by tests/_dist_utils.run_world).

The model is the seed Transformer with its output layer tied to its token embedding (so
the first and the last stage, on different ranks, share one matrix) and a persistent
buffer no stage reads. Every rank also trains the unsplit model on the same batches with
the same optimizer: the reference every resumed run is compared with.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from autopipe.models import seed_transformer
from autopipe.runtime import Pipeline
from autopipe import PlannerOptions

VOCAB, SEQ, MICROBATCH, N_MICROBATCHES = 40, 8, 2, 4
LR = 1e-3
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def make_model(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """The tied seed Transformer, its weights drawn from ``seed``, and one micro-batch of ids."""
    model, (x_mb,) = seed_transformer(vocab_size=VOCAB, d_model=16, num_heads=2, d_ff=32, num_layers=4,
                                      batch=MICROBATCH, seq_len=SEQ)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.out_linear.weight = model.embedding.weight
    model.register_buffer("unread", torch.arange(5.0) + seed)  # in the state dict, read by no stage
    return model, x_mb


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(123)
    shape = (MICROBATCH * N_MICROBATCHES, SEQ)
    return [(torch.randint(0, VOCAB, shape, generator=gen), torch.randint(0, VOCAB, shape, generator=gen))
            for _ in range(n)]


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def unsplit_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One step of the unsplit model; its loss, and its gradients and parameters after the step."""
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return {"loss": loss.item(), "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def pipe_step(pipe: Pipeline, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict:
    opt.zero_grad()
    loss = pipe.step(x, target=y)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    opt.step()
    return {"loss": loss.item(), "grads": grads, "params": {n: p.detach().clone() for n, p in pipe.named_parameters()}}


def differences(got: dict, want: dict) -> dict[str, float]:
    """Largest absolute difference of the loss and of every gradient / parameter ``got`` has."""
    out = {"loss": abs(got["loss"] - want["loss"])}
    for kind in ("grads", "params"):
        for name, t in got[kind].items():
            out[f"{kind}:{name}"] = (t - want[kind][name]).abs().max().item()
    return out


def two_stage(model: nn.Module, x_mb: torch.Tensor) -> Pipeline:
    return Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn, split_points=["layers.2"], schedule="1F1B",
                    n_microbatches=N_MICROBATCHES)


def four_stage(model: nn.Module, x_mb: torch.Tensor) -> Pipeline:
    return Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn, split_points=["layers.1", "layers.2", "layers.3"],
                    schedule="Interleaved1F1B", n_microbatches=N_MICROBATCHES,
                    planner=PlannerOptions(stages_per_rank=2))


def save_pipe(pipe: Pipeline, opt: torch.optim.Optimizer, path: str) -> list[str]:
    """``dcp.save`` the pipeline; the keys this rank wrote (after DCP's deduplication)."""
    planner = DefaultSavePlanner()
    dcp.save({"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(opt)}, checkpoint_id=path,
             planner=planner)
    return sorted(item.index.fqn for item in planner.plan.items)


def load_pipe(pipe: Pipeline, opt: torch.optim.Optimizer, path: str) -> None:
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(opt)}
    dcp.load(state, checkpoint_id=path)
    pipe.load_state_dict(state["model"])
    pipe.load_optimizer_state_dict(opt, state["optim"])


def gathered(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def resharding_run(rank: int, world_size: int, tmp: str) -> dict:
    """2-stage 1F1B -> checkpoint -> 4-stage Interleaved1F1B, the unsplit model, and back.

    Returns, for each resumed run, the largest differences from the unsplit reference's
    third step, plus which keys each rank wrote and the tied parameter's optimizer state.
    """
    data = batches(3)
    base, x_mb = make_model(seed=0)
    # The reference: the unsplit model for 3 steps; after 2 it saves with torch's helpers.
    reference, ref_opt = copy.deepcopy(base), None
    ref_opt = adam(reference.parameters())
    ref = [unsplit_step(reference, ref_opt, *data[0]), unsplit_step(reference, ref_opt, *data[1])]
    unsplit_dir = os.path.join(tmp, "unsplit")
    msd, osd = get_state_dict(reference, ref_opt, options=FLAT)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=unsplit_dir)
    ref.append(unsplit_step(reference, ref_opt, *data[2]))
    result: dict = {}

    # A 2-stage 1F1B run trains 2 steps and saves.
    pipe_dir = os.path.join(tmp, "pipe")
    with two_stage(copy.deepcopy(base), x_mb) as pipe:
        opt = adam(pipe.parameters())
        trained = [pipe_step(pipe, opt, *data[0]), pipe_step(pipe, opt, *data[1])]
        result["before_save"] = max(max(differences(t, r).values()) for t, r in zip(trained, ref[:2]))
        result["written"] = gathered(save_pipe(pipe, opt, pipe_dir))
        result["model_keys"] = sorted(pipe.state_dict())

    # (a) a 4-stage Interleaved1F1B run, from other weights and a fresh optimizer, resumes.
    other, _ = make_model(seed=1)
    with four_stage(other, x_mb) as pipe:
        opt = adam(pipe.parameters())
        load_pipe(pipe, opt, pipe_dir)
        tied = opt.state[dict(pipe.named_parameters())["embedding.weight"]]
        result["tied_state"] = gathered({k: v.clone() for k, v in tied.items()})
        result["unread"] = gathered(pipe.state_dict(full=True)["unread"])
        result["four_stage"] = differences(pipe_step(pipe, opt, *data[2]), ref[2])

    # (b) the unsplit model and its optimizer, with torch's helpers.
    model, _ = make_model(seed=1)
    opt = adam(model.parameters())
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=pipe_dir)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=FLAT)
    result["unread_unsplit"] = model.unread.clone()
    result["unsplit"] = differences(unsplit_step(model, opt, *data[2]), ref[2])

    # (c) the reverse: the unsplit model's checkpoint into a 2-stage and a 4-stage run.
    for name, build in (("from_unsplit_2", two_stage), ("from_unsplit_4", four_stage)):
        with build(make_model(seed=1)[0], x_mb) as pipe:
            opt = adam(pipe.parameters())
            load_pipe(pipe, opt, unsplit_dir)
            result[name] = differences(pipe_step(pipe, opt, *data[2]), ref[2])
    return result
