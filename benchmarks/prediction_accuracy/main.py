"""Prediction accuracy: the plan's predicted step time and per-rank peak memory vs real pipelines.

First the machine is measured once, as a user would with ``autopipe measure
--overhead``: the link between two ranks (``autopipe.machine.link.measure_link``) and the runtime's
cost per pipeline action plus the slowdown of ranks computing at once
(``autopipe.runtime.overhead_probe.measure_action_overhead``). Then for each model x schedule x micro-batch
count this script

1. profiles the model in 2 spawned ranks at once (``profile_in_ranks``, one thread
   each, as a Pipeline does (``ProfileOptions(in_ranks=True)``) before it plans) and plans it for 2 ranks
   with ``autopipe.partition(..., loss_fn=, example_target=, planner=PlannerOptions(cost=profile,
   devices=[Device(bandwidth=, latency_s=, action_overhead_s=)] * 2))``: the plan's own prediction, the
   loss (cross-entropy) charged to the last stage. With ``--plan-profile parent`` the plans
   are made from a profile this process takes alone, slowed by the measured slowdown of
   ranks computing together (``Device(speed=1 / slowdown)``);
2. runs every plan of the model as a real 2-rank :class:`autopipe.Pipeline` (gloo on
   127.0.0.1), all plans side by side in interleaved rounds, and takes the median step;
   then measures each rank's peak memory during one steady-state step with Adam
   (``_pipebench.LiveBytes``);
3. simulates the same split again with less or more measured: autopipe's defaults only, the
   measured link without the overhead terms (the cost model before they existed), stage
   times measured in one process (``plan.calibrate``'s input), and stage compute timed inside
   the running pipeline.

Signed error = (predicted - measured) / measured. Nothing is asserted.

    python benchmarks/prediction_accuracy/main.py            # 5 models x 4 schedules x {4, 8}
    python benchmarks/prediction_accuracy/main.py --quick    # 2 models x 3 schedules x 4
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import (  # noqa: E402
    MODELS, StageChain, busy_share_by_stage, ce_loss, host_info, make_model, make_target, median,
    parallel_efficiency, profile_in_world, run_variants,
)

import autopipe  # noqa: E402
from autopipe.planning import costmodel  # noqa: E402
from autopipe.planning.costgraph import SegmentCost  # noqa: E402
from autopipe.machine.device import default_action_overhead_s, default_link  # noqa: E402
from autopipe.machine.link import measure_link  # noqa: E402
from autopipe.runtime.overhead_probe import measure_action_overhead  # noqa: E402
from autopipe.planning.profile import profile_segments  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402

# (schedule, stages per rank): two single-stage, two multi-stage schedules torch offers.
SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))
FULL_MODELS = ("seed_transformer", "gpt2_tied", "cnn", "unet", "mlp")
QUICK_MODELS = ("seed_transformer", "mlp")


def _cut_bytes(plan: autopipe.Plan) -> list[int]:
    """Bytes crossing each stage boundary of the plan, one way (the larger of activation and gradient)."""
    segs = plan.segments
    return [int(costmodel.cut_bytes(segs[st.first_segment].cut_fwd_bytes, segs[st.first_segment].cut_bwd_bytes))
            for st in plan.stages[1:]]


def measure_machine(opts: argparse.Namespace, log) -> dict[str, Any]:
    """The link and the runtime overhead, measured once, as ``autopipe measure --overhead`` does."""
    smoke = opts.size == "smoke"
    link = measure_link(device=opts.device, repeats=3 if smoke else 10)
    overhead = measure_action_overhead(
        device=opts.device, schedules=[("1F1B", 1)] if smoke else [(s, v) for s, v in opts.schedule_list],
        steps=2 if smoke else 10)
    log(f"machine: link {link.summary()}")
    log(f"machine: runtime overhead {overhead.summary()}")
    return {"link": link.to_dict(), "overhead": overhead.to_dict()}


def _measured_devices(machine: dict[str, Any], contended_profile: bool) -> list[autopipe.Device]:
    """The two ranks as measured: link, overhead per action and, unless the profile was taken by
    every rank at once (and so holds the contention already), the slowdown of ranks computing together."""
    link, overhead = machine["link"], machine["overhead"]
    speed = 1.0 if contended_profile else 1.0 / overhead["concurrent_slowdown"]
    return [autopipe.Device(speed=speed, bandwidth=link["bandwidth_bytes_per_s"],
                            latency_s=link["latency_s"], action_overhead_s=overhead["action_overhead_s"])] * 2


def _stage_times(plan: autopipe.Plan, costs: Sequence[SegmentCost]) -> tuple[list[float], list[float]]:
    """Per stage of ``plan``, forward and backward sums of ``costs`` (no device speed applied).

    The backward includes the gradient accumulation the plan charges (``costmodel.stage_times_s``).
    """
    return costmodel.stage_times_s(costs, [st.first_segment for st in plan.stages[1:]], plan.n_microbatches)


def _profiled_stage_times(plan: autopipe.Plan) -> tuple[list[float], list[float]]:
    """Per stage, the sums of the profile the plan was made from."""
    return _stage_times(plan, plan.segment_costs())


def _segment_times(costs: Sequence[SegmentCost]) -> tuple[list[float], list[float], list[float]]:
    """Per segment, forward, backward and gradient-accumulation seconds: a profile as
    :func:`_profile_stage_times` takes it."""
    return [c.fwd_s for c in costs], [c.bwd_s for c in costs], [c.accum_s for c in costs]


def _profile_stage_times(plan: autopipe.Plan, profile: tuple[list[float], ...],
                         factor: float = 1.0) -> tuple[list[float], list[float]]:
    """Per stage, forward and backward from another profile of the plan's segments, the loss the
    plan measured on the last stage, all times ``factor``.

    ``profile``: per segment, forward, backward and gradient-accumulation seconds.
    """
    costs = [replace(c, fwd_s=f, bwd_s=b, accum_s=a) for c, f, b, a in zip(plan.segment_costs(), *profile)]
    fwd, bwd = _stage_times(plan, costs)
    if plan.loss is not None:
        fwd[-1] += plan.loss.fwd_s
        bwd[-1] += plan.loss.bwd_s
    return [t * factor for t in fwd], [t * factor for t in bwd]


def _same_time_prediction(plan: autopipe.Plan, profile: tuple[list[float], list[float], list[float]],
                          slowdown: float) -> float:
    """The plan's step predicted from another profile of its segments (and the loss the plan measured)."""
    fwd, bwd = _profile_stage_times(plan, profile, slowdown)
    return plan.calibrate({"fwd_s": fwd, "bwd_s": bwd}).predicted_step_s


def _contention_prediction(plan: autopipe.Plan, alone: tuple[list[float], ...],
                           together: tuple[list[float], ...]) -> float:
    """The plan's step with each stage's compute between its time alone and its time with every rank computing.

    ``alone`` / ``together``: per segment forward, backward and accumulation seconds, from
    profiles taken by rank 0 alone and by every rank at once. A stage action is charged
    ``alone x (1 + (together / alone - 1) x overlap)``, its overlap the share of its time
    another rank computes in the simulated step; overlap and times are iterated to a fixed point.
    """
    (fa, ba), (ft, bt) = _profile_stage_times(plan, alone), _profile_stage_times(plan, together)
    fwd, bwd = fa, ba
    for _ in range(4):
        timeline = costmodel.simulate_step(fwd, bwd, plan.cut_comm_s(), **plan.simulation_options())
        uf, ub = busy_share_by_stage(timeline, plan.num_stages)
        fwd = [a * (1 + (t / a - 1) * u) if a > 0 else t for a, t, u in zip(fa, ft, uf)]
        bwd = [a * (1 + (t / a - 1) * u) if a > 0 else t for a, t, u in zip(ba, bt, ub)]
    return plan.calibrate({"fwd_s": fwd, "bwd_s": bwd}).predicted_step_s


def bench_model(name: str, size: str, opts: argparse.Namespace, log, machine: dict[str, Any], *,
                memory: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Plan ``name`` for every schedule x micro-batch count, run the plans on 2 ranks; rows + the link measured."""
    model, args = make_model(name, size)
    with torch.no_grad():
        target = make_target(model(*args))
    device = opts.device
    traced = trace(model, args)
    costs = profile_segments(traced, device=device, warmup=1, repeats=opts.profile_repeats, progress=False)
    # The same profile with the caches left warm between rounds (flush_cache=False), right
    # after the first: what the plans would predict had the profiler not emptied them.
    warm = profile_segments(traced, device=device, warmup=1, repeats=opts.profile_repeats, progress=False,
                            flush_cache=False)
    warm_cache = _segment_times(warm)
    # And fitted to the whole graph timed beside the segments (fit_to_whole=True; the default
    # on CUDA only): what the plans would predict had the CPU profile been fitted too.
    fitted = profile_segments(traced, device=device, warmup=1, repeats=opts.profile_repeats, progress=False,
                              fit_to_whole=True)
    whole_fit = _segment_times(fitted)
    profile_whole = asdict(costs.whole) if costs.whole is not None else None
    parent = _segment_times(costs)
    # The profile the plans are made from: by default every rank's at once, before the run, as
    # a Pipeline profiling in its ranks takes it; with --plan-profile parent, this process's.
    in_ranks_first = opts.plan_profile == "in-ranks"
    if in_ranks_first:
        costs = profile_in_world(name, size, device=device, threads=opts.threads, repeats=opts.profile_repeats,
                                 timeout_s=opts.world_timeout)
    cases = []
    for sched, v in opts.schedule_list:
        for m in opts.microbatches:
            try:
                plan = autopipe.partition(model, 2, example_args=args, schedule=sched, n_microbatches=m,
                                          loss_fn=ce_loss, example_target=target,
                                          planner=autopipe.PlannerOptions(stages_per_rank=v, cost=costs, profiling=autopipe.ProfileOptions(device=device, progress=False), devices=_measured_devices(machine, in_ranks_first)))
            except ValueError as e:  # a combination torch cannot run (e.g. too few micro-batches)
                log(f"  {name} {sched} x{m}: not planned: {e}")
                continue
            cases.append({"model": name, "schedule": sched, "stages_per_rank": v, "n_microbatches": m,
                          "label": f"{sched}-{v}-{m}", "plan": plan})
    log(f"  {name}: {len(cases)} plans; running them on 2 ranks")

    sizes = sorted({b for c in cases for b in _cut_bytes(c["plan"])})
    job = {"model": name, "size": size, "device": device, "codegen": opts.codegen_stages,
           "rounds": opts.rounds, "steps": opts.steps,
           "profile_between_rounds": True, "profile_repeats": opts.profile_repeats,
           "warmup_steps": 1, "memory": memory and not opts.no_memory, "link_bytes": sizes,
           "instrument": opts.instrument_steps,
           "variants": [{"label": c["label"], "plan": c["plan"].to_dict(), "schedule": c["schedule"],
                         "n_microbatches": c["n_microbatches"], "stages_per_rank": c["stages_per_rank"]}
                        for c in cases]}
    results, failed = run_variants(job, device=device, threads=opts.threads, timeout_s=opts.world_timeout, log=log)
    link = results[0].get("link") if results else None  # rank 0's view of the ping-pong
    # Stage times in one process, per distinct split (calibration input), timed after the
    # run so that the plans' profile is taken as close to their steps as the parent can.
    # Also with torch's stage modules running generated code instead of the fx Interpreter,
    # interleaved with the first, to show how much of the profile-vs-stage gap is the Interpreter.
    stage_times: dict[tuple[str, ...], tuple[list[float], list[float]]] = {}
    codegen_times: dict[tuple[str, ...], tuple[list[float], list[float]]] = {}
    for c in cases:
        key = tuple(c["plan"].split_points)
        if key not in stage_times:
            chains = [StageChain(model, args, list(key), device=device, codegen=opts.codegen_stages),
                      StageChain(model, args, list(key), device=device, codegen=True)]
            runs: list[list] = [[], []]
            t = target.to(device)
            for i in range(1 + opts.stage_repeats):
                for k, ch in enumerate(chains):
                    r = ch.run_once(t)
                    if i:  # the first round warms up
                        runs[k].append(r)
            med = [([median([r[0][s] for r in rs]) for s in range(ch.num_stages)],
                    [median([r[1][s] for r in rs]) for s in range(ch.num_stages)]) for rs, ch in zip(runs, chains)]
            stage_times[key], codegen_times[key] = med

    # The profile rank 0 took between rounds of steps: per segment, the median over rounds.
    between = results[0].get("profiles") if results else None
    def per_segment_median(profiles: list[dict[str, list[float]]] | None) -> tuple[list[float], ...] | None:
        if not profiles:
            return None
        return tuple([median([p[q][k] for p in profiles]) for k in range(len(profiles[0][q]))]
                     for q in ("fwd_s", "bwd_s", "accum_s"))

    same_time = per_segment_median(between)
    # Profiles every rank took at once between other rounds (profile_in_ranks):
    # contended as the stages are.
    in_ranks = per_segment_median(results[0].get("in_ranks_profiles") if results else None)
    rows = []
    for c in cases:
        plan: autopipe.Plan = c["plan"]
        label = c["label"]
        row: dict[str, Any] = {k: c[k] for k in ("model", "schedule", "stages_per_rank", "n_microbatches")}
        row["split_points"] = plan.split_points
        row["predicted_step_s"] = plan.predicted_step_s
        if label in failed:
            row["not_run"] = failed[label]
            log(f"  {label:24s} not run: {row['not_run'][:110]}")
            rows.append(row)
            continue
        per_step = [max(ts) for ts in zip(*(r["times"][label] for r in results))]
        measured = median(per_step)
        fwd, bwd = stage_times[tuple(plan.split_points)]
        cut_bytes = _cut_bytes(plan)
        slowdown = machine["overhead"]["concurrent_slowdown"]
        overhead = plan.action_overhead_s()
        sim = dict(schedule=plan.schedule, n_microbatches=plan.n_microbatches, stages_per_rank=plan.stages_per_rank,
                   lazy_sends=plan.simulation_options()["lazy_sends"])
        prof_fwd, prof_bwd = _profiled_stage_times(plan)
        bw, lat = default_link(device.split(":")[0])
        tail = plan.step_tail_s()
        row.update({
            "measured_step_s": measured, "step_samples": per_step,
            # The same split with nothing measured but the profile: autopipe's defaults.
            "defaults_step_s": costmodel.predicted_step_s(
                prof_fwd, prof_bwd, [costmodel.cut_time_s(b, b, bw, lat) for b in cut_bytes],
                action_overhead_s=default_action_overhead_s(device.split(":")[0]), **sim, tail=plan.step_tail),
            # The cost model before the overhead terms: profile + measured link only.
            "no_overhead_step_s": costmodel.predicted_step_s(prof_fwd, prof_bwd, plan.cut_comm_s(),
                                                             **{**sim, "lazy_sends": False}),
            # The plan as made but with sends delivered at once (gloo's lazy sends not modelled).
            "eager_sends_step_s": costmodel.predicted_step_s(
                [st.fwd_s for st in plan.stages], [st.bwd_s for st in plan.stages], plan.cut_comm_s(),
                **{**plan.simulation_options(), "lazy_sends": False}, tail=plan.step_tail),
            # The plan as made without its once-per-step tail (merge, loss broadcast, tied gradients).
            "no_tail_step_s": plan.predicted_step_s - tail, "step_tail_s": asdict(plan.step_tail),
            # The same prediction from the profile taken between the rounds of steps (so on a
            # host running as fast as during them), with the loss the plan measured.
            **({"same_time_step_s": _same_time_prediction(plan, same_time, slowdown)} if same_time else {}),
            # (Profiles every rank took at once hold the contention: no slowdown on top.)
            **({"in_ranks_step_s": _same_time_prediction(plan, in_ranks, 1.0)} if in_ranks else {}),
            **({"contention_step_s": _contention_prediction(plan, same_time, in_ranks)} if in_ranks and same_time
               else {}),
            # The same split from this process's profile taken alone before the run, slowed by the
            # measured slowdown: what partition() in one process predicts for it.
            "parent_profile_step_s": _same_time_prediction(plan, parent, slowdown),
            "warm_cache_step_s": _same_time_prediction(plan, warm_cache, slowdown),
            "whole_fit_step_s": _same_time_prediction(plan, whole_fit, slowdown),
            "profile_whole": profile_whole, "whole_fit_scales": fitted.whole.scales if fitted.whole else None,
            # Stage times measured alone in one process instead of the profile's sums.
            "calibrated_step_s": plan.calibrate({"fwd_s": [f * slowdown for f in fwd],
                                                 "bwd_s": [b * slowdown for b in bwd]}).predicted_step_s,
            "predicted_stage_fwd_s": [st.fwd_s for st in plan.stages],
            "predicted_stage_bwd_s": [st.bwd_s for st in plan.stages],
            "profiled_stage_fwd_s": prof_fwd, "profiled_stage_bwd_s": prof_bwd,
            "measured_stage_fwd_s": fwd, "measured_stage_bwd_s": bwd,
            "codegen_stage_fwd_s": codegen_times[tuple(plan.split_points)][0],
            "codegen_stage_bwd_s": codegen_times[tuple(plan.split_points)][1],
            "cut_bytes": cut_bytes, "predicted_cut_s": plan.cut_comm_s(),
        })
        if link is not None:
            row["measured_cut_s"] = [link["by_size"][str(max(1, b))] for b in cut_bytes]
        if link is not None and "in_run" in results[0]:
            # Stage compute timed inside the running pipeline (both ranks busy at once), with
            # each cut's one-way time measured right after the run and the measured overhead.
            in_run = results[0]["in_run"][label]  # every rank has every stage's times
            run_fwd, run_bwd = in_run["fwd_s"], in_run["bwd_s"]
            row["in_run_stage_fwd_s"], row["in_run_stage_bwd_s"] = run_fwd, run_bwd
            row["in_run_step_s"] = costmodel.predicted_step_s(run_fwd, run_bwd, row["measured_cut_s"],
                                                              action_overhead_s=overhead, **sim, tail=plan.step_tail)
            row["contention_factor"] = (sum(run_fwd) + sum(run_bwd)) / (sum(fwd) + sum(bwd))
        if "memory" in results[0]:
            _add_memory(row, plan, [r["memory"][label] for r in results])
        rows.append(row)
    return rows, link


def bench_memory(name: str, size: str, opts: argparse.Namespace, log) -> list[dict[str, Any]]:
    """``--memory-only``: plan ``name`` for every schedule x micro-batch count from FLOP-counted
    costs (deterministic splits, no timing), run each plan's steps on 2 ranks and compare the
    plan's per-rank peak bytes with the measured ones; no step is timed."""
    model, args = make_model(name, size)
    with torch.no_grad():
        target = make_target(model(*args))
    profiling = autopipe.ProfileOptions(device=opts.device, progress=False)
    cases = []
    for sched, v in opts.schedule_list:
        for m in opts.microbatches:
            try:
                plan = autopipe.partition(model, 2, example_args=args, schedule=sched, n_microbatches=m,
                                          loss_fn=ce_loss, example_target=target,
                                          planner=autopipe.PlannerOptions(stages_per_rank=v, cost="flops", profiling=profiling))
            except ValueError as e:  # a combination torch cannot run (e.g. too few micro-batches)
                log(f"  {name} {sched} x{m}: not planned: {e}")
                continue
            cases.append({"model": name, "schedule": sched, "stages_per_rank": v, "n_microbatches": m,
                          "label": f"{sched}-{v}-{m}", "plan": plan})
    job = {"model": name, "size": size, "device": opts.device, "rounds": 0, "steps": 0, "warmup_steps": 1,
           "memory": True, "instrument": 0,
           "variants": [{"label": c["label"], "plan": c["plan"].to_dict(), "schedule": c["schedule"],
                         "n_microbatches": c["n_microbatches"], "stages_per_rank": c["stages_per_rank"]}
                        for c in cases]}
    results, failed = run_variants(job, device=opts.device, threads=opts.threads, timeout_s=opts.world_timeout,
                                   log=log)
    rows = []
    for c in cases:
        plan = c["plan"]
        row: dict[str, Any] = {k: c[k] for k in ("model", "schedule", "stages_per_rank", "n_microbatches")}
        row["split_points"] = plan.split_points
        if c["label"] in failed or not results:
            row["not_run"] = failed.get(c["label"], "no result")
        else:
            _add_memory(row, plan, [r["memory"][c["label"]] for r in results])
            log(f"  {name:16s} {c['schedule']:15s} x{c['n_microbatches']:<2d} memory "
                + ", ".join(f"{p / 2**20:.2f} MiB vs {x['peak_bytes'] / 2**20:.2f} ({e:+.1%})" for p, x, e in
                            zip(row["predicted_peak_bytes"], row["measured_memory"], row["memory_error"])))
        rows.append(row)
    return rows


def _add_memory(row: dict[str, Any], plan: autopipe.Plan, mem: list[dict[str, int]]) -> None:
    """The plan's per-rank peak, the measured one (``mem``: per rank) and the signed error, into ``row``."""
    pred = plan.rank_peak_bytes
    row["predicted_peak_bytes"] = pred
    row["measured_peak_bytes"] = [x["peak_bytes"] for x in mem]
    row["measured_memory"] = mem
    row["memory_error"] = [(p - x["peak_bytes"]) / x["peak_bytes"] for p, x in zip(pred, mem)]


def summarise_memory(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and largest |memory error| over every rank of every case run, and how many are within 10%."""
    errs = [abs(e) for r in rows for e in r.get("memory_error", [])]
    return {"cases": len(rows), "run": sum("memory_error" in r for r in rows), "rank_figures": len(errs),
            "median_abs_memory_error": median(errs) if errs else None,
            "max_abs_memory_error": max(errs) if errs else None,
            "within_10pct": sum(e <= 0.10 for e in errs)}


#: Prediction columns: JSON key of the predicted step -> what it is.
PREDICTIONS = {
    "predicted_step_s": "the plan as made (by default from the profile every rank took at once before the run, "
                        "as a Pipeline profiling in its ranks takes it), with the machine measured once (link, "
                        "per-action overhead)",
    "parent_profile_step_s": "the same split from a profile this process took alone before the run, slowed by the "
                             "measured slowdown of ranks computing together (what partition() in one process "
                             "predicts)",
    "defaults_step_s": "the same split with autopipe's defaults (profile only, nothing measured)",
    "no_overhead_step_s": "profile + measured link, without the per-action overhead, the slowdown and lazy "
                          "sends (the cost model before they existed)",
    "eager_sends_step_s": "the plan as made, but every send delivered at once (gloo's lazy sends not modelled)",
    "no_tail_step_s": "the plan as made, without the once-per-step tail (merging outputs, loss broadcast, "
                      "tied gradients)",
    "same_time_step_s": "the plan's prediction from a profile taken between the rounds of steps (the host as "
                        "fast as during them) instead of before them",
    "in_ranks_step_s": "the same, from profiles every rank took at once between other rounds "
                       "(profile_in_ranks: each rank's profile competing with the others for the host, "
                       "as the stages do; the mean over the ranks; no slowdown on top)",
    "contention_step_s": "each stage between its time in rank 0's profile alone and in the profile every rank "
                         "took at once, by the share of its actions' time another rank computes in the simulated "
                         "step (no concurrent_slowdown on top)",
    "warm_cache_step_s": "the plan's prediction from a profile with the caches left warm between its rounds "
                         "(profile_segments(flush_cache=False)), taken right after the plan's own",
    "whole_fit_step_s": "the plan's prediction from a profile fitted to the whole graph timed beside its "
                        "segments (profile_segments(fit_to_whole=True)), taken right after the plan's own",
    "calibrated_step_s": "stage times measured alone in one process (plan.calibrate's input) instead of the "
                         "profile's sums, with the measured machine",
    "in_run_step_s": "stage compute timed inside the running pipeline, measured link and overhead, the plan's "
                     "lazy sends and step tail",
}


def add_errors(rows: list[dict[str, Any]]) -> None:
    """Signed error of every prediction column."""
    for r in rows:
        if "measured_step_s" in r:
            r["errors"] = {k: (r[k] - r["measured_step_s"]) / r["measured_step_s"] for k in PREDICTIONS if k in r}


def log_rows(rows: list[dict[str, Any]], log) -> None:
    for r in rows:
        if "errors" not in r:
            continue
        e = r["errors"]
        log(f"  {r['model']:16s} {r['schedule']:15s} x{r['n_microbatches']:<2d} predicted "
            f"{r['predicted_step_s'] * 1e3:7.1f} ms  measured {r['measured_step_s'] * 1e3:7.1f} ms  "
            + "  ".join(f"{k.replace('_step_s', '')} {v:+6.1%}" for k, v in e.items())
            + (f"  memory {', '.join(f'{x:+.0%}' for x in r['memory_error'])}" if "memory_error" in r else ""))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "errors" in r]
    out: dict[str, Any] = {"cases": len(rows), "run": len(ok), "columns": PREDICTIONS}
    for key in PREDICTIONS:
        vals = [abs(r["errors"][key]) for r in ok if key in r["errors"]]
        out[f"median_abs_error:{key}"] = median(vals) if vals else None
        out[f"max_abs_error:{key}"] = max(vals) if vals else None
    # Stage compute: what the profile says vs what torch's stage modules take in one process.
    def ratio(r: dict[str, Any], key: str) -> float:
        return (sum(r[f"{key}_fwd_s"]) + sum(r[f"{key}_bwd_s"])) / (sum(r["profiled_stage_fwd_s"]) + sum(r["profiled_stage_bwd_s"]))

    for key in ("measured_stage", "codegen_stage"):
        vals = [ratio(r, key) for r in ok if f"{key}_fwd_s" in r]
        out[f"median_{key}_over_profile"] = median(vals) if vals else None
    fwd = [sum(r["measured_stage_fwd_s"]) / sum(r["profiled_stage_fwd_s"]) for r in ok]
    bwd = [sum(r["measured_stage_bwd_s"]) / sum(r["profiled_stage_bwd_s"]) for r in ok]
    out["median_stage_fwd_over_profile"] = median(fwd) if fwd else None
    out["median_stage_bwd_over_profile"] = median(bwd) if bwd else None
    contention = [r["contention_factor"] for r in ok if "contention_factor" in r]
    out["median_contention_factor"] = median(contention) if contention else None
    signed = [r["errors"]["predicted_step_s"] for r in ok]
    out["median_signed_error"] = median(signed) if signed else None
    mem = [abs(e) for r in ok for e in r.get("memory_error", [])]
    out["median_abs_memory_error"] = median(mem) if mem else None
    out["max_abs_memory_error"] = max(mem) if mem else None
    by_sched: dict[str, list[float]] = {}
    for r in ok:
        by_sched.setdefault(r["schedule"], []).append(r["errors"]["predicted_step_s"])
    out["median_error_by_schedule"] = {k: median(v) for k, v in by_sched.items()}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}, 3 schedules, 4 micro-batches")
    ap.add_argument("--smoke", action="store_true", help="one tiny model, one schedule (for the test suite)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (needs 2 GPUs)")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {list(MODELS)}")
    ap.add_argument("--schedules", nargs="*", default=None, help=f"subset of {[s for s, _ in SCHEDULES]}")
    ap.add_argument("--microbatches", nargs="*", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    ap.add_argument("--codegen-stages", action="store_true",
                    help="experiment: run torch's stage modules as generated code, not through the fx Interpreter")
    ap.add_argument("--profile-repeats", type=int, default=None)
    ap.add_argument("--stage-repeats", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true",
                    help="only per-rank peak memory, predicted vs measured: plans from FLOP-counted costs, no step "
                         "timed; writes memory.json (memory_<size>.json for --quick/--smoke)")
    ap.add_argument("--instrument-steps", type=int, default=2,
                    help="steps with every compute action timed inside the run (0: none)")
    ap.add_argument("--world-timeout", type=float, default=400.0)
    ap.add_argument("--plan-profile", choices=("in-ranks", "parent"), default="in-ranks",
                    help="what the plans are made from: the profile every rank takes at once before the run "
                         "(default), or this process's profile with the measured slowdown")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args(argv)
    size = "smoke" if opts.smoke else "quick" if opts.quick else "full"
    # Profile rounds: 15 in a full run. Five-round profiles of the same model, back to back,
    # came out up to 1.35x their median on this shared host, fifteen-round ones up to 1.11x.
    # Steps: 3 per round in a full run (15 per plan): one step of a plan varied by 6% about
    # its median here (median absolute deviation over 40 plans), so a median of 5 was still
    # a few percent off the plan's typical step.
    defaults = {"smoke": (1, 1, 1, 1), "quick": (3, 3, 3, 1), "full": (15, 5, 5, 3)}[size]
    for attr, d in zip(("profile_repeats", "stage_repeats", "rounds", "steps"), defaults):
        if getattr(opts, attr) is None:
            setattr(opts, attr, d)
    names = opts.models or (["mlp"] if opts.smoke else list(QUICK_MODELS) if opts.quick else list(FULL_MODELS))
    wanted = opts.schedules or (["1F1B"] if opts.smoke else ["GPipe", "1F1B", "Interleaved1F1B"] if opts.quick
                                else [s for s, _ in SCHEDULES])
    opts.schedule_list = [(s, v) for s, v in SCHEDULES if s in wanted]
    opts.microbatches = opts.microbatches or ([4] if size != "full" else [4, 8])
    opts.size = size
    stem = "memory" if opts.memory_only else "results"
    out = opts.out or str(Path(__file__).parent / (f"{stem}.json" if size == "full" else f"{stem}_{size}.json"))
    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)
    if opts.device.startswith("cuda") and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda runs real 2-rank pipelines and needs 2 GPUs; this machine has "
                         f"{torch.cuda.device_count()}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0, host_start = time.perf_counter(), host_info()
    if opts.memory_only:
        log(f"prediction accuracy, memory only: {names} x {[s for s, _ in opts.schedule_list]} x "
            f"m={opts.microbatches}, device {opts.device}")
        rows = [row for n in names for row in bench_memory(n, size, opts, log)]
        summary = summarise_memory(rows)
        log(f"memory over {summary['rank_figures']} rank figures: median |error| "
            f"{summary['median_abs_memory_error']:.1%}, max {summary['max_abs_memory_error']:.1%}, "
            f"{summary['within_10pct']} within 10%")
        payload = {"benchmark": "prediction_accuracy", "mode": "memory_only", "size": size, "device": opts.device,
                   "threads_per_process": opts.threads, "host_start": host_start, "host_end": host_info(),
                   "summary": summary, "rows": rows, "wall_s": time.perf_counter() - t0}
        path = write_result(out, payload)
        log(f"wrote {path} ({payload['wall_s']:.0f} s)")
        return payload
    # How much two ranks computing at once slow each other down here (1.0 = truly parallel). A
    # smoke run leaves it out: it only informs the reader, and split_quality's smoke run checks it.
    parallel = parallel_efficiency(threads=opts.threads) if opts.device == "cpu" and size != "smoke" else None
    if parallel:
        log(f"two processes computing at once take {parallel['together_over_alone']:.2f}x as long as one alone")
    log(f"prediction accuracy: {names} x {[s for s, _ in opts.schedule_list]} x m={opts.microbatches}, "
        f"device {opts.device}, {opts.threads} thread(s) per process")
    machine = measure_machine(opts, log)
    rows, links = [], {}
    for n in names:
        model_rows, links[n] = bench_model(n, size, opts, log, machine)
        add_errors(model_rows)
        log_rows(model_rows, log)
        rows += model_rows
    summary = summarise(rows)
    log("median |error| over " + f"{summary['run']} cases: " + ", ".join(
        f"{k.replace('_step_s', '')} {summary[f'median_abs_error:{k}']:.1%}" for k in PREDICTIONS
        if summary[f"median_abs_error:{k}"] is not None))
    payload = {
        "benchmark": "prediction_accuracy", "size": size, "device": opts.device, "threads_per_process": opts.threads,
        "codegen_stages": opts.codegen_stages, "plan_profile": opts.plan_profile,
        "repeats": {k: getattr(opts, k) for k in ("profile_repeats", "stage_repeats", "rounds", "steps")},
        "host_start": host_start, "host_end": host_info(), "parallel_efficiency": parallel,
        "summary": summary, "rows": rows, "links": links, "measured_machine": machine, "wall_s": time.perf_counter() - t0,
    }
    path = write_result(out, payload)
    log(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
