"""``autopipe.partition``: from a model to a Plan, one visible step at a time.

The whole data flow of ``docs/how-the-planner-decides.md`` in one function::

    trace(model, inputs)            -> TracedModel   legal split points, segments
    profile_segments(traced)        -> [SegmentCost] measured per-segment costs
    build_cost_graph(traced, costs) -> CostGraph     bytes crossing every cut
    build_problem(cost_graph, ...)  -> PartitionProblem  numbers per segment/cut/stage
    solve_bottleneck(problem)       -> PartitionResult   the exact min-max split
    make_plan(...)                  -> Plan          split_spec, predictions, baselines

Each step is importable and can be run alone in a REPL.

Example:
    >>> import autopipe
    >>> from autopipe.models import seed_transformer
    >>> model, args = seed_transformer(vocab_size=1000, num_layers=2, seq_len=16)
    >>> plan = autopipe.partition(model, 2, example_args=args, progress=False, repeats=1)
    >>> plan.num_stages, len(plan.split_spec)
    (2, 1)
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from . import schedules as sim
from .baselines import BASELINES, evaluate_baselines, layer_units
from .costgraph import CostGraph, SegmentCost, build_cost_graph
from ..machine.device import (Device, default_action_overhead_s, default_copy_bandwidth, default_link,
                      optimizer_state_factor, parse_bandwidth, parse_bytes, sends_are_lazy)
from ..errors import InfeasibleMemoryError
from .partitioner import PartitionProblem, PartitionResult, candidate_partitions, solve_bottleneck
from .plan import BaselinePlan, Plan, StagePlan
from .plan_file import MAX_STAGES
from .profile import (COST_SOURCES, LossCost, check_fit_to_whole, check_flush_cache, profile_loss, profile_segments,
                      resolve_device)
from .scaling import ScaledProfile, profile_scaling
from .trace import TracedModel, _module_spans, trace

__all__ = [
    "partition", "build_problem", "make_plan", "predict_step_s", "inflight_per_stage",
    "ScheduleOption", "auto_schedule_options", "OBJECTIVES",
]

#: Accepted values of ``objective``.
OBJECTIVES = ("step", "bottleneck")


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _check_at_most(name: str, value: int, most: int, what: str) -> None:
    """Refuse a count past ``most``: the work it would start grows with it, so it is refused first."""
    if value > most:
        raise ValueError(f"{name}={value} is more than autopipe plans for; use at most {most} {what}")


def _devices_for(
    n_gpus: int, devices: Sequence[Device] | None, memory: Any, bandwidth: float | None, latency_s: float | None,
    action_overhead_s: float | None = None,
) -> list[Device]:
    """One Device per pipeline rank, from ``devices`` or from the scalar options."""
    if action_overhead_s is not None and (isinstance(action_overhead_s, bool)
                                          or not isinstance(action_overhead_s, (int, float))
                                          or not 0 <= action_overhead_s < math.inf):
        raise ValueError(f"action_overhead_s={action_overhead_s!r} must be a finite time >= 0 seconds")
    if devices is not None:
        devices = list(devices)
        if len(devices) != n_gpus:
            raise ValueError(f"devices has {len(devices)} entries but n_gpus={n_gpus}; give one Device per GPU")
        for i, d in enumerate(devices):
            if not isinstance(d, Device):
                raise TypeError(f"devices[{i}]={d!r} is not an autopipe.Device")
        if memory is not None:
            raise ValueError("give memory either per device (Device(memory=...)) or as memory=, not both")
        if action_overhead_s is not None:
            devices = [d if d.action_overhead_s is not None else replace(d, action_overhead_s=action_overhead_s)
                       for d in devices]
        return devices
    if bandwidth is not None:
        bandwidth = parse_bandwidth(bandwidth)  # a number or "10GB", as Device takes it
    if latency_s is not None and not (isinstance(latency_s, (int, float)) and latency_s >= 0):
        raise ValueError(f"latency_s={latency_s!r} must be >= 0 seconds")
    if isinstance(memory, (list, tuple)):
        if len(memory) != n_gpus:
            raise ValueError(f"memory has {len(memory)} entries but n_gpus={n_gpus}; give one per GPU or a single value")
        mems = [parse_bytes(m, name=f"memory[{i}]") for i, m in enumerate(memory)]
    else:
        mems = [None if memory is None else parse_bytes(memory, name="memory")] * n_gpus
    return [Device(memory=m, bandwidth=bandwidth, latency_s=latency_s, action_overhead_s=action_overhead_s)
            for m in mems]


# --------------------------------------------------------------------------- schedule facts


def inflight_per_stage(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> list[int]:
    """Micro-batches whose activations each stage holds at its peak under ``schedule``.

    Read from the simulated order of torch's schedule class (so 1F1B gives
    ``min(m, p - s)`` and GPipe ``m``, as the textbook says).
    """
    p = n_ranks * stages_per_rank
    timeline = sim.simulate([1.0] * p, [2.0] * p, schedule=schedule, n_microbatches=n_microbatches,
                            stages_per_rank=stages_per_rank)
    return [max(1, int(x)) for x in timeline.stage_peak_inflight]


def predict_step_s(
    fwd_s: Sequence[float], bwd_s: Sequence[float], comm_s: Sequence[float], *,
    schedule: str, n_microbatches: int, stages_per_rank: int, action_overhead_s: float | Sequence[float] = 0.0,
    lazy_sends: bool = False,
) -> float:
    """Predicted time of one step: the simulated makespan of ``schedule`` with these stages."""
    return sim.simulate(list(fwd_s), list(bwd_s), schedule=schedule, n_microbatches=n_microbatches,
                        comm_s=list(comm_s) if len(comm_s) else 0.0, stages_per_rank=stages_per_rank,
                        action_overhead_s=action_overhead_s, lazy_sends=lazy_sends).step_s


# --------------------------------------------------------------------------- problem


def build_problem(
    cost_graph: CostGraph,
    traced: TracedModel,
    *,
    num_stages: int,
    stage_devices: Sequence[Device],
    inflight: Sequence[int],
    optimizer_factor: float,
    link_default: tuple[float, float],
    stages_per_rank: int = 1,
    n_microbatches: int = 0,
) -> PartitionProblem:
    """Turn the cost graph into the partitioner's numbers for ``num_stages`` stages.

    Static bytes of a segment = its parameters and buffers + gradients and optimizer state of
    its trainable parameters; the last segment also holds the model's output of every one of
    the ``n_microbatches`` micro-batches, which torch's last stage keeps for the step's result. A parameter read by several segments (tied embeddings) is
    replicated by torch into every stage that reads it, so the search charges it at every
    segment that reads it (never less than the truth); the Plan's figures are exact.
    """
    costs = cost_graph.costs
    if costs is None:
        raise ValueError("the cost graph has no costs; profile it first (profile_segments)")
    sizes = _state_sizes(traced)
    static = []
    for seg in traced.segments:
        b = 0.0
        for name in seg.param_names:  # every reader pays: torch replicates shared parameters
            nbytes, trainable = sizes.get(name, (0, False))
            b += nbytes + (nbytes * (1.0 + optimizer_factor) if trainable else 0.0)
        static.append(b)
    # torch's last stage keeps every micro-batch's output until the step ends (it returns
    # them merged), so the model's output is held n_microbatches times on that stage.
    if static:
        static[-1] += n_microbatches * costs[-1].out_bytes
    bw, lat = [], []
    for s in range(num_stages - 1):
        d = stage_devices[s]
        bw.append(d.bandwidth if d.bandwidth is not None else link_default[0])
        lat.append(d.latency_s if d.latency_s is not None else link_default[1])
    return PartitionProblem(
        compute_s=np.array([c.fwd_s + c.step_bwd_s(n_microbatches) for c in costs]),
        static_bytes=np.array(static),
        act_bytes=np.array([c.act_bytes for c in costs], dtype=float),
        cut_fwd_bytes=np.array(cost_graph.cut_fwd_bytes, dtype=float),
        cut_bwd_bytes=np.array(cost_graph.cut_bwd_bytes, dtype=float),
        num_stages=num_stages,
        speed=np.array([d.speed for d in stage_devices], dtype=float),
        bandwidth=np.array(bw, dtype=float),
        latency_s=np.array(lat, dtype=float),
        inflight=np.array(inflight, dtype=float),
        # A rank's memory is shared by its stages: each gets an equal part.
        capacity_bytes=np.array([d.memory_bytes / stages_per_rank for d in stage_devices], dtype=float),
    )


def _state_sizes(traced: TracedModel) -> dict[str, tuple[int, bool]]:
    """FQN -> (bytes, trainable) of every parameter and buffer of the traced model."""
    gm = traced.graph_module
    out: dict[str, tuple[int, bool]] = {}
    # remove_duplicate=False: a tied weight has one name per module using it (wte, lm_head),
    # and torch replicates it into every stage that reads it under either name.
    for name, p in gm.named_parameters(remove_duplicate=False):
        out[name] = (p.numel() * p.element_size(), p.requires_grad)
    for name, b in gm.named_buffers(remove_duplicate=False):
        out[name] = (b.numel() * b.element_size(), False)
    for name, c in traced.exported.constants.items():
        if isinstance(c, torch.Tensor):
            out[name] = (c.numel() * c.element_size(), False)
    return out


# --------------------------------------------------------------------------- plan


def _state_tensors(traced: TracedModel) -> dict[int, tuple[set[str], int, bool]]:
    """Every parameter and buffer tensor, by identity: (its names, bytes, trainable).

    A tied weight (GPT-2's embedding and head) is one tensor under several names.
    """
    out: dict[int, tuple[set[str], int, bool]] = {}
    gm = traced.graph_module
    for named in (gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False)):
        for name, t in named:
            out.setdefault(id(t), (set(), t.numel() * t.element_size(), t.requires_grad))[0].add(name)
    return out


def _tensor_reads(traced: TracedModel, tensors: Mapping[int, tuple[set[str], int, bool]],
                  cuts: Sequence[int], ranks: Sequence[int]) -> dict[int, dict[int, int]]:
    """Per tensor of ``tensors`` (by identity): rank -> how many of its segments read it."""
    tensor_of = {name: ident for ident, (names, _, _) in tensors.items() for name in names}
    edges = [0, *cuts, len(traced.segments)]
    reads: dict[int, dict[int, int]] = {}
    for s, r in enumerate(ranks):
        for seg in traced.segments[edges[s]:edges[s + 1]]:
            for ident in {tensor_of[n] for n in seg.param_names if n in tensor_of}:
                per_rank = reads.setdefault(ident, {})
                per_rank[r] = per_rank.get(r, 0) + 1
    return reads


def _rank_overcount_bytes(traced: TracedModel, cuts: Sequence[int], ranks: Sequence[int],
                          optimizer_factor: float) -> list[float]:
    """Per rank, the static bytes the per-segment charge counts more than once.

    The search charges a parameter (with its gradient and optimizer state) at every segment
    that reads it, since torch replicates shared parameters into every stage that reads them.
    On one rank there is one copy: autopipe's runtime keeps one tensor per parameter per
    rank (a tied embedding and head on the same rank, as under ZBV, are one weight there).
    """
    tensors = _state_tensors(traced)
    out = [0.0] * (max(ranks) + 1)
    for ident, per_rank in _tensor_reads(traced, tensors, cuts, ranks).items():
        _, nbytes, trainable = tensors[ident]
        copy_bytes = nbytes + (nbytes * (1.0 + optimizer_factor) if trainable else 0.0)
        for r, k in per_rank.items():
            out[r] += (k - 1) * copy_bytes
    return out


def _stage_fqns(traced: TracedModel, start_seg: int, end_seg: int) -> list[str]:
    """Top-most modules whose graph nodes all lie inside segments [start_seg, end_seg)."""
    lo, hi = traced.segments[start_seg].start, traced.segments[end_seg - 1].end
    spans, _ = _module_spans(traced.nodes)
    inside = {f for f, idx in spans.items() if lo <= idx[0] and idx[-1] < hi}
    outer = [f for f in inside if not any(f.startswith(p + ".") for p in inside if p != f)]
    # A list container (layers) never runs itself; collapse complete runs of its children.
    return sorted(outer, key=lambda f: spans[f][0])


def _stage_records(
    traced: TracedModel, cost_graph: CostGraph, problem: PartitionProblem, result: PartitionResult,
    optimizer_factor: float, stage_devices: Sequence[Device], inflight: Sequence[int], n_microbatches: int,
) -> list[StagePlan]:
    costs = cost_graph.costs or []
    sizes = _state_sizes(traced)
    edges = [0, *result.cuts, problem.num_segments]
    fwd, bwd = _stage_fwd_bwd(problem, result, costs, n_microbatches)
    records = []
    for s in range(problem.num_stages):
        i, j = edges[s], edges[s + 1]
        names = []
        for seg in traced.segments[i:j]:
            names.extend(n for n in seg.param_names if n not in names)
        param_bytes = sum(sizes.get(n, (0, False))[0] for n in names)
        trainable = sum(sizes[n][0] for n in names if n in sizes and sizes[n][1])
        act = int(sum(c.act_bytes for c in costs[i:j]))
        static = param_bytes + trainable * (1.0 + optimizer_factor)
        records.append(StagePlan(
            index=s,
            fqns=_stage_fqns(traced, i, j),
            first_segment=i,
            last_segment=j - 1,
            fwd_s=float(fwd[s]),
            bwd_s=float(bwd[s]),
            comm_s=float(result.stage_comm_s[s]),
            param_bytes=int(param_bytes),
            act_bytes=act,
            peak_bytes=int(static + inflight[s] * act),
            send_bytes=int(cost_graph.cut_fwd_bytes[j]) if j < problem.num_segments else 0,
            recv_bytes=int(cost_graph.cut_fwd_bytes[i]) if i > 0 else 0,
            inflight_microbatches=int(inflight[s]),
            device=stage_devices[s].name,
        ))
    return records


def _cut_comm_s(problem: PartitionProblem, cuts: Sequence[int]) -> list[float]:
    """One-way time of each stage boundary (the larger of activation and gradient), for the simulator."""
    out = []
    for s, k in enumerate(cuts):
        nbytes = max(problem.cut_fwd_bytes[k], problem.cut_bwd_bytes[k])
        out.append(float(nbytes / problem.bandwidth[s] + (problem.latency_s[s] if nbytes else 0.0)))
    return out


def _stage_fwd_bwd(problem: PartitionProblem, result: PartitionResult, costs: list[SegmentCost],
                   n_microbatches: int) -> tuple[list[float], list[float]]:
    """Per stage, forward and backward seconds per micro-batch (gradient accumulation included)."""
    edges = [0, *result.cuts, problem.num_segments]
    fwd = [sum(c.fwd_s for c in costs[edges[s]:edges[s + 1]]) / problem.speed[s] for s in range(problem.num_stages)]
    bwd = [sum(c.step_bwd_s(n_microbatches) for c in costs[edges[s]:edges[s + 1]]) / problem.speed[s]
           for s in range(problem.num_stages)]
    return fwd, bwd


def step_tail_s(traced: TracedModel, problem: PartitionProblem, result: PartitionResult,
                costs: list[SegmentCost], ranks: Sequence[int], n_microbatches: int,
                copy_bandwidth: float) -> dict[str, float]:
    """Seconds of the work a training step does once, around the schedule's actions.

    The simulator times the actions; the step also ends with work the runtime does once:

    - ``merge_outputs_s``: torch's last stage concatenates the outputs of all
      ``n_microbatches`` micro-batches into the step's result (a copy into fresh memory);
    - ``loss_broadcast_s``: autopipe broadcasts the mean loss from the last rank (one
      latency), so every rank returns it;
    - ``shared_grads_s``: a tied parameter (GPT-2's embedding and head) whose readers landed
      on different ranks has its gradient summed across them (pack, ring all-reduce, unpack).
    """
    n_ranks = max(ranks) + 1 if len(ranks) else 1
    merge = n_microbatches * costs[-1].out_bytes / copy_bandwidth if costs else 0.0
    bandwidth = float(problem.bandwidth[0]) if len(problem.bandwidth) else math.inf
    latency = float(problem.latency_s[0]) if len(problem.latency_s) else 0.0
    loss = latency if n_ranks > 1 else 0.0
    tensors = _state_tensors(traced)
    shared = 0.0
    for ident, per_rank in _tensor_reads(traced, tensors, result.cuts, ranks).items():
        names, nbytes, trainable = tensors[ident]
        h = len(per_rank)  # ranks holding a copy
        if trainable and len(names) > 1 and h > 1:  # ring all-reduce: 2(h-1)/h of the bytes each way, 2(h-1) hops
            shared += 2 * nbytes / copy_bandwidth + 2 * (h - 1) / h * nbytes / bandwidth + 2 * (h - 1) * latency
    return {"merge_outputs_s": float(merge), "loss_broadcast_s": float(loss), "shared_grads_s": float(shared)}


def _predict(problem: PartitionProblem, result: PartitionResult, costs: list[SegmentCost],
             option: "ScheduleOption", traced: TracedModel, ranks: Sequence[int]) -> float:
    """Predicted step of the split ``result`` under ``option``: the simulated schedule + the step's tail."""
    m = option.n_microbatches
    fwd, bwd = _stage_fwd_bwd(problem, result, costs, m)
    step = predict_step_s(fwd, bwd, _cut_comm_s(problem, result.cuts), schedule=option.schedule,
                          n_microbatches=m, stages_per_rank=option.stages_per_rank,
                          action_overhead_s=option.action_overhead_s, lazy_sends=option.lazy_sends)
    return step + sum(step_tail_s(traced, problem, result, costs, ranks, m, option.copy_bandwidth).values())


@dataclass
class ScheduleOption:
    """One (schedule, stages per rank) the planner costed, with its best split."""

    schedule: str
    stages_per_rank: int
    n_microbatches: int
    problem: PartitionProblem | None = None
    result: PartitionResult | None = None
    inflight: list[int] = field(default_factory=list)
    predicted_step_s: float = float("inf")
    rank_peak_bytes: list[float] = field(default_factory=list)
    fits: bool = False
    candidates: int = 0
    step_lower_bound_s: float = 0.0
    action_overhead_s: list[float] = field(default_factory=list)  # per stage, seconds per action
    lazy_sends: bool = False  # the backend delivers a send when its sender next calls in (gloo)
    copy_bandwidth: float = math.inf  # bytes/s into fresh memory (merging outputs, packing gradients)
    step_tail_s: dict[str, float] = field(default_factory=dict)  # once-per-step work (step_tail_s())
    reason: str = ""  # why it was not usable, when it was not

    def summary(self) -> dict[str, Any]:
        """The JSON-ready line the report's "alternatives considered" table shows."""
        return {
            "schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
            "n_microbatches": self.n_microbatches,
            "predicted_step_s": self.predicted_step_s if math.isfinite(self.predicted_step_s) else None,
            "peak_bytes": int(max(self.rank_peak_bytes)) if self.rank_peak_bytes else None,
            "fits": self.fits,
            "split_points_count": len(self.result.cuts) if self.result else None,
            "note": self.reason,
        }


def _rank_peak_bytes(problem: PartitionProblem, result: PartitionResult, ranks: list[int], timeline_act: list[int],
                     merge_bytes: float = 0.0, overcount: Sequence[float] | None = None) -> list[float]:
    """Per rank: static bytes of its stages + the simulated peak of their saved activations.

    ``merge_bytes`` (the outputs torch's last stage keeps, already in its static bytes) is
    counted once more on the last stage's rank at the step's end: torch then concatenates
    the kept outputs into one more tensor of their size, after every activation is freed.
    Under 1F1B with many micro-batches that moment, not the activations', is the peak.
    ``overcount`` (per rank, see :func:`_rank_overcount_bytes`) is taken off the static bytes.
    """
    n_ranks = max(ranks) + 1
    A = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
    edges = [0, *result.cuts, problem.num_segments]
    peak = [float(x) for x in timeline_act]
    static = [0.0] * n_ranks
    for s, r in enumerate(ranks):
        act = A[edges[s + 1]] - A[edges[s]]
        static[r] += result.stage_mem_bytes[s] - problem.inflight[s] * act  # static part of the stage
    if overcount is not None:
        static = [st - o for st, o in zip(static, overcount)]
    peak = [p + st for p, st in zip(peak[:n_ranks], static)]
    last = ranks[-1]
    peak[last] = max(peak[last], static[last] + merge_bytes)
    return peak


def _cost_option(
    option: ScheduleOption, *, traced: TracedModel, cost_graph: CostGraph, n_gpus: int,
    rank_devices: Sequence[Device], optimizer_factor: float, link_default: tuple[float, float], objective: str,
    overhead_default: float = 0.0, lazy_sends: bool = False, copy_bandwidth: float = math.inf,
) -> ScheduleOption:
    """Find the best split for one schedule option and predict its step time and memory."""
    sched, v, m = option.schedule, option.stages_per_rank, option.n_microbatches
    costs = cost_graph.costs or []
    ranks = sim.stage_ranks(sched, n_gpus, v)
    stage_devices = [rank_devices[r] for r in ranks]
    option.action_overhead_s = [d.action_overhead_s if d.action_overhead_s is not None else overhead_default
                                for d in stage_devices]
    option.lazy_sends, option.copy_bandwidth = lazy_sends, copy_bandwidth
    option.inflight = inflight_per_stage(sched, n_gpus, m, v)
    problem = build_problem(
        cost_graph, traced, num_stages=n_gpus * v, stage_devices=stage_devices, inflight=option.inflight,
        optimizer_factor=optimizer_factor, link_default=link_default, stages_per_rank=v, n_microbatches=m,
    )
    option.problem = problem
    results = [solve_bottleneck(problem)] if objective == "bottleneck" else candidate_partitions(problem)
    option.candidates = len(results)
    best = None
    for r in results:
        step = _predict(problem, r, costs, option, traced, ranks)
        if best is None or (step, r.bottleneck_s) < (best[0], best[1].bottleneck_s):
            best = (step, r)
    option.predicted_step_s, option.result = best
    option.step_tail_s = step_tail_s(traced, problem, option.result, costs, ranks, m, copy_bandwidth)
    # Memory per rank from the simulated timeline (stages on one rank peak at different times).
    fwd, bwd = _stage_fwd_bwd(problem, option.result, costs, m)
    timeline = sim.simulate(fwd, bwd, schedule=sched, n_microbatches=m, stages_per_rank=v,
                            comm_s=_cut_comm_s(problem, option.result.cuts) or 0.0,
                            action_overhead_s=option.action_overhead_s, lazy_sends=lazy_sends)
    A = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
    edges = [0, *option.result.cuts, problem.num_segments]
    act = [int(A[edges[s + 1]] - A[edges[s]]) for s in range(problem.num_stages)]
    # torch keeps each sent tensor until it waits on the send (per schedule class).
    sent_fwd, sent_bwd = [0] * problem.num_stages, [0] * problem.num_stages
    for s, k in enumerate(option.result.cuts):
        sent_fwd[s], sent_bwd[s + 1] = int(problem.cut_fwd_bytes[k]), int(problem.cut_bwd_bytes[k])
    if sched in sim.SPLIT_BACKWARD_SCHEDULES:  # each stage output is a copy, kept to its input-grad
        act = [a + f for a, f in zip(act, sent_fwd)]
    held = timeline.peak_activation_bytes(act, send_bytes=(sent_fwd, sent_bwd))
    option.rank_peak_bytes = _rank_peak_bytes(
        problem, option.result, ranks, held, merge_bytes=m * costs[-1].out_bytes if costs else 0.0,
        overcount=_rank_overcount_bytes(traced, option.result.cuts, ranks, optimizer_factor))
    option.fits = all(pk <= d.memory_bytes for pk, d in zip(option.rank_peak_bytes, rank_devices))
    # A bound no split can beat under this schedule: each rank does m micro-batches of its work.
    free = PartitionProblem(**{**problem.__dict__, "cut_fwd_bytes": np.zeros_like(problem.cut_fwd_bytes),
                               "cut_bwd_bytes": np.zeros_like(problem.cut_bwd_bytes),
                               "capacity_bytes": np.full_like(problem.capacity_bytes, np.inf)})
    per_rank = solve_bottleneck(free).bottleneck_s if v == 1 else float(problem.compute_s.sum() / sum(d.speed for d in rank_devices))
    # Every action of a rank also pays the runtime's overhead, one action after another.
    actions_overhead = min(sum(option.action_overhead_s[e.stage] for e in timeline.per_rank(r))
                           for r in range(n_gpus))
    # The merge and the loss broadcast happen whatever the split (tied gradients may not).
    once = option.step_tail_s["merge_outputs_s"] + option.step_tail_s["loss_broadcast_s"]
    option.step_lower_bound_s = float(max(m * per_rank + actions_overhead, problem.compute_s.sum() / max(problem.speed))
                                      + once)
    return option


def auto_schedule_options(n_gpus: int, n_microbatches: int, num_segments: int) -> list[tuple[str, int]]:
    """The (schedule, stages per rank) pairs ``schedule="auto"`` compares.

    Every schedule torch offers, with 1 stage per rank for GPipe/1F1B, 2 for the V-shaped
    ones, and 2 or 4 for the looped/interleaved ones; pairs torch cannot run with these
    counts, or that need more stages than the model has segments, are left out.
    """
    pairs = [("GPipe", 1), ("1F1B", 1)]
    for sched in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"):
        pairs += [(sched, 2), (sched, 4)]
    pairs += [("ZBVZeroBubble", 2), ("DualPipeV", 2)]
    usable = []
    for sched, v in pairs:
        if n_gpus * v > num_segments or (n_gpus == 1 and v > 1):
            continue
        try:
            sim.validate_schedule(sched, n_gpus, n_microbatches, v)
        except (ValueError, TypeError):
            continue
        usable.append((sched, v))
    return usable


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
) -> Plan:
    """Assemble the Plan of the chosen option: split points, stages, predictions, baselines."""
    problem, result = chosen.problem, chosen.result
    assert problem is not None and result is not None
    costs = cost_graph.costs or []
    sched, v, m = chosen.schedule, chosen.stages_per_rank, chosen.n_microbatches
    ranks = sim.stage_ranks(sched, len(rank_devices), v)
    stage_devices = [rank_devices[r] for r in ranks]
    split_points = [traced.candidates[c - 1].name for c in result.cuts]
    stages = _stage_records(traced, cost_graph, problem, result, optimizer_factor, stage_devices, chosen.inflight,
                            chosen.n_microbatches)
    compute = problem.compute_s
    lower = max(float(compute.sum() / problem.speed.sum()), float((compute / problem.speed.max()).max()))

    baselines = []
    units = layer_units(traced)
    seg_param_bytes = np.array([c.param_bytes for c in costs], dtype=float)
    for name, r in evaluate_baselines(units, problem, seg_param_bytes).items():
        baselines.append(BaselinePlan(
            name=name,
            description=BASELINES[name],
            split_points=[traced.candidates[c - 1].name for c in r.cuts],
            bottleneck_s=r.bottleneck_s,
            predicted_step_s=_predict(problem, r, costs, chosen, traced, ranks),
            peak_bytes=int(max(r.stage_mem_bytes)),
            fits_memory=r.fits_memory,
        ))
    extras = {
        "segments": [
            {
                "name": seg.name, "modules": seg.modules, "fwd_s": c.fwd_s, "bwd_s": c.bwd_s,
                "param_bytes": c.param_bytes, "act_bytes": c.act_bytes, "out_bytes": c.out_bytes,
                "flops": c.flops, "trainable_param_bytes": c.trainable_param_bytes, "accum_s": c.accum_s,
                "cut_fwd_bytes": cost_graph.cut_fwd_bytes[seg.index],
                "cut_bwd_bytes": cost_graph.cut_bwd_bytes[seg.index],
            }
            for seg, c in zip(traced.segments, costs)
        ],
        "search": {**result.searched, "candidates": chosen.candidates},
        "step_lower_bound_s": chosen.step_lower_bound_s,
        "step_gap": 1.0 - chosen.step_lower_bound_s / chosen.predicted_step_s if chosen.predicted_step_s > 0 else 0.0,
        "rank_peak_bytes": [int(b) for b in chosen.rank_peak_bytes],
        "stage_ranks": ranks,
        "cut_comm_s": _cut_comm_s(problem, result.cuts),
        "links": {"bandwidth": problem.bandwidth.tolist(), "latency_s": problem.latency_s.tolist()},
        "action_overhead_s": list(chosen.action_overhead_s),
        "lazy_sends": chosen.lazy_sends,
        "step_tail_s": dict(chosen.step_tail_s),
    }
    if alternatives:
        extras["alternatives"] = [a.summary() for a in alternatives]
    return Plan(
        num_stages=problem.num_stages,
        split_points=split_points,
        stages=stages,
        schedule=sched,
        n_microbatches=m,
        bottleneck_s=result.bottleneck_s,
        predicted_step_s=chosen.predicted_step_s,
        lower_bound_s=lower,
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
        extras=extras,
    )


# --------------------------------------------------------------------------- entry point


def partition(
    model: torch.nn.Module,
    n_gpus: int,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    schedule: str = "1F1B",
    n_microbatches: int | str | None = None,
    global_batch: int | None = None,
    stages_per_rank: int | None = None,
    objective: str = "step",
    memory: int | str | Sequence[int | str] | None = None,
    devices: Sequence[Device] | None = None,
    optimizer: str | type = "adam",
    cost: str = "measured",
    device: str | torch.device | None = None,
    bandwidth: float | None = None,
    latency_s: float | None = None,
    action_overhead_s: float | None = None,
    warmup: int = 2,
    repeats: int = 5,
    costs: Sequence[SegmentCost] | None = None,
    scaling: ScaledProfile | None = None,
    loss_fn: Any = None,
    example_target: Any = None,
    progress: bool = True,
    flush_cache: bool = True,
    fit_to_whole: bool | None = None,
) -> Plan:
    """Find where to cut ``model`` into pipeline stages so the schedule runs fastest.

    Traces the model with ``torch.export`` (as ``torch.distributed.pipelining.pipeline``
    does), measures every segment between legal split points, and searches exactly for the
    contiguous split whose heaviest stage (compute + communication) is lightest while
    every stage fits its device's memory. The model is left exactly as it was.

    Args:
        model: Any ``nn.Module`` that ``torch.export`` can capture. A Hugging Face model may
            come with its default config: its KV cache is off while autopipe traces and
            profiles it and is restored after (:mod:`autopipe.planning.hf_compat`), and
            ``plan.extras["notes"]`` says so.
        n_gpus: Number of pipeline ranks (devices), >= 1.
        example_args: One micro-batch of positional inputs (``mb_args`` in torch's
            ``pipeline()``); may be omitted if the model carries ``example_input_array``
            or ``dummy_inputs``.
        example_kwargs: One micro-batch of keyword inputs.

    Keyword Args:
        schedule: One of ``autopipe.SCHEDULES`` (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
            InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), or ``"auto"`` to compare them
            all (and 2 or 4 stages per rank for the looped ones) and keep the fastest that
            fits in memory; the others are listed in ``plan.extras["alternatives"]``.
        n_microbatches: Micro-batches per step; default ``2 * n_gpus``. ``"auto"`` tries
            every divisor of ``global_batch`` (up to 64) as the micro-batch count, costing each
            micro-batch size from a profile taken at several sizes (no re-profiling per
            count), and keeps the fastest that fits; the plan then records
            ``extras["microbatch_size"]``.
        global_batch: Samples per optimizer step. Needed for ``n_microbatches="auto"``;
            with a fixed ``n_microbatches`` it must be divisible by it.
        stages_per_rank: Stages per rank for multi-stage schedules (default: 2 for the
            V-shaped ones, 1 otherwise). The plan has ``n_gpus * stages_per_rank`` stages.
        objective: ``"step"`` (default): the split whose simulated step time under the
            schedule is lowest, among bottleneck-optimal and near-optimal splits;
            ``"bottleneck"``: the exact min-max split alone (fastest to compute).
        memory: Memory per device in bytes or as "16GiB"; one value or one per device.
        devices: ``[autopipe.Device(speed=..., memory=..., bandwidth=...), ...]``, one per
            rank, for heterogeneous devices (instead of ``memory``/``bandwidth``).
        optimizer: Optimizer whose state counts toward memory ("adam", "sgd", ... or a
            ``torch.optim`` class).
        cost: ``"measured"`` (default), ``"flops"`` or ``"params"``.
        device: Device to profile on; default CUDA when present, else CPU. Its type also
            picks the defaults below (link, action overhead, copy bandwidth), so with
            ``costs`` name the device they were measured on.
        bandwidth: Bytes/s between neighbouring devices (default: 2 GB/s on CPU,
            10 GB/s on CUDA).
        latency_s: Seconds per message between devices (default 100 us CPU, 20 us CUDA).
        action_overhead_s: Seconds every pipeline action (a stage's forward or backward of
            one micro-batch) costs beyond its compute: the runtime's own work, which the
            profile does not see. Default 0.7 ms on CPU (gloo processes, measured on a
            2-core host), 0 on CUDA (one-stage pipelines on one H100 implied about 0:
            benchmarks/gpu_one_rank; a send between GPUs is not in it). Measure yours with
            :func:`autopipe.machine.measure.measure_action_overhead`.
        warmup: Untimed runs per segment before measuring.
        repeats: Timed runs per segment; their mean is kept (:func:`autopipe.planning.profile.per_run_s`).
        flush_cache: Empty the device's caches before each pass of the profile, as a
            pipeline action finds them (:func:`autopipe.planning.profile.profile_segments`); ``False``
            keeps them warm, for hosts whose last-level cache holds a whole stage (compare the
            two with ``benchmarks/prediction_accuracy``'s ``warm_cache`` column).
        fit_to_whole: Scale the segments' times so that they add up to the whole graph
            timed as one beside them (:class:`autopipe.planning.profile.WholePass`). ``None``
            (default): on CUDA only, where segments timed one by one add up to 1.2-3x the
            model (:func:`autopipe.planning.profile.profile_segments`).
        costs: A profile to reuse (``plan.extras`` or :func:`autopipe.planning.profile.profile_segments`
            output, one :class:`~autopipe.planning.costgraph.SegmentCost` per segment): skips measuring,
            and the same costs always give the same plan.
        scaling: A :class:`~autopipe.planning.scaling.ScaledProfile` to reuse with
            ``n_microbatches="auto"`` (from :func:`autopipe.planning.scaling.profile_scaling`).
        loss_fn, example_target: The training loss ``loss_fn(output, target)`` and one
            micro-batch's target. The last stage computes the loss of every micro-batch and
            holds what it saves (for a language model, the log-softmax over the vocabulary)
            until that micro-batch's backward; with both given, its time and saved bytes
            (:func:`autopipe.planning.profile.profile_loss`) are charged to the last stage.
        progress: Show progress bars while profiling.

    Returns:
        A :class:`~autopipe.planning.plan.Plan`. Use ``plan.split_spec`` with
        ``torch.distributed.pipelining.pipeline`` or pass the plan to
        :class:`autopipe.Pipeline`; ``print(plan.report())`` explains it.

    Raises:
        ValueError: a bad argument (named in the message), raised before any work:
            ``n_gpus`` above ``MAX_STAGES`` (10**5) or ``n_microbatches`` above
            :data:`~autopipe.planning.schedules.MAX_SCHEDULE_SIZE` before tracing; more stages than
            the legal split points allow, or more (stage, micro-batch) pairs than
            ``MAX_SCHEDULE_SIZE``, right after tracing, before profiling.
        MissingExampleInputsError: no example inputs.
        ModelExportError: the model cannot be exported (with the exporter's reason).
        InfeasibleMemoryError: no split fits ``memory`` (the message says what would).

    Example:
        >>> import autopipe
        >>> from autopipe.models import seed_transformer
        >>> model, args = seed_transformer(vocab_size=2000, num_layers=2, seq_len=16)
        >>> plan = autopipe.partition(model, 2, example_args=args, progress=False, repeats=1)
        >>> plan.num_stages, len(plan.split_spec)
        (2, 1)
    """
    # ---- validate everything before any work
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    n_gpus = _check_int("n_gpus", n_gpus)
    # Before anything sized by it (one Device per rank, torch's schedule orders); whether the
    # model has split points for this many is known only after tracing, below.
    _check_at_most("n_gpus", n_gpus, MAX_STAGES, f"ranks (MAX_STAGES={MAX_STAGES})")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not known; use one of {list(OBJECTIVES)}")
    wanted = _resolve_options(n_gpus, schedule, n_microbatches, global_batch, stages_per_rank, costs)
    if cost not in COST_SOURCES:
        raise ValueError(f"cost={cost!r} is not a cost source; use one of {list(COST_SOURCES)}")
    opt_name, opt_factor = optimizer_state_factor(optimizer)
    rank_devices = _devices_for(n_gpus, devices, memory, bandwidth, latency_s, action_overhead_s)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} must be callable as loss_fn(output, target)")
    if (loss_fn is None) != (example_target is None):
        raise ValueError("give loss_fn and example_target together (the loss is measured on one micro-batch's "
                         f"target), got loss_fn={'set' if loss_fn is not None else None}, "
                         f"example_target={'set' if example_target is not None else None}")
    dev = resolve_device(device)
    _check_int("warmup", warmup, 0)
    _check_int("repeats", repeats, 1)
    check_flush_cache(flush_cache)
    check_fit_to_whole(fit_to_whole)

    # ---- trace, profile, cost graph (one per micro-batch count)
    traced = trace(model, example_args, example_kwargs)
    # The stage count against the legal split points as soon as tracing knows them, before
    # torch's schedule orders (whose cost grows with ranks x micro-batches) or any profiling.
    if n_gpus * (wanted.stages_per_rank or 1) > traced.num_segments:
        raise _too_many_stages(n_gpus, n_gpus * (wanted.stages_per_rank or 1), traced)
    wanted = _buildable(wanted, n_gpus, global_batch)
    pairs_for = {
        mm: auto_schedule_options(n_gpus, mm, traced.num_segments) if wanted.auto_schedule
        else [(wanted.schedule, wanted.stages_per_rank)]
        for mm in wanted.n_microbatches
    }
    needed = min((n_gpus * v for pairs in pairs_for.values() for _, v in pairs), default=n_gpus)
    if not any(pairs_for.values()) or needed > traced.num_segments:
        raise _too_many_stages(n_gpus, needed, traced)
    if wanted.auto_microbatches and scaling is None:
        scaling = profile_scaling(model, example_args, example_kwargs,
                                  sizes=_scaling_sizes(global_batch, wanted.n_microbatches),
                                  cost=cost, device=dev, warmup=warmup, repeats=repeats, progress=progress,
                                  flush_cache=flush_cache, fit_to_whole=fit_to_whole)
    if not wanted.auto_microbatches and costs is None:
        costs = profile_segments(traced, cost=cost, device=dev, warmup=warmup, repeats=repeats, progress=progress,
                                 flush_cache=flush_cache, fit_to_whole=fit_to_whole)
    loss = None
    if loss_fn is not None:
        loss = profile_loss(model, traced.example_args, traced.example_kwargs, loss_fn, example_target,
                            device=dev, warmup=warmup, repeats=repeats)
        if cost != "measured":  # estimated segment times: the loss adds its memory, not a measured time
            loss = replace(loss, fwd_s=0.0, bwd_s=0.0)
    graphs = _cost_graphs(traced, wanted.n_microbatches, global_batch, costs=costs,
                          scaling=scaling if wanted.auto_microbatches else None, loss=loss)

    # ---- search: the best split for each (micro-batches, schedule) option, then the fastest that fits
    t0 = time.perf_counter()
    options = []
    for mm, graph in graphs.items():
        for sched, v in pairs_for[mm]:
            option = ScheduleOption(schedule=sched, stages_per_rank=v, n_microbatches=mm)
            try:
                _cost_option(option, traced=traced, cost_graph=graph, n_gpus=n_gpus, rank_devices=rank_devices,
                             optimizer_factor=opt_factor, link_default=default_link(dev.type), objective=objective,
                             overhead_default=default_action_overhead_s(dev.type),
                             lazy_sends=sends_are_lazy(dev.type), copy_bandwidth=default_copy_bandwidth(dev.type))
            except InfeasibleMemoryError as e:
                if not wanted.several:
                    raise
                option.reason = str(e).split(";")[0]
            options.append(option)
    planner_s = time.perf_counter() - t0
    usable = [o for o in options if o.result is not None and o.fits]
    if not usable:
        # Every option fails memory: say what the most frugal one would need.
        raise InfeasibleMemoryError(
            "no schedule considered fits the memory given: "
            + "; ".join(f"{o.schedule} x{o.stages_per_rank} needs "
                        f"{_fmt_rank_peak(o)}" for o in options)
        )
    chosen = min(usable, key=lambda o: (o.predicted_step_s, max(o.rank_peak_bytes)))
    limits = None
    if any(math.isfinite(d.memory_bytes) for d in rank_devices):
        limits = [int(d.memory_bytes) if math.isfinite(d.memory_bytes) else -1 for d in rank_devices]
    plan = make_plan(
        traced, graphs[chosen.n_microbatches], chosen,
        optimizer=opt_name, optimizer_factor=opt_factor, rank_devices=rank_devices,
        cost_source=cost, objective=objective, device=str(dev), planner_s=planner_s,
        memory_limit_bytes=limits, alternatives=options if wanted.several else (),
    )
    if traced.notes:  # what autopipe changed to capture the model (a Hugging Face KV cache turned off)
        plan.extras["notes"] = list(traced.notes)
    if loss is not None:
        plan.extras["loss"] = asdict(loss)
    if getattr(costs, "whole", None) is not None:  # what the whole graph took beside the segments
        plan.extras["whole_pass"] = asdict(costs.whole)
    if global_batch is not None:
        plan.extras["global_batch"] = global_batch
        plan.extras["microbatch_size"] = global_batch // chosen.n_microbatches
    if wanted.auto_microbatches and scaling is not None:
        plan.extras["scaling_fit_error"] = {k: max(v) if v else 0.0 for k, v in scaling.fit_error.items()}
    return plan


@dataclass
class _Wanted:
    """The schedule and micro-batch options a call to ``partition`` asks to compare."""

    schedule: str | None  # None with schedule="auto"
    stages_per_rank: int | None
    n_microbatches: list[int]  # candidate micro-batch counts (one unless "auto")
    auto_schedule: bool
    auto_microbatches: bool

    @property
    def several(self) -> bool:
        return self.auto_schedule or self.auto_microbatches


def _resolve_options(
    n_gpus: int, schedule: Any, n_microbatches: Any, global_batch: int | None,
    stages_per_rank: Any, costs: Any,
) -> _Wanted:
    """Validate the schedule / micro-batch arguments together and list what to compare."""
    auto_sched = isinstance(schedule, str) and schedule.strip().lower() == "auto"
    auto_m = isinstance(n_microbatches, str) and n_microbatches.strip().lower() == "auto"
    if global_batch is not None:
        global_batch = _check_int("global_batch", global_batch)
    if auto_m:
        if global_batch is None:
            raise ValueError("n_microbatches='auto' needs global_batch= (samples per step) to choose micro-batch sizes")
        if costs is not None:
            raise ValueError("costs= holds one micro-batch size; with n_microbatches='auto' pass scaling= instead")
        m_options = [d for d in range(1, min(global_batch, 64) + 1) if global_batch % d == 0]
    else:
        if n_microbatches is None:
            m = 2 * n_gpus  # bounded with the stage count, once tracing has checked it (_buildable)
        else:
            m = _check_int("n_microbatches", n_microbatches)
            _check_at_most("n_microbatches", m, sim.MAX_SCHEDULE_SIZE,
                           f"micro-batches (MAX_SCHEDULE_SIZE={sim.MAX_SCHEDULE_SIZE} stage x micro-batch pairs)")
        if global_batch is not None and global_batch % m:
            # Only counts a step can hold are worth listing (and the search stays short).
            divisors = [d for d in range(1, min(global_batch, sim.MAX_SCHEDULE_SIZE) + 1) if global_batch % d == 0]
            raise ValueError(f"n_microbatches={m} does not divide global_batch={global_batch}; use one of {divisors}")
        m_options = [m]
    if auto_sched:
        if stages_per_rank is not None:
            raise ValueError(f"stages_per_rank={stages_per_rank!r} cannot be fixed with schedule='auto'; leave it None")
        return _Wanted(None, None, m_options, True, auto_m)
    try:
        schedule = sim.canonical_schedule_name(schedule)
    except ValueError as e:  # the planner also takes "auto": say so beside torch's names
        raise ValueError(f"{e}, or 'auto' to compare them all") from None
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule in ("ZBVZeroBubble", "DualPipeV") else 1
    stages_per_rank = _check_int("stages_per_rank", stages_per_rank)
    _check_at_most("stages_per_rank", stages_per_rank, MAX_STAGES // n_gpus,
                   f"on n_gpus={n_gpus} (MAX_STAGES={MAX_STAGES} stages in all)")
    runnable = []
    for m_try in m_options:
        try:
            # torch's counting rules alone: its order is built once tracing has bounded the stages.
            sim.validate_schedule(schedule, n_gpus, m_try, stages_per_rank, check_order=False)
            runnable.append(m_try)
        except ValueError:
            if not auto_m:
                raise  # a fixed count the schedule cannot run: torch's reason, unchanged
    if not runnable:
        raise ValueError(f"schedule {schedule!r} on {n_gpus} ranks cannot run any micro-batch count dividing "
                         f"global_batch={global_batch}: tried {m_options}")
    return _Wanted(schedule, stages_per_rank, runnable, False, auto_m)


def _buildable(wanted: _Wanted, n_gpus: int, global_batch: int | None) -> _Wanted:
    """``wanted`` without the micro-batch counts torch cannot order or a step cannot hold.

    Builds torch's order for each count (its cost grows with ranks x micro-batches), so
    :func:`partition` calls it only once the stage count fits the model's split points.
    With ``schedule="auto"`` each schedule's order is built by :func:`auto_schedule_options`;
    here the smallest step it may pick (one stage per rank) must fit
    :data:`~autopipe.planning.schedules.MAX_SCHEDULE_SIZE`.
    """
    runnable = []
    for m in wanted.n_microbatches:
        try:
            if wanted.auto_schedule:
                sim.check_schedule_size(n_gpus, m)
            else:
                sim.validate_schedule(wanted.schedule, n_gpus, m, wanted.stages_per_rank)
            runnable.append(m)
        except ValueError:
            if not wanted.auto_microbatches:
                raise  # a fixed count: the reason, unchanged
    if not runnable:
        raise ValueError(f"schedule {wanted.schedule or 'auto'!r} on {n_gpus} ranks cannot run any micro-batch count "
                         f"dividing global_batch={global_batch}: tried {wanted.n_microbatches}")
    return replace(wanted, n_microbatches=runnable)


def _too_many_stages(n_gpus: int, needed: int, traced: TracedModel) -> ValueError:
    return ValueError(
        f"n_gpus={n_gpus} needs at least {needed} stages, but {traced.model_name} has only "
        f"{len(traced.candidates)} legal split points ({traced.num_segments} segments); use at most "
        f"{traced.num_segments} stages"
    )


def _with_loss(costs: Sequence[SegmentCost], loss: LossCost | None, scale: float = 1.0) -> list[SegmentCost]:
    """``costs`` with the loss (scaled to the micro-batch size) charged to the last segment."""
    costs = list(costs)
    if loss is not None and costs:
        last = costs[-1]
        costs[-1] = replace(last, fwd_s=last.fwd_s + loss.fwd_s * scale, bwd_s=last.bwd_s + loss.bwd_s * scale,
                            act_bytes=last.act_bytes + int(loss.act_bytes * scale))
    return costs


def _cost_graphs(
    traced: TracedModel, m_options: Sequence[int], global_batch: int | None, *,
    costs: Sequence[SegmentCost] | None, scaling: ScaledProfile | None, loss: LossCost | None = None,
) -> dict[int, CostGraph]:
    """One cost graph per micro-batch count: from ``costs`` (one size) or from the size fits."""
    if scaling is None:
        assert costs is not None
        if len(costs) != traced.num_segments:
            raise ValueError(
                f"costs has {len(costs)} entries but {traced.model_name} traces to {traced.num_segments} "
                "segments; pass the profile of this model with these example inputs"
            )
        return {m_options[0]: build_cost_graph(traced, _with_loss(costs, loss))}
    if scaling.segment_names != [sg.name for sg in traced.segments]:
        raise ValueError("scaling= was profiled on a different model or inputs: its segments do not match")
    graphs = {}
    for mm in m_options:
        b = global_batch // mm
        # The loss is element-wise over the micro-batch: it scales with its size.
        graph = build_cost_graph(traced, _with_loss(scaling.costs_at(b), loss, b / loss.batch if loss else 1.0))
        graph.cut_fwd_bytes, graph.cut_bwd_bytes = (list(x) for x in scaling.cut_bytes_at(b))
        graphs[mm] = graph
    return graphs


def _scaling_sizes(global_batch: int, m_options: Sequence[int]) -> list[int]:
    """Micro-batch sizes to profile for fitting: the smallest, a middle and the largest used."""
    sizes = sorted({global_batch // mm for mm in m_options})
    picks = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    if len(picks) < 2:  # one size only (global_batch == 1): fit needs two points
        picks = sorted({picks[0], picks[0] + 1})
    return picks


def _fmt_rank_peak(option: ScheduleOption) -> str:
    if option.rank_peak_bytes:
        from ..reporting.text import format_bytes

        return format_bytes(max(option.rank_peak_bytes)) + " on its fullest device"
    return option.reason or "more memory"
