"""Recomputation the planner chooses: a memory-bound case planned three ways, predicted and measured.

A stack of MLP blocks on 2 ranks under 1F1B with 8 micro-batches: stage 0 holds 2
micro-batches of activations at its peak, stage 1 one, so with the memory given here the
balanced split does not fit without recomputing on stage 0. Three plans of the same
profile and memory:

* **planner**: ``autopipe.partition(..., memory=M)``: it chooses, per stage, whether to
  recompute (``plan.recompute_stages``);
* **checkpoint every stage**: every stage recomputes, at the split whose predicted step is
  fastest that way;
* **no recomputation**: the fastest split that fits without recomputing at the same
  micro-batch count (stage 0 must stay small);
* beside them, **no recomputation, more micro-batches**: the fastest split that fits
  without recomputing with 2x or 4x as many smaller micro-batches of the same global batch
  (another way a 1F1B step sheds activation memory, outside what the planner is asked here).

For each, the predicted step (the cost model on the profile) and the measured step of a
real 2-rank gloo ``Pipeline`` on CPU, ``checkpoint_stages`` set to the variant's stages.
The variants run interleaved, one step each per round, and the medians are reported.

    python benchmarks/recompute/main.py            # full size
    python benchmarks/recompute/main.py --smoke    # a tiny run that only checks the script works

Writes results.json (results_smoke.json with --smoke) beside this file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402
from _pipebench import host_info, run_world  # noqa: E402

import autopipe  # noqa: E402
from autopipe.errors import InfeasibleMemoryError  # noqa: E402
from autopipe.machine.device import Device  # noqa: E402
from autopipe.machine.speed import measure_device_flops  # noqa: E402
from autopipe.planning import costmodel  # noqa: E402
from autopipe.planning.plan import Plan  # noqa: E402
from autopipe.runtime import Pipeline  # noqa: E402

SIZES = {  # (blocks, d_model, hidden, micro-batch rows, micro-batches, rounds)
    "full": (8, 64, 512, 1024, 8, 10),
    "smoke": (6, 16, 64, 8, 8, 2),
}


class Block(nn.Module):
    """A residual MLP block: saves its input, the hidden pre-activation and the activation."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def make_model(size: str) -> tuple[nn.Module, torch.Tensor]:
    blocks, d, hidden, rows, _, _ = SIZES[size]
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d, hidden) for _ in range(blocks)])
    return model, torch.randn(rows, d)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def predicted(plan: Plan, split_points: list[str], again: list[int], input_bytes: int) -> tuple[float, list[float]]:
    """Predicted step and per-stage peak bytes of ``split_points`` under the plan's schedule, ``again`` recomputing."""
    cuts = plan.segment_cuts(split_points)
    fwd, bwd = costmodel.stage_times_s(plan.segments, cuts, plan.n_microbatches, recompute=again)
    step = costmodel.predicted_step_s(fwd, bwd, plan.cut_comm_s(split_points), **plan.simulation_options(),
                                      tail=plan.step_tail)
    edges = [0, *cuts, len(plan.segments)]
    peaks = []
    for s, (i, j) in enumerate(zip(edges, edges[1:])):
        segs = plan.segments[i:j]
        static = costmodel.state_bytes(sum(g.param_bytes for g in segs), sum(g.trainable_param_bytes for g in segs),
                                       2.0)
        into = plan.segments[i].cut_fwd_bytes if i > 0 else input_bytes  # what a recomputing stage keeps
        peaks.append(costmodel.stage_peak_bytes(static, sum(g.act_bytes for g in segs),
                                                plan.stages[s].inflight_microbatches, recompute=s in again,
                                                input_bytes=into))
    return step, peaks


def best_split(plan: Plan, again: list[int], memory: float, input_bytes: int) -> tuple[list[str], float] | None:
    """The split (one cut, 2 stages) with the fastest predicted step that fits ``memory`` with ``again`` recomputing."""
    best = None
    for name in plan.segment_names[1:]:
        step, peaks = predicted(plan, [name], again, input_bytes)
        if max(peaks) <= memory and (best is None or step < best[1]):
            best = ([name], step)
    return best


def worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    model, x_mb = make_model(job["size"])
    _, _, _, rows, m, rounds = SIZES[job["size"]]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows * m, x_mb.shape[1], generator=g)
    y = torch.randn(rows * m, x_mb.shape[1], generator=g)
    # Every variant trains on the same global batch, in its own number of micro-batches.
    pipes = {v["label"]: Pipeline(model, example_args=(x[:rows * m // v["n_microbatches"]],), loss_fn=loss_fn,
                                  split_points=v["split_points"], schedule="1F1B",
                                  n_microbatches=v["n_microbatches"], checkpoint_stages=v["recompute"])
             for v in job["variants"]}
    times: dict[str, list[float]] = {label: [] for label in pipes}
    for pipe in pipes.values():  # warm-up: gradients, receive buffers
        pipe.step(x, target=y)
        pipe.step(x, target=y)
    for _ in range(rounds):
        for label, pipe in pipes.items():
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            times[label].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny run that only checks the script works")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size = "smoke" if args.smoke else "full"
    model, x_mb = make_model(size)
    blocks, d, hidden, rows, m, rounds = SIZES[size]
    # One FLOP rate for every plan, so their predictions compare (each partition would time its own).
    flops = measure_device_flops(torch.device("cpu"))
    dev = Device(flops=flops)
    quick = autopipe.ProfileOptions(warmup=1, repeats=5 if size == "full" else 1, progress=False)
    y_mb = torch.zeros_like(x_mb)
    # One profile for every plan; no memory limit first, to size the limit from it.
    free = autopipe.partition(model, 2, example_args=(x_mb,), schedule="1F1B", n_microbatches=m, devices=[dev, dev],
                              loss_fn=loss_fn, example_target=y_mb, profiling=quick, cost="flops")
    costs = free.segment_costs()
    # Stepping down from what the plan without a limit needs: the largest memory at which the
    # planner recomputes on some stages and not on others, preferring one where some split
    # also fits without recomputing at this micro-batch count.
    in_bytes = x_mb.numel() * x_mb.element_size()
    found = []
    for frac in [x / 100 for x in range(95, 30, -5)]:
        memory = int(frac * max(free.rank_peak_bytes))
        try:
            plan = autopipe.partition(model, 2, example_args=(x_mb,), schedule="1F1B", n_microbatches=m,
                                      devices=[Device(memory=memory, flops=flops)] * 2, loss_fn=loss_fn,
                                      example_target=y_mb, cost=costs)
        except InfeasibleMemoryError:
            break  # nor any smaller limit
        if 0 < len(plan.recompute_stages) < plan.num_stages:
            found.append((best_split(plan, [], memory, in_bytes) is not None, memory, plan))
    if not found:
        raise SystemExit("no memory limit tried makes the planner recompute on some stages only")
    _, memory, plan = max(found, key=lambda f: (f[0], f[1]))
    every = best_split(plan, [0, 1], memory, in_bytes)
    variants = [{"label": "planner", "split_points": list(plan.split_points), "recompute": list(plan.recompute_stages),
                 "n_microbatches": m, "predicted_step_s": plan.predicted_step_s}]
    if every is not None:
        variants.append({"label": "checkpoint every stage", "split_points": every[0], "recompute": [0, 1],
                         "n_microbatches": m, "predicted_step_s": every[1]})
    # Without recomputing: the fastest split that fits at this micro-batch count; and, beside it,
    # with 2x or 4x as many smaller micro-batches of the same global batch (each profiled at its
    # size), which a 1F1B step can also trade for activation memory.
    none = best_split(plan, [], memory, in_bytes)
    if none is not None:
        variants.append({"label": "no recomputation", "split_points": none[0], "recompute": [],
                         "n_microbatches": m, "predicted_step_s": none[1]})
    more = None
    for k in (2, 4):
        mb = x_mb[: rows // k]
        other = autopipe.partition(
            model, 2, example_args=(mb,), schedule="1F1B", n_microbatches=m * k, devices=[dev, dev],
            loss_fn=loss_fn, example_target=torch.zeros_like(mb), profiling=quick, cost="flops")
        hit = best_split(other, [], memory, mb.numel() * mb.element_size())
        if hit is not None and (more is None or hit[1] < more[1]):
            more = (hit[0], hit[1], m * k)
    if more is not None:
        variants.append({"label": "no recomputation, more micro-batches", "split_points": more[0], "recompute": [],
                         "n_microbatches": more[2], "predicted_step_s": more[1]})
    ranks = run_world(worker, 2, {"size": size, "variants": variants}, timeout_s=3000)
    for v in variants:
        per_round = [max(r[v["label"]][k] for r in ranks) for k in range(rounds)]  # a step ends on its last rank
        v["measured_step_s"] = statistics.median(per_round)
        v["measured_steps_s"] = per_round
    planner = variants[0]
    for v in variants:
        v["predicted_vs_planner"] = v["predicted_step_s"] / planner["predicted_step_s"]
        v["measured_vs_planner"] = v["measured_step_s"] / planner["measured_step_s"]
    out = args.out or str(Path(__file__).parent / ("results_smoke.json" if size != "full" else "results.json"))
    payload = {
        "benchmark": "recompute",
        "question": "when memory binds, does recomputing on the stages the planner picks beat recomputing "
                    "everywhere and the best split that recomputes nothing, predicted and measured?",
        "device": "cpu", "ranks": 2, "backend": "gloo", "size": size, "schedule": "1F1B", "n_microbatches": m,
        "model": f"{blocks} residual MLP blocks (d={d}, hidden={hidden}), micro-batch {rows} rows",
        "memory_per_device_bytes": memory,
        "planner_stage_peaks": [{"stage": st.index, "kept_bytes": st.peak_bytes_kept,
                                 "recomputed_bytes": st.peak_bytes_recomputed} for st in plan.stages],
        "measure": f"median over {rounds} interleaved rounds of one training step, the slower rank's time",
        "host": host_info(), "variants": variants,
    }
    path = write_result(out, payload)
    for v in variants:
        print(f"{v['label']:>24}: split {v['split_points']}, recompute {v['recompute']}, "
              f"m={v['n_microbatches']}: predicted "
              f"{v['predicted_step_s'] * 1e3:8.2f} ms, measured {v['measured_step_s'] * 1e3:8.2f} ms "
              f"({v['measured_vs_planner']:.2f}x the planner's)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
