"""Recomputation the planner chooses: a memory-bound case planned several ways, predicted and measured.

A model whose first half saves many activations per FLOP (wide MLP blocks with a chain of
elementwise ops on the hidden tensor) and whose second half saves few (wide square layers:
parameters and compute, little activation), on 2 ranks under 1F1B: stage 0 holds 2
micro-batches of activations at its peak, stage 1 one. One measured profile, one memory per
device at which the planner recomputes on stage 0 and not on stage 1, then:

* **planner**: ``autopipe.partition(..., planner=PlannerOptions(memory=M))`` (``recompute="auto"``): its split and
  ``plan.recompute_stages``;
* **checkpoint every stage**: every stage recomputes, at the split whose predicted step is
  fastest so among those that fit (the planner's own per-rank memory model,
  :func:`autopipe.planning.schedule_options.predict_split`);
* **no recomputation**: ``PlannerOptions(memory=M, recompute=False)``, the best
  plan the planner finds keeping every activation, at the same micro-batch count;
* beside them, **no recomputation, more micro-batches**: ``recompute=False`` with 2x or 4x
  as many smaller micro-batches of the same global batch (each size profiled), another way
  a 1F1B step sheds activation memory, which the planner is not asked to choose here
  (``n_microbatches`` is fixed).

Each is predicted by the cost model on the measured profile and measured as a real 2-rank
gloo ``Pipeline`` on CPU with ``PlannerOptions(recompute=)`` set to the variant's stages: the
variants run interleaved, one step each per round after two warm-up steps, and the median
of the slower rank's step over the rounds is reported.

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
from autopipe.machine.device import Device, default_copy_bandwidth, sends_are_lazy  # noqa: E402
from autopipe.planning.costgraph import build_cost_graph  # noqa: E402
from autopipe.planning.plan import Plan  # noqa: E402
from autopipe.planning.schedule_options import ScheduleOption, cost_option, predict_split  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402
from autopipe.runtime import Pipeline  # noqa: E402

SIZES = {  # (wide blocks, dense layers, d, hidden, dense width, micro-batch rows, micro-batches, rounds)
    "full": (4, 8, 128, 1024, 512, 256, 8, 7),
    "smoke": (2, 2, 16, 64, 32, 8, 4, 1),
}


class Wide(nn.Module):
    """A residual MLP block whose hidden tensor goes through several elementwise ops: many saved bytes per FLOP."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x))
        h = h * torch.sigmoid(h)
        h = torch.tanh(h) + h
        return x + self.down(h)


class Dense(nn.Module):
    """A square layer: parameters and FLOPs, and one row-width tensor saved."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def make_model(size: str) -> tuple[nn.Module, torch.Tensor]:
    wide, dense, d, hidden, width, rows, _, _ = SIZES[size]
    torch.manual_seed(0)
    layers = [Wide(d, hidden) for _ in range(wide)] + [nn.Linear(d, width)]
    layers += [Dense(width) for _ in range(dense)] + [nn.Linear(width, d)]
    return nn.Sequential(*layers), torch.randn(rows, d)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def plan_at(model: nn.Module, x_mb: torch.Tensor, m: int, devs: list[Device], costs: Any, **kw: Any) -> Plan:
    """A 1F1B plan of ``model`` from the profile ``costs`` (the loss already in its last segment)."""
    return autopipe.partition(model, 2, example_args=(x_mb,), schedule="1F1B", n_microbatches=m, loss_fn=False,
                              planner=autopipe.PlannerOptions(devices=devs, cost=costs, **kw))


def every_stage_recomputing(plan: Plan, model: nn.Module, x_mb: torch.Tensor, devs: list[Device]
                            ) -> tuple[list[str], float] | None:
    """The split, every stage recomputing, with the fastest predicted step that fits per rank; None if none fits."""
    traced = trace(model, (x_mb,))
    costs = plan.segment_costs()
    link = plan.links()[0]
    option = cost_option(ScheduleOption("1F1B", 1, plan.n_microbatches), traced=traced,
                         cost_graph=build_cost_graph(traced, costs), n_gpus=2,
                         rank_devices=[Device(bandwidth=link.bandwidth, latency_s=link.latency_s)] * 2,
                         optimizer_factor=2.0, link_default=(link.bandwidth, link.latency_s), objective="step",
                         overhead_default=plan.action_overhead_s()[0], lazy_sends=sends_are_lazy("cpu"),
                         copy_bandwidth=default_copy_bandwidth("cpu"))
    best = None
    for c in range(1, len(costs)):
        step, peaks = predict_split(option, [c], [0, 1], traced=traced, costs=costs, optimizer_factor=2.0)
        if all(pk <= d.memory_bytes for pk, d in zip(peaks, devs)) and (best is None or step < best[1]):
            best = ([plan.segment_names[c]], step)
    return best


def worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    model, x_mb = make_model(job["size"])
    *_, rows, m, rounds = SIZES[job["size"]]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows * m, x_mb.shape[1], generator=g)
    y = torch.randn(rows * m, x_mb.shape[1], generator=g)
    # Every variant trains on the same global batch, in its own number of micro-batches.
    pipes = {v["label"]: Pipeline(model, example_args=(x[:rows * m // v["n_microbatches"]],), loss_fn=loss_fn,
                                  split_points=v["split_points"], schedule="1F1B",
                                  n_microbatches=v["n_microbatches"],
                                  planner=autopipe.PlannerOptions(recompute=v["recompute"]))
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


def choose_memory(model: nn.Module, x_mb: torch.Tensor, m: int, free: Plan, costs: Any, link: Any
                  ) -> tuple[int, Plan, Plan | None]:
    """A memory, stepping down from the unlimited plan's peak, at which the planner recomputes on some stages only.

    Among those where some split also fits keeping every activation, the one where the
    planner's predicted lead over that plan is largest (predictions only: the measurement
    does not choose the case); without such a memory, the largest one.
    """
    found = []
    for frac in [x / 100 for x in range(95, 20, -1)]:  # fine steps: the lead is largest where keeping barely fits
        memory = int(frac * max(free.rank_peak_bytes))
        devs = [Device(memory=memory, bandwidth=link.bandwidth, latency_s=link.latency_s)] * 2
        try:
            plan = plan_at(model, x_mb, m, devs, costs)
        except InfeasibleMemoryError:
            break  # nor any smaller limit
        if 0 < len(plan.recompute_stages) < plan.num_stages:
            try:
                keep = plan_at(model, x_mb, m, devs, costs, recompute=False)
            except InfeasibleMemoryError:
                keep = None
            lead = keep.predicted_step_s / plan.predicted_step_s if keep is not None else 0.0
            found.append((keep is not None, lead, memory, plan, keep))
    if not found:
        raise SystemExit("no memory limit tried makes the planner recompute on some stages only")
    *_, memory, plan, keep = max(found, key=lambda f: f[:3])
    return memory, plan, keep


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny run that only checks the script works")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size = "smoke" if args.smoke else "full"
    model, x_mb = make_model(size)
    wide, dense, d, hidden, width, rows, m, rounds = SIZES[size]
    quick = autopipe.ProfileOptions(warmup=2, repeats=10 if size == "full" else 1, progress=False)
    # One measured profile (the loss charged to the last segment) for every plan at this micro-batch size.
    free = autopipe.partition(model, 2, example_args=(x_mb,), schedule="1F1B", n_microbatches=m, loss_fn=loss_fn,
                              example_target=torch.zeros_like(x_mb),
                              planner=autopipe.PlannerOptions(profiling=quick))
    costs, link = free.segment_costs(), free.links()[0]  # one link for every plan, so their predictions compare
    memory, plan, keep = choose_memory(model, x_mb, m, free, costs, link)
    devs = [Device(memory=memory, bandwidth=link.bandwidth, latency_s=link.latency_s)] * 2
    variants = [{"label": "planner", "split_points": list(plan.split_points), "recompute": list(plan.recompute_stages),
                 "n_microbatches": m, "predicted_step_s": plan.predicted_step_s,
                 "predicted_peak_bytes": [int(b) for b in plan.rank_peak_bytes]}]
    every = every_stage_recomputing(plan, model, x_mb, devs)
    if every is not None:
        variants.append({"label": "checkpoint every stage", "split_points": every[0], "recompute": [0, 1],
                         "n_microbatches": m, "predicted_step_s": every[1]})
    if keep is not None:
        variants.append({"label": "no recomputation", "split_points": list(keep.split_points), "recompute": [],
                         "n_microbatches": m, "predicted_step_s": keep.predicted_step_s,
                         "predicted_peak_bytes": [int(b) for b in keep.rank_peak_bytes]})
    more = None
    for k in (2, 4):  # the same global batch in more, smaller micro-batches, each size profiled
        mb = x_mb[: rows // k]
        try:
            prof = autopipe.partition(model, 2, example_args=(mb,), schedule="1F1B", n_microbatches=m * k,
                                      loss_fn=loss_fn, example_target=torch.zeros_like(mb),
                                      planner=autopipe.PlannerOptions(profiling=quick))
            other = plan_at(model, mb, m * k, devs, prof.segment_costs(), recompute=False)
        except InfeasibleMemoryError:
            continue
        if more is None or other.predicted_step_s < more.predicted_step_s:
            more = other
    if more is not None:
        variants.append({"label": "no recomputation, more micro-batches", "split_points": list(more.split_points),
                         "recompute": [], "n_microbatches": more.n_microbatches,
                         "predicted_step_s": more.predicted_step_s,
                         "predicted_peak_bytes": [int(b) for b in more.rank_peak_bytes]})
    ranks = run_world(worker, 2, {"size": size, "variants": variants}, timeout_s=3000)
    for v in variants:
        per_round = [max(r[v["label"]][k] for r in ranks) for k in range(rounds)]  # a step ends on its last rank
        v["measured_step_s"] = statistics.median(per_round)
        v["measured_steps_s"] = per_round
    planner = variants[0]
    for v in variants:
        v["predicted_vs_planner"] = v["predicted_step_s"] / planner["predicted_step_s"]
        v["measured_vs_planner"] = v["measured_step_s"] / planner["measured_step_s"]
    same_m = [v for v in variants[1:] if v["n_microbatches"] == m]
    out = args.out or str(Path(__file__).parent / ("results_smoke.json" if size != "full" else "results.json"))
    payload = {
        "benchmark": "recompute",
        "question": "when memory binds, does recomputing on the stages the planner picks beat recomputing "
                    "everywhere and the best plan that recomputes nothing, predicted and measured?",
        "device": "cpu", "ranks": 2, "backend": "gloo", "size": size, "schedule": "1F1B", "n_microbatches": m,
        "cost": "measured",
        "model": f"{wide} wide residual MLP blocks (d={d}, hidden={hidden}, elementwise chain), "
                 f"then {dense} square layers of width {width}; micro-batch {rows} rows",
        "memory_per_device_bytes": memory,
        "planner_stage_peaks": [{"stage": st.index, "kept_bytes": st.peak_bytes_kept,
                                 "recomputed_bytes": st.peak_bytes_recomputed} for st in plan.stages],
        "mixed_beats_both_at_same_m": {
            "predicted": all(v["predicted_step_s"] > planner["predicted_step_s"] for v in same_m) and len(same_m) == 2,
            "measured": all(v["measured_step_s"] > planner["measured_step_s"] for v in same_m) and len(same_m) == 2,
        },
        "measure": f"median over {rounds} interleaved rounds of one training step, the slower rank's time",
        "host": host_info(), "variants": variants,
    }
    path = write_result(out, payload)
    for v in variants:
        print(f"{v['label']:>36}: split {v['split_points']}, recompute {v['recompute']}, "
              f"m={v['n_microbatches']}: predicted "
              f"{v['predicted_step_s'] * 1e3:8.2f} ms, measured {v['measured_step_s'] * 1e3:8.2f} ms "
              f"({v['measured_vs_planner']:.2f}x the planner's)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
