"""Real steps of pp 2 against tp 2 on two gloo ranks, beside what the cost models predict for each.

One model (the seed Transformer, plain torch, 4 blocks) on 2 CPU ranks, one thread each:

* **pp 2**: ``autopipe.Pipeline`` split before ``layers.2``, 1F1B, 4 micro-batches;
* **tp 2**: one stage on both ranks, ``DataParallelOptions(tensor_parallel=2)``, 4 micro-batches;
* **tp 2 sp**: the same with ``sequence_parallel=True`` and ``loss_parallel=True``, as a layout with
  tp > 1 is charged (its collectives reduce-scatters and all-gathers of the same bytes, its
  output layer sharded along the vocabulary).

Both pipelines are built in the same world and stepped in interleaved rounds (pp, tp, pp, tp,
...); a variant's step is the median over the rounds of the slower rank's step. Beside them:

* **pp 2 predicted**: the pipeline planner's step for that split
  (:meth:`autopipe.Plan.split_step_s`, costs measured on one process before the world starts);
* **tp 2 predicted**: a second profile's segments, taken with the math attention kernel (the one a
  tensor-parallel stage runs on the CPU), those of a block with matrix multiplies halved (what a
  rank of the pair computes) and the rest whole, for every micro-batch; plus
  the tensor-parallel all-reduces the layout model charges per block and micro-batch
  (:func:`autopipe.layouts.blocks.tp_collectives`), each at the layout model's ring cost
  (:meth:`autopipe.layouts.gpu.GpuCosts.allreduce_s`) over the gloo link measured between the
  two ranks (:func:`autopipe.machine.link.measure_link_in_group`);
* **the collectives themselves**: how many all-reduces a tp step runs
  (:class:`autopipe.runtime.tensor_parallel.CollectiveCount`) against the count charged, and
  one all-reduce of a block's activation timed on gloo against its charge.

Nothing is asserted. ``results.json`` goes beside this file; ``benchmarks/render_docs.py``
renders it. Hold the machine (``flock``): other work on the two cores moves every figure.

    python benchmarks/tensor_parallel/main.py            # 15 rounds, about 1 minute on 2 cores
    python benchmarks/tensor_parallel/main.py --smoke    # a tiny model, 2 rounds: checks the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import host_info, median, run_world  # noqa: E402

#: The model and micro-batch: "full" gives each block's matrices most of the step, as in an LM.
SIZES = {"full": dict(vocab=2000, d_model=256, num_heads=8, d_ff=1024, num_layers=4, batch=4, seq_len=64),
         "smoke": dict(vocab=128, d_model=32, num_heads=2, d_ff=64, num_layers=4, batch=2, seq_len=8)}
N_MICROBATCHES = 4
SPLIT = ["layers.2"]


def _model(size: str) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    from autopipe.models import seed_transformer

    z = SIZES[size]
    torch.manual_seed(0)
    return seed_transformer(z["vocab"], d_model=z["d_model"], num_heads=z["num_heads"], d_ff=z["d_ff"],
                            num_layers=z["num_layers"], batch=z["batch"], seq_len=z["seq_len"])


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def _profile(size: str) -> Any:
    """A plan of 2 stages from costs measured on this process (one thread, as each rank computes)."""
    import autopipe

    model, args = _model(size)
    target = torch.randint(0, SIZES[size]["vocab"], args[0].shape, generator=torch.Generator().manual_seed(2))
    return autopipe.partition(model, 2, args, schedule="1F1B", n_microbatches=N_MICROBATCHES, loss_fn=_loss,
                              example_target=target,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(progress=False)))


def predicted_compute(size: str) -> dict[str, Any]:
    """pp 2's predicted step, and tp 2's compute per step. The latter is profiled with the math
    attention kernel, the one a tensor-parallel stage runs on the CPU (runtime.tensor_parallel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plan = _profile(size)
    with sdpa_kernel([SDPBackend.MATH]):
        math_plan = _profile(size)
    whole = halved = 0.0
    for name, seg in zip(math_plan.segment_names, math_plan.segment_costs()):
        seconds = seg.fwd_s + seg.bwd_s + seg.accum_s
        # A block's matrix multiplies (its projections and the attention core) are split over the pair.
        if name.startswith("layers.") and seg.flops > 0:
            halved += seconds
        else:
            whole += seconds
    return {"pp_predicted_s": plan.split_step_s(SPLIT), "tp_compute_s": N_MICROBATCHES * (whole + halved / 2),
            "tp_compute_parts_s": {"whole": N_MICROBATCHES * whole, "halved": N_MICROBATCHES * halved / 2},
            "math_over_default_compute": math_plan.split_step_s(SPLIT) / plan.split_step_s(SPLIT)}


def _timed_step(pipe: Any, batch: torch.Tensor, target: torch.Tensor) -> float:
    """The slower rank's seconds for one step (a barrier before, the slowest after)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    pipe.zero_grad()
    pipe.step(batch, target=target)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def world(rank: int, world_size: int, job: dict[str, Any]) -> dict[str, Any]:
    """Both pipelines, the interleaved rounds, the collective count and the link (every rank)."""
    import torch.distributed as dist
    from autopipe import DataParallelOptions
    from autopipe.runtime import Pipeline
    from autopipe.runtime.tensor_parallel import CollectiveCount

    model, args = _model(job["size"])
    rows = args[0].shape[0] * N_MICROBATCHES
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, SIZES[job["size"]]["vocab"], (rows, args[0].shape[1]), generator=g)
    target = torch.randint(0, SIZES[job["size"]]["vocab"], batch.shape, generator=g)
    common = dict(example_args=args, loss_fn=_loss, schedule="1F1B", n_microbatches=N_MICROBATCHES)
    pipes = {"pp": Pipeline(model, split_points=SPLIT, **common),
             "tp": Pipeline(model, split_points=[], data_parallel=DataParallelOptions(tensor_parallel=2), **common),
             "tp_sp": Pipeline(model, split_points=[], data_parallel=DataParallelOptions(
                 tensor_parallel=2, sequence_parallel=True, loss_parallel=True), **common)}
    steps: dict[str, list[float]] = {k: [] for k in pipes}
    for _ in range(job["warmup"]):
        for key, pipe in pipes.items():
            _timed_step(pipe, batch, target)
    for _ in range(job["rounds"]):
        for key, pipe in pipes.items():
            steps[key].append(_timed_step(pipe, batch, target))
    counts = {}
    for key in ("tp", "tp_sp"):
        with CollectiveCount() as comm:
            pipes[key].step(batch, target=target)
        counts[key] = dict(comm.counts)

    from autopipe.machine.link import measure_link_in_group

    message = args[0].numel() * SIZES[job["size"]]["d_model"] * 4  # a block's activation, float32
    # Sizes up to several MiB, so the fitted bandwidth is read where it shows (and around the message).
    sizes = sorted({1024, message, 1 << 20, 4 << 20})
    link = measure_link_in_group(0, 1, sizes_bytes=sizes, repeats=job["link_repeats"])
    buffer = torch.zeros(message // 4)
    for _ in range(3):
        dist.all_reduce(buffer)
    times = []
    for _ in range(job["link_repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buffer)
        times.append(time.perf_counter() - t0)
    for pipe in pipes.values():
        pipe.close()
    return {"steps_s": steps, "tp_comm_counts": counts["tp"], "tp_sp_comm_counts": counts["tp_sp"],
            "message_bytes": message,
            "link": {"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s},
            "allreduce_measured_s": median(times)}


def charged_collectives(size: str, link: dict[str, float], message: int) -> dict[str, Any]:
    """What the layout model charges the tensor-parallel collectives of one step, over the measured link."""
    from autopipe.layouts.blocks import tp_collectives
    from autopipe.layouts.gpu import Efficiency, GpuCosts
    from autopipe.machine.topology import Topology

    gloo = (link["bandwidth_bytes_per_s"], link["latency_s"])
    # Only the link matters here: the accelerator named stands for nothing else.
    costs = GpuCosts("H100", Topology(gpus_per_node=2, intra=gloo, inter=gloo), dtype="bf16",
                     efficiency=Efficiency(collective=1.0))
    one = costs.allreduce_s(message, 2, crosses_nodes=False)
    per_block = tp_collectives(2, recompute="none")
    count = N_MICROBATCHES * SIZES[size]["num_layers"] * (per_block["forward"] + per_block["backward"])
    return {"allreduce_charged_s": one, "allreduces_charged": count, "tp_comm_charged_s": count * one}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 2 rounds: checks the script")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15, smoke 2)")
    parser.add_argument("--out", default=None, help="where to write the results (default: results.json here)")
    args = parser.parse_args(argv)
    size = "smoke" if args.smoke else "full"
    job = {"size": size, "rounds": args.rounds or (2 if args.smoke else 15), "warmup": 1 if args.smoke else 3,
           "link_repeats": 3 if args.smoke else 20}
    host_before = host_info()
    t0 = time.perf_counter()
    torch.set_num_threads(1)  # the profile computes as each rank does: one thread
    profile = predicted_compute(size)
    ranks = run_world(world, 2, job, threads=1, timeout_s=900)
    measured = ranks[0]
    charged = charged_collectives(size, measured["link"], measured["message_bytes"])
    steps = {k: median(v) for k, v in measured["steps_s"].items()}
    tp_predicted = profile["tp_compute_s"] + charged["tp_comm_charged_s"]
    result = {
        "question": "On two gloo ranks, how do real steps of pp 2 and tp 2 compare, and how close is each "
                    "prediction, the tensor-parallel collectives' included?",
        "size": size, "model": {"name": "seed_transformer", **SIZES[size]}, "n_microbatches": N_MICROBATCHES,
        "rounds": job["rounds"], "split": SPLIT,
        "pp": {"measured_s": steps["pp"], "predicted_s": profile["pp_predicted_s"],
               "rounds_s": measured["steps_s"]["pp"]},
        "tp": {"measured_s": steps["tp"], "predicted_s": tp_predicted, "rounds_s": measured["steps_s"]["tp"],
               "compute_predicted_s": profile["tp_compute_s"], "compute_parts_s": profile["tp_compute_parts_s"],
               "comm_charged_s": charged["tp_comm_charged_s"]},
        "tp_sp": {"measured_s": steps["tp_sp"], "rounds_s": measured["steps_s"]["tp_sp"],
                  "collectives_counted": measured["tp_sp_comm_counts"]},
        "collectives": {"counted": measured["tp_comm_counts"], "allreduces_charged": charged["allreduces_charged"],
                        "message_bytes": measured["message_bytes"], "link": measured["link"],
                        "allreduce_measured_s": measured["allreduce_measured_s"],
                        "allreduce_charged_s": charged["allreduce_charged_s"]},
        # What neither the compute nor the charged all-reduces explain: the extra all-reduces, each one's
        # excess over its charge, and DTensor's own work around every op.
        "tp_unexplained_s": steps["tp"] - profile["tp_compute_s"]
        - sum(measured["tp_comm_counts"].values()) * measured["allreduce_measured_s"],
        "math_over_default_compute": profile["math_over_default_compute"],
        "tp_over_pp_measured": steps["tp"] / steps["pp"],
        "tp_over_pp_predicted": tp_predicted / profile["pp_predicted_s"],
        "threads_per_process": 1, "host_start": host_before, "host_end": host_info(), "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else Path(__file__).with_name("results_smoke.json" if args.smoke else "results.json")
    write_result(out, result)
    print(f"pp 2: {steps['pp'] * 1e3:.1f} ms measured, {profile['pp_predicted_s'] * 1e3:.1f} ms predicted")
    print(f"tp 2: {steps['tp'] * 1e3:.1f} ms measured, {tp_predicted * 1e3:.1f} ms predicted "
          f"({charged['tp_comm_charged_s'] * 1e3:.1f} ms of it all-reduces)")
    print(f"tp 2 sp + loss_parallel: {steps['tp_sp'] * 1e3:.1f} ms measured; collectives "
          f"{measured['tp_sp_comm_counts']}")
    print(f"all-reduces per step: {measured['tp_comm_counts']} counted, {charged['allreduces_charged']} charged; "
          f"one: {measured['allreduce_measured_s'] * 1e6:.0f} us measured, "
          f"{charged['allreduce_charged_s'] * 1e6:.0f} us charged")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
