"""What each rank runs in the runtime tests (spawned by tests/_dist_utils.run_world).

Every function takes ``(rank, world_size, ...)`` and returns plain data for the test to
check. The model is the seed tutorial's Transformer (vocabulary 100, d_model 12, 4 heads)
without dropout, trained on the tutorial's data set (sequence ``i`` is ten tokens ``i``),
so that the unsplit model, run in the same process on the same batch, is the reference.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn

from autopipe.models.transformer import SeedTransformer
from autopipe.planning.options import PlannerOptions, ProfileOptions
from autopipe.runtime import Pipeline

VOCAB = 100
MICROBATCH = 2  # sequences per micro-batch
N_MICROBATCHES = 4

# Split points giving n_ranks * stages_per_rank stages of the tutorial model. The 4-stage
# split cuts inside attention blocks, as the planner may: stage 0 sends two tensors (one a
# view), and the residual of layers.1 skips from stage 1 to stage 3.
SPLITS = {
    2: ["layers.1"],
    4: ["layers.0.attention.out_linear", "layers.1", "layers.1.attention.out_linear"],
    8: [f"layers.{i}" for i in range(6)] + ["out_linear"],
}
# A cut where a strided (non-contiguous) tensor crosses: k_linear's input is a transpose's.
NON_CONTIGUOUS_SPLIT = ["layers.1.attention.k_linear"]


def tutorial_model(*, num_layers: int = 2, dropout: float = 0.0, tied: bool = False, seed: int = 0) -> SeedTransformer:
    torch.manual_seed(seed)
    model = SeedTransformer(VOCAB, d_model=12, num_heads=4, d_ff=24, num_layers=num_layers, max_len=100,
                            dropout=dropout)
    if tied:  # GPT-2 style: the output layer reuses the embedding matrix
        model.out_linear.weight = model.embedding.weight
    return model


def tutorial_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of the tutorial data: inputs and next-token targets, (8, 9) each."""
    data = torch.stack([torch.full((10,), i) for i in range(16)])
    batch = data.roll(-step * MICROBATCH * N_MICROBATCHES, 0)[: MICROBATCH * N_MICROBATCHES]
    return batch[:, :-1], batch[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def example_args() -> tuple[torch.Tensor]:
    return (tutorial_batch(0)[0][:MICROBATCH],)


def build(model: nn.Module, schedule: str, total_stages: int, stages_per_rank: int | None = None,
          recompute: bool | str = "auto", **options) -> Pipeline:
    if "split_points" not in options:
        options["split_points"] = SPLITS[total_stages]
    options.setdefault("n_microbatches", N_MICROBATCHES)
    return Pipeline(model, example_args=example_args(), loss_fn=loss_fn, schedule=schedule,
                    planner=PlannerOptions(stages_per_rank=stages_per_rank, recompute=recompute), **options)


def compare_with_unsplit(pipe: Pipeline, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One pipeline step and one unsplit step on the same batch: losses and gradient differences."""
    loss = pipe.step(x, target=y)
    model.zero_grad()
    return against_reference(pipe, model, loss, loss_fn(model(x), y))


def against_reference(pipe: Pipeline, model: nn.Module, loss: torch.Tensor, ref: torch.Tensor) -> dict:
    """Backward the unsplit model's loss ``ref``; the pipeline's loss and gradients next to it.

    ``grad_diff`` maps each parameter the pipeline holds to its largest absolute difference
    from the unsplit model's gradient (inf when the pipeline computed none).
    """
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    grad_diff = {
        n: float("inf") if p.grad is None else (p.grad - ref_grads[n]).abs().max().item()
        for n, p in pipe.named_parameters()
    }
    return {"loss": loss.item(), "ref_loss": ref.item(), "grad_diff": grad_diff, "all_param_names": sorted(ref_grads)}


# ---------------------------------------------------------------------- workers
def schedule_run(rank: int, world_size: int, schedule: str, n_steps: int) -> dict:
    """Step 1 against the unsplit model, the merged output, then training for n_steps."""
    model = tutorial_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    pipe = build(model, schedule, world_size * stages_per_rank)
    result = {
        "model_unchanged": all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        and not any("forward" in m.__dict__ for m in model.modules()),
        "stage_indices": pipe.stage_indices,
        "has_last_stage": pipe.has_last_stage,
    }
    x, y = tutorial_batch(0)
    result.update(compare_with_unsplit(pipe, model, x, y))
    output = pipe(x)
    result["output_diff"] = None if output is None else (output - model(x)).abs().max().item()
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    opt.step()  # the gradients of step 1
    losses = [result["loss"]]
    for step in range(1, n_steps):
        x, y = tutorial_batch(step)
        opt.zero_grad()
        losses.append(pipe.step(x, target=y).item())
        opt.step()
    result["losses"] = losses
    return result


def gradients_run(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """Loss and gradients of one step against the unsplit model, for each (schedule, stages_per_rank, split)."""
    return [_gradients_case(world_size, *case) for case in cases]


def _gradients_case(world_size: int, schedule: str, stages_per_rank: int, split_points: tuple = ()) -> dict:
    n_stages = world_size * stages_per_rank
    model = tutorial_model(num_layers=6 if n_stages == 8 else 2)
    pipe = build(model, schedule, n_stages, stages_per_rank=stages_per_rank,
                 split_points=list(split_points) or SPLITS[n_stages])
    return compare_with_unsplit(pipe, model, *tutorial_batch(0))


GPT2_SPLITS = {2: ["transformer.h.1"], 4: ["transformer.h.1", "transformer.h.2", "transformer.h.3"]}


def gpt2_run(rank: int, world_size: int, schedules: list[str]) -> dict[str, dict]:
    """GPT-2 from a config: tied embedding/head, a causal mask read by every block."""
    return {schedule: _gpt2_case(schedule, world_size) for schedule in schedules}


def _gpt2_case(schedule: str, world_size: int, split_points: list[str] | None = None) -> dict:
    from zoo.hf import gpt2_from_config

    vocab = 64
    model, (x_mb,) = gpt2_from_config(n_layer=4, n_embd=16, n_head=2, vocab_size=vocab, seq_len=8, batch=2)
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    pipe = Pipeline(model, example_args=(x_mb,), schedule=schedule, n_microbatches=N_MICROBATCHES,
                    split_points=split_points or GPT2_SPLITS[world_size * stages_per_rank],
                    loss_fn=lambda out, y: nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1)))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (2 * N_MICROBATCHES, 8), generator=g)
    y = torch.randint(0, vocab, (2 * N_MICROBATCHES, 8), generator=g)
    loss = pipe.step(x, target=y)
    return against_reference(pipe, model, loss, nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)))


# A V-schedule split of GPT-2 whose first cut sends the integer position ids
# (``transformer.wpe`` reads them), and one of the U-Net whose cuts carry the encoder's
# skip connections, so gradients come back through ``torch.cat`` as strided slices.
GPT2_INTEGER_CUT = ["transformer.wpe", "transformer.h.1", "transformer.h.3"]
UNET_SKIP_CUTS = ["down.1", "mid", "up.1"]
# Cuts whose first stages send the residual stream that their own layer norms saved for backward.
GPT2_RESIDUAL_CUTS = ["transformer.h.1.attn.c_proj", "transformer.h.2.mlp.c_proj", "lm_head"]


def v_boundaries_run(rank: int, world_size: int, schedules: list[str]) -> dict[str, dict]:
    """V schedules across integer tensors and non-contiguous gradients, against the unsplit models."""
    results = {}
    for schedule in schedules:
        results[f"gpt2-{schedule}"] = _gpt2_case(schedule, world_size, GPT2_INTEGER_CUT)
        results[f"gpt2-residual-{schedule}"] = _gpt2_case(schedule, world_size, GPT2_RESIDUAL_CUTS)
        results[f"unet-{schedule}"] = _unet_case(schedule)
    return results


def _unet_case(schedule: str) -> dict:
    from zoo import unet

    model, (x_mb,) = unet(base_width=4, depth=3, image_size=16, batch=2)
    pipe = Pipeline(model, example_args=(x_mb,), schedule=schedule, n_microbatches=N_MICROBATCHES,
                    split_points=UNET_SKIP_CUTS, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * N_MICROBATCHES, *x_mb.shape[1:], generator=g)
    y = torch.randn(2 * N_MICROBATCHES, 2, 16, 16, generator=g)
    loss = pipe.step(x, target=y)
    # Batch norm normalises each micro-batch by its own statistics in the pipeline, so the
    # reference runs the unsplit model micro-batch by micro-batch too.
    ref = sum(nn.functional.mse_loss(model(xi), yi) for xi, yi in zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES)))
    return against_reference(pipe, model, loss, ref / N_MICROBATCHES)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def tied_and_state_run(rank: int, world_size: int) -> dict:
    """Tied weights across ranks and on one rank; state_dict round trips."""
    result: dict = {}
    x, y = tutorial_batch(0)

    # Tied embedding / output layer on two ranks (1F1B: stage 0 on rank 0, stage 1 on rank 1).
    model = tutorial_model(tied=True)
    pipe = build(model, "1F1B", 2)
    result["tied_names"] = [n for n, _ in pipe.named_parameters() if n == "embedding.weight"]
    result["tied_grad_diff"] = compare_with_unsplit(pipe, model, x, y)["grad_diff"].get("embedding.weight")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    opt.step()
    for step in range(1, 4):
        xs, ys = tutorial_batch(step)
        opt.zero_grad()
        pipe.step(xs, target=ys)
        opt.step()
    tied = dict(pipe.named_parameters())["embedding.weight"].detach()
    copies = _gather(tied)
    result["tied_copies_equal"] = all(torch.equal(copies[0], c) for c in copies)
    full = pipe.state_dict(full=True)
    result["tied_full_keys"] = sorted(full)
    reloaded = tutorial_model(tied=True, seed=1)
    reloaded.load_state_dict(full)  # strict: every key of the unsplit model, aliases included
    out = pipe(x)
    result["tied_reload_diff"] = None if out is None else (out - reloaded(x)).abs().max().item()

    # Tied weights with both uses on rank 0 (ZBV places stages 0 and 3 there).
    model = tutorial_model(tied=True)
    pipe = build(model, "ZBVZeroBubble", 4)
    result["v_tied_count"] = sum(n == "embedding.weight" for n, _ in pipe.named_parameters())
    result["v_tied_grad_diff"] = compare_with_unsplit(pipe, model, x, y)["grad_diff"]

    # unsplit -> pipeline -> a training step -> gathered state_dict -> unsplit model.
    model = tutorial_model()
    pipe = build(model, "1F1B", 2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.step(x, target=y)
    opt.step()
    full = pipe.state_dict(full=True)
    result["full_keys_match"] = sorted(full) == sorted(model.state_dict())
    fresh = tutorial_model(seed=1)
    fresh.load_state_dict(full)
    out = pipe(x)
    result["round_trip_diff"] = None if out is None else (out - fresh(x)).abs().max().item()
    # ... and back: the unsplit model's state_dict into the pipeline.
    other = tutorial_model(seed=2)
    pipe.load_state_dict(other.state_dict())
    out = pipe(x)
    result["load_diff"] = None if out is None else (out - other(x)).abs().max().item()
    # Per-rank files: this rank's state_dict restores this rank's tensors.
    local = {k: v.clone() for k, v in pipe.state_dict().items()}
    for p in pipe.parameters():
        p.data.zero_()
    pipe.load_state_dict(local)
    result["local_restored"] = all(torch.equal(local[k], v) for k, v in pipe.state_dict().items())
    return result


def checkpointing_and_modes_run(rank: int, world_size: int) -> dict:
    """Activation checkpointing keeps gradients; eval mode turns dropout off."""
    result: dict = {}
    x, y = tutorial_batch(0)
    for schedule, n_stages in (("1F1B", 2), ("ZBVZeroBubble", 4)):
        model = tutorial_model()
        pipe = build(model, schedule, n_stages, recompute=True)
        result[f"checkpointed_{schedule}"] = compare_with_unsplit(pipe, model, x, y)

    model = tutorial_model(dropout=0.5)
    pipe = build(model, "1F1B", 2)
    model.eval()
    pipe.eval()
    out = pipe(x)
    result["eval_output_diff"] = None if out is None else (out - model(x)).abs().max().item()
    result["eval_loss"] = pipe.evaluate(x, target=y).item()
    result["ref_eval_loss"] = loss_fn(model(x), y).item()
    try:
        pipe.step(x, target=y)
        result["step_in_eval_mode"] = "no error"
    except RuntimeError as e:
        result["step_in_eval_mode"] = str(e)
    pipe.train()
    result["train_mode_loss"] = pipe.step(x, target=y).item()  # runs: dropout on, finite loss

    # Each rank given only what its stages read: the inputs where the first stage runs, the
    # target where the last does, nothing elsewhere (V schedules hold both ends on rank 0).
    for schedule, n_stages in (("1F1B", 2), ("ZBVZeroBubble", 4)):
        model = tutorial_model()
        pipe = build(model, schedule, n_stages)
        inputs = (x,) if 0 in pipe.stage_indices else ()
        target = y if n_stages - 1 in pipe.stage_indices else None
        loss = pipe.step(*inputs, target=target)
        result[f"only_needed_{schedule}"] = against_reference(pipe, model, loss, loss_fn(model(x), y))
        result[f"only_needed_eval_{schedule}"] = (pipe.evaluate(*inputs, target=target).item(),
                                                  loss_fn(model(x), y).item())
    result["short"] = short_batch_run(rank, world_size)
    result["lengths"] = other_lengths_run(rank, world_size)

    # Stage times inside running steps (ZBV: two stages per rank, the backward split in B and W).
    pipe = build(tutorial_model(), "ZBVZeroBubble", 4)
    pipe.step(x, target=y)
    grads = [p.grad.clone() for p in pipe.parameters()]
    measured = pipe.measure_stage_times(x, target=y, steps=2)
    result["stage_times"] = measured
    result["grads_left_alone"] = all(torch.equal(g, p.grad) for g, p in zip(grads, pipe.parameters()))
    result["calibrated_fwd_s"] = [st.fwd_s for st in pipe.plan.calibrate(measured).stages]
    result["bad_steps"] = _error(lambda: pipe.measure_stage_times(x, target=y, steps=0))
    return result


def failing_rank_run(rank: int, world_size: int) -> None:
    """Rank 1 (the last stage) raises inside its loss on the second step."""
    calls = {"n": 0}

    def flaky_loss(output, target):
        calls["n"] += 1
        if rank == 1 and calls["n"] > N_MICROBATCHES:
            raise RuntimeError("injected failure on rank 1")
        return loss_fn(output, target)

    model = tutorial_model()
    pipe = Pipeline(model, example_args=example_args(), loss_fn=flaky_loss, split_points=SPLITS[2],
                    schedule="1F1B", n_microbatches=N_MICROBATCHES)
    for step in range(3):
        xs, ys = tutorial_batch(step)
        pipe.step(xs, target=ys)


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def errors_run(rank: int, world_size: int, plan_path: str) -> dict:
    """Bad input fails with a clear error on every rank, and the job goes on afterwards."""
    import autopipe.planning.planner

    result: dict = {}
    model = tutorial_model()
    pipe = build(model, "1F1B", 2)
    x, y = tutorial_batch(0)
    result["odd_batch"] = _error(lambda: pipe.step(x[:7], target=y[:7]))
    result["odd_target"] = _error(lambda: pipe.step(x, target=y[:7]))
    result["step_after_errors"] = pipe.step(x, target=y).item()  # nothing was half-sent
    result["ranks_mismatch"] = _error(lambda: build(model, "1F1B", 2, split_points=SPLITS[4][:2]))
    result["plan_world_mismatch"] = _error(lambda: Pipeline(model, example_args=example_args(), loss_fn=loss_fn,
                                                            plan=plan_path,
                                                            planner=PlannerOptions(stages_per_rank=1)))
    result["ranks_disagree"] = _error(lambda: build(model, "1F1B", 2, split_points=["layers.1" if rank == 0 else "layers.0"]))

    # Planning: rank 0 runs the planner once; every rank builds the plan it broadcasts.
    calls = []
    real_partition = autopipe.planning.planner.plan_partition

    def counting_partition(*args, **kwargs):
        calls.append(1)
        return real_partition(*args, **kwargs)

    autopipe.planning.planner.plan_partition = counting_partition
    try:
        planned = Pipeline(model, example_args=example_args(), loss_fn=loss_fn, schedule="1F1B",
                           n_microbatches=N_MICROBATCHES,
                           planner=PlannerOptions(profiling=ProfileOptions(progress=False, repeats=1, warmup=0)))
    finally:
        autopipe.planning.planner.plan_partition = real_partition
    result["planner_calls"] = len(calls)
    result["planned_split"] = planned.plan.split_points
    result["planned_step"] = planned.step(x, target=y).item()

    # The same plan, saved and loaded from a file, builds the same pipeline.
    path = plan_path.replace(".json", f"_saved_by_rank{rank}.json")
    planned.plan.save(path)
    reloaded = Pipeline(model, example_args=example_args(), loss_fn=loss_fn, plan=path)
    result["plan_file_step"] = reloaded.step(x, target=y).item()
    return result


#: (schedule, stages, micro-batches held) of the short-batch checks: one and three of four,
#: one stage per rank and a V (both ends of the pipeline on rank 0).
SHORT_BATCH_CASES = (("1F1B", 2, 3), ("1F1B", 2, 1), ("ZBVZeroBubble", 4, 3))


def short_batch_run(rank: int, world_size: int) -> dict:
    """A batch of 3 micro-batches (and 1) on pipelines built for 4, against the unsplit model on the same rows."""
    result: dict = {}
    x, y = tutorial_batch(0)
    for schedule, n_stages, held in SHORT_BATCH_CASES:
        rows = held * MICROBATCH
        model = tutorial_model()
        pipe = build(model, schedule, n_stages)
        inputs = (x[:rows],) if 0 in pipe.stage_indices else ()
        target = y[:rows] if n_stages - 1 in pipe.stage_indices else None
        loss = pipe.step(*inputs, target=target)
        case = against_reference(pipe, model, loss, loss_fn(model(x[:rows]), y[:rows]))
        case["eval"] = (pipe.evaluate(*inputs, target=target).item(), loss_fn(model(x[:rows]), y[:rows]).item())
        out = pipe(*inputs)
        case["forward_diff"] = None if out is None else (out - model(x[:rows])).abs().max().item()
        case["full_after"] = pipe.step(x, target=y).item()  # a whole batch again: every micro-batch counts
        case["ref_full"] = loss_fn(model(x), y).item()
        result[f"{schedule}-{held}"] = case
    return result


#: (schedule, stages) of the other-length checks: one stage per rank, and a V with a split backward.
LENGTH_CASES = (("1F1B", 2), ("ZBVZeroBubble", 4))
#: (sequence length, rows) of the calls, in order, on a pipeline traced at length 12:
#: shorter, longer, a short last batch at another length, the traced length again, 8 once more.
LENGTH_CALLS = ((8, 8), (16, 8), (16, 6), (12, 8), (8, 8))


def sequences(length: int, rows: int = MICROBATCH * N_MICROBATCHES) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` token sequences of ``length`` (sequence ``i`` counts up from ``i``) and their next tokens."""
    data = torch.stack([torch.arange(i, i + length + 1) % VOCAB for i in range(rows)])
    return data[:, :-1], data[:, 1:]


def other_lengths_run(rank: int, world_size: int) -> dict:
    """Calls whose sequence length differs from the traced one, against the unsplit model on the same batch."""
    result: dict = {}
    for schedule, n_stages in LENGTH_CASES:
        model = tutorial_model()
        pipe = Pipeline(model, example_args=(sequences(12)[0][:MICROBATCH],), loss_fn=loss_fn, schedule=schedule,
                        split_points=SPLITS[n_stages], n_microbatches=N_MICROBATCHES)
        for call, (length, rows) in enumerate(LENGTH_CALLS):
            x, y = sequences(length, rows)
            inputs = (x,) if 0 in pipe.stage_indices else ()
            target = y if n_stages - 1 in pipe.stage_indices else None
            pipe.zero_grad()
            model.zero_grad()
            loss = pipe.step(*inputs, target=target)
            case = against_reference(pipe, model, loss, loss_fn(model(x), y))
            case["eval"] = (pipe.evaluate(*inputs, target=target).item(), loss_fn(model(x), y).item())
            out = pipe(*inputs)
            case["forward_diff"] = None if out is None else (out - model(x)).abs().max().item()
            result[f"{schedule}-{call}"] = case
        result[f"{schedule}-shapes"] = len(pipe._shapes._kept)
        if schedule == "1F1B":
            result["linecache"] = _generated_source_over_cycles(pipe)
    return result


def _generated_source_over_cycles(pipe: Pipeline) -> list[int]:
    """``linecache``'s size after each of two cycles through one more length than a pipeline keeps: every
    call traces the stages again and drops another shape's. The pipeline keeps 2 shapes here instead of
    ``KEPT_SHAPES``: the same dropping, with a third of the traces."""
    import linecache

    from autopipe.runtime import shapes

    kept, shapes.KEPT_SHAPES = shapes.KEPT_SHAPES, 2
    try:
        lengths = [k for k in range(3, 20) if k not in (8, 12, 16)][:shapes.KEPT_SHAPES + 1]
        sizes = []
        for _ in range(2):
            for length in lengths:
                x, y = sequences(length)
                pipe.step(*((x,) if 0 in pipe.stage_indices else ()), target=y if pipe.has_last_stage else None)
            sizes.append(len(linecache.cache))
    finally:
        shapes.KEPT_SHAPES = kept
    return sizes
