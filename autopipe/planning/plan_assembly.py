"""Assemble the :class:`~autopipe.planning.plan.Plan` of the option the planner chose.

Example:
    >>> plan = make_plan(traced, graph, chosen, optimizer="adam", optimizer_factor=2.0,
    ...                  rank_devices=[Device()] * 2, cost_source="measured", objective="step",
    ...                  device="cpu", planner_s=0.01, memory_limit_bytes=None)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from ..machine.device import Device
from . import costmodel
from .baselines import BASELINES, evaluate_baselines
from .costgraph import CostGraph
from .partitioner import PartitionProblem, PartitionResult
from .plan import BaselinePlan, Plan, StagePlan
from .plan_records import Link, MachineModel, PlanSegment, SearchRecord
from .problem import state_sizes
from .schedule_options import ScheduleOption, fit_ranks, memory_limited, split_stage_times_s
from .schedules import stage_ranks
from .tracing import TracedModel, module_spans

def make_plan(
    traced: TracedModel,
    cost_graph: CostGraph,
    chosen: ScheduleOption,
    *,
    optimizer: str,
    optimizer_factor: float,
    rank_devices: Sequence[Device],
    cost_source: str,
    objective: str,
    device: str,
    planner_s: float,
    memory_limit_bytes: list[int] | None,
    alternatives: Sequence[ScheduleOption] = (),
    allow_recompute: bool = True,
) -> Plan:
    """Assemble the Plan of the chosen option: split points, stages, predictions, baselines."""
    problem, result = chosen.problem, chosen.result
    if problem is None or result is None:
        raise ValueError(f"chosen={chosen.schedule!r} x{chosen.stages_per_rank} has no split; cost it first "
                         "(autopipe.planning.schedule_options.cost_option)")
    costs = cost_graph.costs or []
    sched, v, m = chosen.schedule, chosen.stages_per_rank, chosen.n_microbatches
    ranks = stage_ranks(sched, len(rank_devices), v)
    stage_devices = [rank_devices[r] for r in ranks]
    baselines = []
    limited = memory_limited(problem)
    # The peers' splits the search already costed for this option, else found now (objective="bottleneck").
    peers = chosen.baselines if chosen.baselines is not None else evaluate_baselines(traced, costs, problem)
    for name, r in peers.items():
        if isinstance(r, str):  # the tool's rule gives no split for this model
            baselines.append(BaselinePlan(name=name, description=BASELINES[name], split_points=[], bottleneck_s=0.0,
                                          predicted_step_s=0.0, peak_bytes=0, fits_memory=False, reason=r))
            continue
        # Costed as the search costed it among its candidates: per rank, recomputing where it must to fit.
        _, step, fits = fit_ranks(chosen, problem, r, costs, traced, ranks, rank_devices, optimizer_factor, limited,
                                  allow_recompute)
        baselines.append(BaselinePlan(
            name=name,
            description=BASELINES[name],
            split_points=[traced.candidates[c - 1].name for c in r.cuts],
            bottleneck_s=r.bottleneck_s,
            predicted_step_s=step,
            peak_bytes=int(max(r.stage_mem_bytes)),
            fits_memory=fits,
        ))
    segments = [
        PlanSegment(
            name=seg.name, modules=list(seg.modules), fwd_s=c.fwd_s, bwd_s=c.bwd_s, param_bytes=int(c.param_bytes),
            act_bytes=int(c.act_bytes), out_bytes=int(c.out_bytes), flops=c.flops,
            trainable_param_bytes=int(c.trainable_param_bytes), accum_s=c.accum_s,
            bwd_peak_bytes=int(c.bwd_peak_bytes), bwd_input_peak_bytes=int(c.bwd_input_peak_bytes),
            cut_fwd_bytes=int(cost_graph.cut_fwd_bytes[seg.index]),
            cut_bwd_bytes=int(cost_graph.cut_bwd_bytes[seg.index]),
            cut_fwd_messages=int(problem.cut_fwd_messages[seg.index]),
            cut_bwd_messages=int(problem.cut_bwd_messages[seg.index]),
        )
        for seg, c in zip(traced.segments, costs)
    ]
    step = chosen.predicted_step_s
    return Plan(
        num_stages=problem.num_stages,
        split_points=[traced.candidates[c - 1].name for c in result.cuts],
        stages=stage_records(traced, cost_graph, problem, result, optimizer_factor, stage_devices, chosen.inflight, m,
                             recompute=chosen.recompute),
        schedule=sched,
        n_microbatches=m,
        bottleneck_s=result.bottleneck_s,
        predicted_step_s=step,
        lower_bound_s=costmodel.bottleneck_lower_bound_s(problem.compute_s, problem.speed),
        baselines=baselines,
        cost_source=cost_source,
        objective=objective,
        device=device,
        stages_per_rank=v,
        memory_limit_bytes=memory_limit_bytes,
        optimizer=optimizer,
        planner_s=planner_s,
        model_name=traced.model_name,
        segment_names=list(cost_graph.segment_names),
        segments=segments,
        machine=MachineModel(
            links=[Link(float(bw), float(lat)) for bw, lat in zip(problem.bandwidth, problem.latency_s)],
            action_overhead_s=[float(x) for x in chosen.action_overhead_s], lazy_sends=chosen.lazy_sends),
        step_tail=chosen.step_tail,
        recompute_stages=list(chosen.recompute),
        rank_peak_bytes=[int(b) for b in chosen.rank_peak_bytes],
        search=SearchRecord(candidates=chosen.candidates, iterations=int(result.searched.get("iterations", 0)),
                            step_lower_bound_s=chosen.step_lower_bound_s,
                            step_gap=1.0 - chosen.step_lower_bound_s / step if step > 0 else 0.0),
        alternatives=[a.summary() for a in alternatives],
    )


def stage_fqns(traced: TracedModel, start_seg: int, end_seg: int) -> list[str]:
    """Top-most modules whose graph nodes all lie inside segments [start_seg, end_seg).

    Example:
        >>> stage_fqns(traced, 0, 2)  # doctest: +SKIP
        ['embed', 'layers.0']
    """
    lo, hi = traced.segments[start_seg].start, traced.segments[end_seg - 1].end
    spans, _ = module_spans(traced.nodes)
    inside = {f for f, idx in spans.items() if lo <= idx[0] and idx[-1] < hi}
    outer = [f for f in inside if not any(f.startswith(p + ".") for p in inside if p != f)]
    # A list container (layers) never runs itself; collapse complete runs of its children.
    return sorted(outer, key=lambda f: spans[f][0])


def stage_records(
    traced: TracedModel, cost_graph: CostGraph, problem: PartitionProblem, result: PartitionResult,
    optimizer_factor: float, stage_devices: Sequence[Device], inflight: Sequence[int], n_microbatches: int,
    recompute: Sequence[int] = (),
) -> list[StagePlan]:
    """One :class:`~autopipe.planning.plan.StagePlan` per stage of ``result``, its memory exact.

    Example:
        >>> stages = stage_records(traced, graph, problem, result, 2.0, [Device()] * 2, [2, 1], 4)  # doctest: +SKIP
    """
    costs = cost_graph.costs or []
    sizes = state_sizes(traced)
    edges = [0, *result.cuts, problem.num_segments]
    fwd, bwd = split_stage_times_s(problem, result.cuts, costs, n_microbatches, recompute)
    into = problem.stage_input_bytes()
    records = []
    for s in range(problem.num_stages):
        i, j = edges[s], edges[s + 1]
        names = []
        for seg in traced.segments[i:j]:
            names.extend(n for n in seg.param_names if n not in names)
        param_bytes = sum(sizes.get(n, (0, False))[0] for n in names)
        trainable = sum(sizes[n][0] for n in names if n in sizes and sizes[n][1])
        act = int(sum(c.act_bytes for c in costs[i:j]))
        static = costmodel.state_bytes(param_bytes, trainable, optimizer_factor)
        kept = int(costmodel.stage_peak_bytes(static, act, inflight[s]))
        recomputed = int(costmodel.stage_peak_bytes(static, act, inflight[s], recompute=True, input_bytes=into[i]))
        records.append(StagePlan(
            index=s,
            fqns=stage_fqns(traced, i, j),
            first_segment=i,
            last_segment=j - 1,
            fwd_s=float(fwd[s]),
            bwd_s=float(bwd[s]),
            comm_s=float(result.stage_comm_s[s]),
            param_bytes=int(param_bytes),
            act_bytes=act,
            peak_bytes=recomputed if s in recompute else kept,
            send_bytes=int(cost_graph.cut_fwd_bytes[j]) if j < problem.num_segments else 0,
            recv_bytes=int(cost_graph.cut_fwd_bytes[i]) if i > 0 else 0,
            inflight_microbatches=int(inflight[s]),
            device=stage_devices[s].name,
            peak_bytes_kept=kept,
            peak_bytes_recomputed=recomputed,
        ))
    return records
