"""What each rank runs in the pipeline x data parallel tests (spawned by tests/_dist_utils.run_world).

Four ranks form a ``dp=2 x pp=2`` mesh over a global batch of 16 sequences; each replica
trains on its 8 (4 micro-batches of 2). As in DDP, each rank is given its replica's rows, drawn
by a ``DistributedSampler`` over the 16 (``DataParallelOptions(batch="replica")``, the
default); one case gives every rank the whole global batch instead (``batch="global"``). The
unsplit model, run in the same process on the whole global batch, is the reference every loss,
gradient, norm and gathered state dict is compared with.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from _runtime_workers import MICROBATCH, N_MICROBATCHES, SPLITS, loss_fn, tutorial_model
import autopipe
from autopipe import DataParallelOptions
from autopipe.runtime import Pipeline
from autopipe.runtime.data_parallel import full_tensor

DP = 2
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
MAX_NORM = 0.05


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """16 sequences (DP x N_MICROBATCHES x MICROBATCH): inputs and next-token targets, (16, 9) each."""
    data = torch.stack([torch.arange(10) * (i + 1) % 100 for i in range(DP * N_MICROBATCHES * MICROBATCH)])
    return data[:, :-1], data[:, 1:]


def replica_batch(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's replica's rows of ``(x, y)``, as a DDP training loop draws them."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=pipe.dp_size, rank=pipe.dp_rank, shuffle=False)
    (batch,) = DataLoader(data, batch_size=len(x) // pipe.dp_size, sampler=sampler)
    return batch[0], batch[1]


def pp_dp_run(rank: int, world_size: int, dp_mode: str, use_mesh: bool) -> dict:
    """Each schedule, untied and tied: one step against the unsplit model, the clipped norm, the
    gathered state dict; then the errors of a badly named mesh and of batches that do not split."""
    mesh = init_device_mesh("cpu", (DP, world_size // DP), mesh_dim_names=("dp", "pp")) if use_mesh else None
    results: dict = {f"{schedule}{'+tied' if tied else ''}": _case(schedule, dp_mode, tied, mesh)
                     for tied in (False, True) for schedule in SCHEDULES}
    results["1F1B+global"] = _case("1F1B", dp_mode, False, mesh, batch="global")
    results["lengths"] = _lengths_case(dp_mode)
    results["1F1B+bf16"] = _bf16_case(dp_mode)
    x, y = global_batch()
    bad_mesh = init_device_mesh("cpu", (DP, world_size // DP), mesh_dim_names=("data", "pp"))
    results["bad_mesh_error"] = _error(lambda: Pipeline(tutorial_model(), example_args=(x[:MICROBATCH],),
                                                        loss_fn=loss_fn, split_points=SPLITS[2],
                                                        data_parallel=DataParallelOptions(mesh=bad_mesh)))
    # A plan made for pp x dp builds its mesh itself: no data_parallel= given.
    plan = autopipe.partition(tutorial_model(), world_size, (x[:MICROBATCH],),
                              data_parallel=DataParallelOptions(degree=DP, mode=dp_mode), loss_fn=False,
                              planner=autopipe.PlannerOptions(global_batch=len(x), cost="flops", profiling=autopipe.ProfileOptions(progress=False)))
    with Pipeline(tutorial_model(), example_args=(x[:MICROBATCH],), loss_fn=loss_fn, plan=plan) as pipe:
        dp = pipe.data_parallel
        rows, targets = replica_batch(pipe, x, y)
        results["from_plan"] = {"plan": (plan.dp_degree, plan.dp_mode, plan.pp_degree),
                                "built": (dp.dp_size, dp.mode, dp.pp_size) if dp else None,
                                "loss": pipe.step(rows, target=targets).item()}
    return results


def _error(fn) -> str | None:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _case(schedule: str, dp_mode: str, tied: bool, mesh, batch: str = "replica") -> dict:
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    model = tutorial_model(tied=tied)
    x, y = global_batch()
    replicas = (DataParallelOptions(mesh=mesh, mode=dp_mode, batch=batch) if mesh is not None
                else DataParallelOptions(DP, dp_mode, batch=batch))
    with Pipeline(model, example_args=(x[:MICROBATCH],), loss_fn=loss_fn, schedule=schedule,
                  n_microbatches=N_MICROBATCHES, split_points=SPLITS[2 * stages_per_rank],
                  data_parallel=replicas, planner=autopipe.PlannerOptions(stages_per_rank=stages_per_rank)) as pipe:
        refused = {}
        if batch == "global":  # refused before any work: the step that follows must still be exact
            refused["bad_batch_error"] = _error(lambda: pipe.step(x[:12], target=y[:12]))
        elif schedule == "1F1B" and not tied:  # the global batch handed to a rank that expects its replica's rows
            refused["global_to_replica_error"] = _error(lambda: pipe.step(x, target=y))
        given = (x, y) if batch == "global" else replica_batch(pipe, x, y)
        loss = pipe.step(given[0], target=given[1])
        ref = loss_fn(model(x), y)
        ref.backward()
        ref_grads = dict(model.named_parameters(remove_duplicate=False))
        grad_diff = {n: float("inf") if p.grad is None else
                     (full_tensor(p.grad) - ref_grads[n].grad).abs().max().item()
                     for n, p in pipe.named_parameters()}
        norm = pipe.clip_grad_norm_(MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        clipped_diff = max((full_tensor(p.grad) - ref_grads[n].grad).abs().max().item()
                           for n, p in pipe.named_parameters())
        full = pipe.state_dict(full=True)
        state_diff = max((full[k] - v).abs().max().item() for k, v in model.state_dict().items())
        # Loading a full state dict writes each rank's part (its shard under FSDP).
        shifted = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        pipe.load_state_dict(shifted)
        reloaded = pipe.state_dict(full=True)
        load_diff = max((reloaded[k] - v).abs().max().item() for k, v in shifted.items())
        return {"loss": loss.item(), "ref_loss": ref.item(), "grad_diff": grad_diff,
                "norm": norm.item(), "ref_norm": ref_norm.item(), "clipped_diff": clipped_diff,
                "state_keys_match": sorted(full) == sorted(model.state_dict()), "state_diff": state_diff, "load_diff": load_diff,
                "pp_rank": pipe.pp_rank, "dp_rank": pipe.data_parallel.dp_rank,
                "stage_indices": pipe.stage_indices, "dp_mode": pipe.data_parallel.mode, **refused}


def _lengths_case(dp_mode: str) -> dict:
    """Each replica's batch padded to its own length (5 and 7 tokens, traced at 9), as per-batch padding gives.

    Under "replicate" the mean over the replicas equals the unsplit model's mean of the two
    batches' losses; FSDP shards the traced stages only and refuses, on every rank.
    """
    # Under FSDP with dropout, which computes differently in eval mode: it trains, and eval mode is refused.
    model = tutorial_model(dropout=0.1 if dp_mode == "fsdp" else 0.0)
    x, y = global_batch()
    half = len(x) // DP
    parts = [(x[:half, :5], y[:half, :5]), (x[half:, :7], y[half:, :7])]
    with Pipeline(model, example_args=(x[:MICROBATCH],), loss_fn=loss_fn, schedule="1F1B",
                  n_microbatches=N_MICROBATCHES, split_points=SPLITS[2],
                  data_parallel=DataParallelOptions(DP, dp_mode)) as pipe:
        rows, targets = parts[pipe.dp_rank]
        if dp_mode == "fsdp":
            result = {"error": _error(lambda: pipe.step(rows, target=targets)),
                      "after": pipe.step(*replica_batch(pipe, x, y)[:1], target=replica_batch(pipe, x, y)[1]).item()}
            pipe.eval()
            result["eval_error"] = _error(lambda: pipe(replica_batch(pipe, x, y)[0]))
            return result
        loss = pipe.step(rows, target=targets)
        ref = sum(loss_fn(model(a), b) for a, b in parts) / DP
        ref.backward()
        ref_grads = dict(model.named_parameters())
        return {"loss": loss.item(), "ref_loss": ref.item(),
                "grad_diff": max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())}


def _bf16_case(dp_mode: str) -> dict:
    """bf16 mixed precision (FSDP: parameters gathered in bfloat16, gradients reduced in float32)."""
    model = tutorial_model()
    x, y = global_batch()
    with Pipeline(model, example_args=(x[:MICROBATCH],), loss_fn=loss_fn, schedule="1F1B",
                  n_microbatches=N_MICROBATCHES, split_points=SPLITS[2], data_parallel=DataParallelOptions(DP, dp_mode),
                  planner=autopipe.PlannerOptions(mixed_precision="bf16")) as pipe:
        rows, targets = replica_batch(pipe, x, y)
        loss = pipe.step(rows, target=targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = loss_fn(model(x), y)
        ref.backward()
        ref_grads = dict(model.named_parameters(remove_duplicate=False))
        diffs = [(full_tensor(p.grad).float() - ref_grads[n].grad).abs().max().item()
                 for n, p in pipe.named_parameters()]
        scale = max(ref_grads[n].grad.abs().max().item() for n, _ in pipe.named_parameters())
        return {"loss": loss.item(), "ref_loss": ref.item(), "grad_diff": max(diffs), "grad_scale": scale}
