"""The schedule options the planner compares, each costed with its best split.

Example:
    >>> auto_schedule_options(n_gpus=2, n_microbatches=4, num_segments=8)[:3]
    [('GPipe', 1), ('1F1B', 1), ('Interleaved1F1B', 2)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InfeasibleMemoryError
from ..machine.device import Device, format_bytes
from . import costmodel, schedules
from .costgraph import CostGraph, SegmentCost
from .costmodel import StepTail
from .partitioner import (PartitionProblem, PartitionResult, candidate_partitions, capacity_shares, evaluate,
                          format_capacities, rank_work_lower_bound_s, solve_bottleneck, solve_min_memory)
from .recompute import min_memory_with_recompute, recompute_candidates
from .plan_records import ScheduleAlternative
from .problem import build_problem, merged_output_bytes, rank_overcount_bytes, stage_grad_bytes, tied_gradient_bytes
from .schedules import stage_ranks, validate_schedule
from .baselines import layer_units
from .split_candidates import more_candidates, peer_cuts, prefer_layer_split
from .tracing import TracedModel

if TYPE_CHECKING:
    from .timeline import Timeline

@dataclass
class ScheduleOption:
    """One (schedule, stages per rank, micro-batches) the planner costed, with its best split."""

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
    step_tail: StepTail = field(default_factory=StepTail)  # once-per-step work of the best split
    reason: str = ""  # why it was not usable, when it was not
    baselines: dict[str, PartitionResult | str] | None = None  # the peers' splits, where the search costed them
    recompute: list[int] = field(default_factory=list)  # stages that recompute their activations in the backward

    def summary(self) -> ScheduleAlternative:
        """The row the report's "alternatives considered" table shows."""
        return ScheduleAlternative(
            schedule=self.schedule, stages_per_rank=self.stages_per_rank, n_microbatches=self.n_microbatches,
            predicted_step_s=self.predicted_step_s if math.isfinite(self.predicted_step_s) else None,
            peak_bytes=int(max(self.rank_peak_bytes)) if self.rank_peak_bytes else None,
            fits=self.fits, split_points_count=len(self.result.cuts) if self.result else None,
            note=self.reason or (f"recomputes stages {self.recompute}" if self.recompute else ""),
        )


def inflight_per_stage(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> list[int]:
    """Micro-batches whose activations each stage holds at its peak under ``schedule``.

    Example:
        >>> inflight_per_stage("1F1B", n_ranks=2, n_microbatches=4, stages_per_rank=1)
        [2, 1]
    """
    p = n_ranks * stages_per_rank
    timeline = costmodel.simulate_step([1.0] * p, [2.0] * p, [], schedule=schedule, n_microbatches=n_microbatches,
                                       stages_per_rank=stages_per_rank)
    return [max(1, int(x)) for x in timeline.stage_peak_inflight]


# --------------------------------------------------------------------------- one split, costed


def split_stage_times_s(problem: PartitionProblem, cuts: Sequence[int], costs: Sequence[SegmentCost],
                        n_microbatches: int, recompute: Sequence[int] = ()) -> tuple[list[float], list[float]]:
    """Per stage of the split at ``cuts``, forward and backward seconds on its device."""
    return costmodel.stage_times_s(costs, cuts, n_microbatches, speed=problem.speed, recompute=recompute)


def split_cut_times_s(problem: PartitionProblem, cuts: Sequence[int]) -> list[float]:
    """One-way seconds of each stage boundary of the split at ``cuts`` (:func:`costmodel.cut_time_s`)."""
    return costmodel.cut_times_s([problem.cut_fwd_bytes[k] for k in cuts], [problem.cut_bwd_bytes[k] for k in cuts],
                                 problem.bandwidth, problem.latency_s,
                                 [max(problem.cut_fwd_messages[k], problem.cut_bwd_messages[k]) for k in cuts])


def split_step_tail(traced: TracedModel, problem: PartitionProblem, cuts: Sequence[int],
                    costs: Sequence[SegmentCost], ranks: Sequence[int], n_microbatches: int,
                    copy_bandwidth: float) -> StepTail:
    """The once-per-step tail of the split at ``cuts`` (:func:`costmodel.step_tail`), on the first link."""
    return costmodel.step_tail(
        n_microbatches=n_microbatches, out_bytes=merged_output_bytes(costs),
        n_ranks=max(ranks) + 1 if len(ranks) else 1,
        bandwidth=float(problem.bandwidth[0]) if len(problem.bandwidth) else math.inf,
        latency_s=float(problem.latency_s[0]) if len(problem.latency_s) else 0.0,
        copy_bandwidth=copy_bandwidth, shared_bytes=tied_gradient_bytes(traced, cuts, ranks))


def predict_split_step_s(problem: PartitionProblem, cuts: Sequence[int], costs: Sequence[SegmentCost],
                         option: ScheduleOption, traced: TracedModel, ranks: Sequence[int],
                         recompute: Sequence[int] = ()) -> float:
    """Predicted step of the split at ``cuts`` under ``option``: the simulated schedule + the step's tail."""
    m = option.n_microbatches
    fwd, bwd = split_stage_times_s(problem, cuts, costs, m, recompute)
    return costmodel.predicted_step_s(
        fwd, bwd, split_cut_times_s(problem, cuts), schedule=option.schedule, n_microbatches=m,
        stages_per_rank=option.stages_per_rank, action_overhead_s=option.action_overhead_s,
        lazy_sends=option.lazy_sends,
        tail=split_step_tail(traced, problem, cuts, costs, ranks, m, option.copy_bandwidth))


def predict_split(option: ScheduleOption, cuts: Sequence[int], recompute: Sequence[int], *, traced: TracedModel,
                  costs: Sequence[SegmentCost], optimizer_factor: float) -> tuple[float, list[float]]:
    """Predicted step and per-rank peak bytes of any split of a costed ``option``, ``recompute`` stages recomputing.

    Example:
        >>> step, peaks = predict_split(option, [3], [0], traced=traced, costs=graph.costs,
        ...                             optimizer_factor=2.0)  # doctest: +SKIP
    """
    if option.problem is None:
        raise ValueError("option has no problem: cost it with cost_option first")
    ranks = stage_ranks(option.schedule, option.problem.num_stages // option.stages_per_rank, option.stages_per_rank)
    again = sorted(set(int(s) for s in recompute))
    step = predict_split_step_s(option.problem, cuts, costs, option, traced, ranks, again)
    peaks, _ = _rank_peaks(option, option.problem, cuts, again, costs, traced, ranks, optimizer_factor)
    return step, peaks


# --------------------------------------------------------------------------- one option, costed


def cost_option(
    option: ScheduleOption, *, traced: TracedModel, cost_graph: CostGraph, n_gpus: int,
    rank_devices: Sequence[Device], optimizer_factor: float, link_default: tuple[float, float], objective: str,
    overhead_default: float = 0.0, lazy_sends: bool = False, copy_bandwidth: float = math.inf,
    allow_recompute: bool = True, inside_block_margin: float = 0.0,
) -> ScheduleOption:
    """Find the best split for one schedule option and predict its step time and memory.

    Example:
        >>> option = cost_option(ScheduleOption("1F1B", 1, 4), traced=traced, cost_graph=graph, n_gpus=2,
        ...                      rank_devices=[Device()] * 2, optimizer_factor=2.0, link_default=(2e9, 1e-4),
        ...                      objective="step")  # doctest: +SKIP
    """
    sched, v, m = option.schedule, option.stages_per_rank, option.n_microbatches
    costs = cost_graph.costs or []
    ranks = stage_ranks(sched, n_gpus, v)
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
    limited = memory_limited(problem)
    keep = (lambda pb: [solve_bottleneck(pb)]) if objective == "bottleneck" else candidate_partitions
    gap = _rank_gap_fn(option, problem, costs, traced, ranks, optimizer_factor)
    try:
        results = keep(problem)
    except InfeasibleMemoryError as e:
        if not (limited and allow_recompute):
            raise _per_rank_least_memory(e, problem, gap) from None
        results = []
    if limited:
        # The partitioner counts memory per stage; a rank also holds the tensors it sent. Splits
        # that fit per stage but not per rank are replaced by ones found under tightened limits.
        results = _tightened(problem, keep, gap, results)
    if limited and allow_recompute and _memory_binds(problem, results, gap):
        # Splits the memory ruled out may fit with some stages recomputing; they compete on the step.
        again = (lambda pb: recompute_candidates(pb)[:1]) if objective == "bottleneck" else recompute_candidates
        results += _tightened(problem, again, gap, _search_or_none(again, problem))
    if not results:
        raise _infeasible_with_recompute(problem, gap)
    units = layer_units(traced)
    peers: list[list[int]] = []
    if objective != "bottleneck":  # the step decides: the peers', the layer-level and (if few) every split compete
        extra, option.baselines = more_candidates(problem, traced, costs, results, units)
        results = [*results, *extra]
        peers = peer_cuts(option.baselines, problem.num_stages)
    option.candidates = len(results)
    scored = []
    for r in results:
        again, step, fits = fit_ranks(option, problem, r, costs, traced, ranks, rank_devices, optimizer_factor,
                                       limited, allow_recompute)
        scored.append((step, r, fits, again))
    pick = prefer_layer_split([(step, r, fits) for step, r, fits, _ in scored], units.starts,
                              margin=inside_block_margin, peers=peers)
    option.predicted_step_s, option.result, _, option.recompute = scored[pick]
    cuts, again = option.result.cuts, option.recompute
    option.step_tail = split_step_tail(traced, problem, cuts, costs, ranks, m, copy_bandwidth)
    # Memory per rank from the simulated timeline (stages on one rank peak at different times).
    option.rank_peak_bytes, timeline = _rank_peaks(option, problem, cuts, again, costs, traced, ranks,
                                                   optimizer_factor)
    option.fits = all(pk <= d.memory_bytes for pk, d in zip(option.rank_peak_bytes, rank_devices))
    rank_work = rank_work_lower_bound_s(problem, v, [d.speed for d in rank_devices])
    whole = float(problem.compute_s.sum() / max(problem.speed)) if len(problem.speed) else math.inf
    option.step_lower_bound_s = costmodel.step_lower_bound_s(
        rank_work, whole, timeline, n_microbatches=m, action_overhead_s=option.action_overhead_s,
        tail=option.step_tail)
    return option


def memory_limited(problem: PartitionProblem) -> bool:
    """Whether some stage's device has a memory limit the splits are checked against (and may recompute for)."""
    return bool(np.isfinite(problem.capacity_bytes).any()) and problem.fwd_s is not None


def _memory_binds(problem: PartitionProblem, results: Sequence[PartitionResult],
                  gap: Callable[[PartitionResult], np.ndarray]) -> bool:
    """Whether memory changed the search: nothing fits, or the split that ignores memory does not fit."""
    if not results:
        return True
    free = PartitionProblem(**{**problem.__dict__, "capacity_bytes": np.full_like(problem.capacity_bytes, np.inf)})
    split = evaluate(problem, solve_bottleneck(free).cuts)
    return not (split.fits_memory and (np.array(split.stage_mem_bytes) + gap(split) <= problem.capacity_bytes).all())


#: Rounds of tightening the per-stage limits to what the ranks hold (:func:`_tightened`).
TIGHTEN_ROUNDS = 4


def _rank_gap_fn(option: ScheduleOption, problem: PartitionProblem, costs: Sequence[SegmentCost],
                 traced: TracedModel, ranks: Sequence[int], optimizer_factor: float) -> Callable[[PartitionResult], np.ndarray]:
    """Per stage of a split, the bytes its rank's predicted peak exceeds the stage's own peak by."""
    def gap(result: PartitionResult) -> np.ndarray:
        peaks, _ = _rank_peaks(option, problem, result.cuts, result.recompute, costs, traced, ranks,
                               optimizer_factor)
        return np.maximum(np.array([peaks[r] for r in ranks]) - np.array(result.stage_mem_bytes), 0.0)
    return gap


def _tightened(problem: PartitionProblem, search: Callable[[PartitionProblem], list[PartitionResult]],
               gap: Callable[[PartitionResult], np.ndarray], results: list[PartitionResult]) -> list[PartitionResult]:
    """``results`` (what ``search`` found at the devices' limits) and the splits it finds under tightened limits."""
    out = list(results)
    seen = {(tuple(r.cuts), tuple(r.recompute)) for r in out}
    found, caps = out, problem.capacity_bytes
    for _ in range(TIGHTEN_ROUNDS):
        if not found:
            break
        need = np.array(found[0].stage_mem_bytes) + gap(found[0])
        if (need <= problem.capacity_bytes * (1 + 1e-12)).all():
            break
        tighter = np.minimum(caps, problem.capacity_bytes - gap(found[0]))
        if np.array_equal(tighter, caps) or not (tighter > 0).all():
            break  # nothing new to find, or a stage left no room at all
        caps = tighter
        found = _search_or_none(search, PartitionProblem(**{**problem.__dict__, "capacity_bytes": caps}))
        for r in found:
            if (tuple(r.cuts), tuple(r.recompute)) not in seen:
                seen.add((tuple(r.cuts), tuple(r.recompute)))
                out.append(evaluate(problem, r.cuts, r.recompute))
    return out


def _search_or_none(search: Callable[[PartitionProblem], list[PartitionResult]],
                    problem: PartitionProblem) -> list[PartitionResult]:
    """``search(problem)``, or no split where nothing fits."""
    try:
        return [r for r in search(problem) if r is not None]
    except InfeasibleMemoryError:
        return []


def _rank_peaks(option: ScheduleOption, problem: PartitionProblem, cuts: Sequence[int], again: Sequence[int],
                costs: Sequence[SegmentCost], traced: TracedModel, ranks: Sequence[int],
                optimizer_factor: float) -> tuple[list[float], Timeline]:
    """Per rank, the predicted peak bytes of the split at ``cuts``, stages ``again`` recomputing; and its timeline."""
    m = option.n_microbatches
    fwd, bwd = split_stage_times_s(problem, cuts, costs, m, again)
    timeline = costmodel.simulate_step(fwd, bwd, split_cut_times_s(problem, cuts), schedule=option.schedule,
                                       n_microbatches=m, stages_per_rank=option.stages_per_rank,
                                       action_overhead_s=option.action_overhead_s, lazy_sends=option.lazy_sends)
    edges = [0, *cuts, problem.num_segments]
    into = problem.stage_input_bytes()
    peaks = costmodel.rank_peak_bytes(
        timeline,
        stage_static_bytes=[float(problem.static_bytes[i:j].sum()) for i, j in zip(edges, edges[1:])],
        stage_act_bytes=[int(problem.act_bytes[i:j].sum()) for i, j in zip(edges, edges[1:])],
        cut_fwd_bytes=[problem.cut_fwd_bytes[k] for k in cuts], cut_bwd_bytes=[problem.cut_bwd_bytes[k] for k in cuts],
        split_backward=schedules.schedule_spec(option.schedule).split_backward,
        merge_bytes=m * merged_output_bytes(costs),
        overcount=rank_overcount_bytes(traced, cuts, ranks, optimizer_factor),
        recompute=again, stage_input_bytes=[float(into[i]) for i in edges[:-1]],
        stage_work_bytes=tuple(costmodel.stage_work_bytes(w, cuts, problem.cut_bwd_bytes, problem.act_bytes)
                               for w in ([c.bwd_peak_bytes for c in costs], [c.bwd_input_peak_bytes for c in costs])),
        stage_grad_bytes=stage_grad_bytes(traced, cuts, ranks),
        relayed_grad_bytes=costmodel.relayed_gradient_bytes(problem.relay_gaps, cuts, problem.num_segments))
    return peaks, timeline


def fit_ranks(option: ScheduleOption, problem: PartitionProblem, result: PartitionResult,
               costs: Sequence[SegmentCost], traced: TracedModel, ranks: Sequence[int], rank_devices: Sequence[Device],
               optimizer_factor: float, limited: bool, allow_recompute: bool = True) -> tuple[list[int], float, bool]:
    """The stages of ``result`` to recompute so that every rank fits, its predicted step, and whether it fits."""
    again = list(result.recompute)
    step = predict_split_step_s(problem, result.cuts, costs, option, traced, ranks, again)
    if not limited:
        return again, step, True
    edges = [0, *result.cuts, problem.num_segments]
    act = [float(problem.act_bytes[i:j].sum()) for i, j in zip(edges, edges[1:])]
    while True:
        peaks, _ = _rank_peaks(option, problem, result.cuts, again, costs, traced, ranks, optimizer_factor)
        over = {r for r, (pk, d) in enumerate(zip(peaks, rank_devices)) if pk > d.memory_bytes}
        more = [s for s in range(problem.num_stages) if ranks[s] in over and s not in again and allow_recompute]
        if not over or not more:
            return again, step, not over
        again = sorted([*again, max(more, key=lambda s: act[s])])
        step = predict_split_step_s(problem, result.cuts, costs, option, traced, ranks, again)


def _infeasible_with_recompute(problem: PartitionProblem,
                               gap: Callable[[PartitionResult], np.ndarray]) -> InfeasibleMemoryError:
    """No split fits even with every stage free to recompute: what memory would."""
    need = _least_rank_memory(problem, min_memory_with_recompute(problem), gap, recompute=True)
    return _least_memory_error(problem, need, ", with activation recomputation considered for every stage",
                               "recomputing where it helps",
                               "Give more memory, more devices, or a schedule that holds fewer micro-batches (1F1B).")


def _per_rank_least_memory(error: InfeasibleMemoryError, problem: PartitionProblem,
                           gap: Callable[[PartitionResult], np.ndarray]) -> InfeasibleMemoryError:
    """The partitioner's error, its least memory checked per rank (no recomputation)."""
    if error.min_memory_bytes is None:
        return error
    need = _least_rank_memory(problem, float(error.min_memory_bytes), gap, recompute=False)
    return _least_memory_error(problem, need, "", "keeping every activation",
                               "Give more memory, more devices, a schedule that holds fewer micro-batches (1F1B), "
                               "or let stages recompute (recompute='auto').")


def _least_memory_error(problem: PartitionProblem, need: float, considered: str, how: str,
                        advice: str) -> InfeasibleMemoryError:
    """The error saying no split fits, naming ``need`` (rounded up) as memory that would."""
    caps = problem.capacity_bytes
    others = " (a device that has more keeps its own)" if np.isfinite(caps).all() and caps.min() < caps.max() else ""
    return InfeasibleMemoryError(
        f"no split into {problem.num_stages} stages fits the memory given ({format_capacities(problem.capacity_bytes)})"
        f"{considered}; {format_bytes(need, round_up=True)} per device fits{others} (with {problem.num_stages} "
        f"stages, this schedule and optimizer, {how}): the least of the splits the search tries, within "
        f"{LEAST_MEMORY_TOLERANCE:.1%}; another split may fit in a little less. {advice}",
        min_memory_bytes=int(np.ceil(need)),
    )


def _least_rank_memory(problem: PartitionProblem, stage_need: float,
                       gap: Callable[[PartitionResult], np.ndarray], *, recompute: bool) -> float:
    """Per-device memory at which a split fits per rank, from the least that fits per stage."""
    caps = problem.capacity_bytes
    if np.isfinite(caps).all() and caps.min() < caps.max():
        equal = PartitionProblem(**{**problem.__dict__, "capacity_bytes": np.full(problem.num_stages, caps.min())})
        least = min_memory_with_recompute(equal) if recompute else solve_min_memory(equal)
        return _least_rank_memory(equal, float(least), gap, recompute=recompute)
    ratio = capacity_shares(problem)
    if not np.isfinite(stage_need) or not (ratio > 0).all():
        return stage_need
    def least_found(memory: float) -> float:
        """The least per-rank memory of the splits the search finds at ``memory``; inf for none."""
        at = PartitionProblem(**{**problem.__dict__, "capacity_bytes": ratio * memory * (1 + 1e-9)})
        search = ((lambda pb: recompute_candidates(pb)[:LEAST_MEMORY_SPLITS]) if recompute else
                  (lambda pb: candidate_partitions(pb)[:LEAST_MEMORY_SPLITS]))
        # As the planner searches: also under limits tightened by what each rank holds beyond its stage.
        found = _tightened(at, search, gap, _search_or_none(search, at))
        return min((float(((np.array(r.stage_mem_bytes) + gap(r)) / ratio).max()) for r in found), default=np.inf)

    per_rank = least_found(stage_need)
    if not np.isfinite(per_rank):
        return stage_need
    # The splits found at the per-stage least can need more per rank than others found with a
    # little more memory: bisect between the two for the least memory at which a split found
    # fits per rank (that least is what is named, so it must fit and little less may).
    lo, hi = stage_need, max(stage_need, per_rank)
    if least_found(lo) <= lo * (1 + 1e-9):
        return float(lo)
    while hi > lo * (1 + LEAST_MEMORY_TOLERANCE):
        mid = float(np.sqrt(lo * hi))
        need = least_found(mid)
        if need <= mid * (1 + 1e-9):
            hi = max(stage_need, need)
        else:
            lo = mid
    return float(hi)


#: Splits fitting at the least per-stage memory that :func:`_least_rank_memory` checks per rank.
LEAST_MEMORY_SPLITS = 8
#: How close to the least memory that fits per rank the named figure is (a share of it).
LEAST_MEMORY_TOLERANCE = 0.005


def auto_schedule_options(n_gpus: int, n_microbatches: int, num_segments: int) -> list[tuple[str, int]]:
    """The (schedule, stages per rank) pairs ``schedule="auto"`` compares.

    Example:
        >>> auto_schedule_options(n_gpus=1, n_microbatches=2, num_segments=4)
        [('GPipe', 1), ('1F1B', 1)]
    """
    pairs = [(spec.name, v) for spec in schedules.SCHEDULE_SPECS.values() for v in spec.auto_stages_per_rank]
    usable = []
    for sched, v in pairs:
        if n_gpus * v > num_segments or (n_gpus == 1 and v > 1):
            continue
        try:
            validate_schedule(sched, n_gpus, n_microbatches, v)
        except (ValueError, TypeError):
            continue
        usable.append((sched, v))
    return usable
