"""Recomputation the planner chooses: per stage, keep the activations or recompute them in the backward.

Costs are injected (a list of SegmentCost), never measured: a chain of 16 parameter-free
modules whose segments cost 1 s forward and 2 s backward and save 10 kB each, on 2 ranks
under 1F1B with 8 micro-batches (stage 0 holds 2 micro-batches at its peak, stage 1 one).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import autopipe
from autopipe.errors import InfeasibleMemoryError
from autopipe.machine.device import Device
from autopipe.planning import costmodel
from autopipe.planning.costgraph import SegmentCost, build_cost_graph
from autopipe.planning.partitioner import PartitionProblem, evaluate
from autopipe.planning.plan import Plan
from autopipe.planning.recompute import (brute_force_recompute, min_memory_with_recompute, recompute_candidates,
                                         solve_recompute)
from autopipe.planning.schedule_options import ScheduleOption, _rank_peaks, cost_option, predict_split_step_s
from autopipe.planning.schedules import stage_ranks
from autopipe.planning.tracing import trace
from autopipe.runtime.checkpointing import FOLLOW_PLAN, resolve_recompute
from _planning import partition_with

pytestmark = pytest.mark.unit

ACT = 10_000  # bytes each segment saves per micro-batch


def _chain(n: int = 16) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return nn.Sequential(*[nn.Tanh() for _ in range(n)]), (torch.randn(4, 4),)


@pytest.fixture(scope="module")
def chain():
    model, args = _chain()
    traced = trace(model, args)
    costs = [SegmentCost(fwd_s=1.0, bwd_s=2.0, param_bytes=0, act_bytes=ACT, out_bytes=64)
             for _ in range(traced.num_segments)]
    return model, args, traced, costs


def _plan(chain, memory, **kw):
    model, args, _, costs = chain
    dev = Device(memory=memory, bandwidth=1e12, latency_s=0.0, action_overhead_s=0.0)
    return partition_with(model, 2, example_args=args, cost=costs, devices=[dev, dev], loss_fn=False,
                              schedule="1F1B", n_microbatches=8, **kw)


def test_fits_without_recompute_is_unchanged(chain):
    free = _plan(chain, None)
    roomy = _plan(chain, 10**9)
    assert free.recompute_stages == roomy.recompute_stages == []
    assert roomy.split_points == free.split_points
    assert roomy.predicted_step_s == pytest.approx(free.predicted_step_s)
    assert all(st.peak_bytes == st.peak_bytes_kept for st in roomy.stages)


def _option_step(chain, cuts, again):
    """Predicted step and per-rank peaks of one split with stages ``again`` recomputing."""
    _, _, traced, costs = chain
    graph = build_cost_graph(traced, costs)
    dev = Device(memory=10**9, bandwidth=1e12, latency_s=0.0, action_overhead_s=0.0)
    option = cost_option(ScheduleOption("1F1B", 1, 8), traced=traced, cost_graph=graph, n_gpus=2,
                         rank_devices=[dev, dev], optimizer_factor=2.0, link_default=(1e12, 0.0), objective="step")
    ranks = stage_ranks("1F1B", 2, 1)
    step = predict_split_step_s(option.problem, cuts, costs, option, traced, ranks, again)
    peaks, _ = _rank_peaks(option, option.problem, cuts, again, costs, traced, ranks, 2.0)
    return step, peaks


def test_memory_bound_mixed_choice_beats_all_and_none(chain):
    memory = 12 * ACT + 4096  # stage 0 keeps 2 micro-batches: 6 segments at most without recomputing
    plan = _plan(chain, memory)
    assert plan.recompute_stages == [0]  # mixed: stage 0 recomputes, stage 1 keeps its activations
    assert max(plan.rank_peak_bytes) <= memory
    cuts = [plan.stages[1].first_segment]
    n = plan.stages[-1].last_segment + 1
    # Every split with every stage recomputing, and every split with none, that fits: all slower.
    for again in ([0, 1], []):
        steps = []
        for c in range(1, n):
            step, peaks = _option_step(chain, [c], again)
            if max(peaks) <= memory:
                steps.append(step)
        assert steps, f"some split fits with recompute={again}"
        assert plan.predicted_step_s < min(steps) - 1e-9, (again, plan.predicted_step_s, min(steps))
    # The plan's stage times are the cost model's with stage 0 recomputing.
    fwd, bwd = costmodel.stage_times_s(plan.segments, cuts, 8, recompute=[0])
    assert [st.bwd_s for st in plan.stages] == pytest.approx(bwd)
    assert plan.stages[0].bwd_s == pytest.approx(plan.stages[0].fwd_s + 2 * plan.stages[0].fwd_s)
    assert plan.simulated_step_s() == pytest.approx(plan.predicted_step_s)
    s0 = plan.stages[0]
    assert s0.peak_bytes == s0.peak_bytes_recomputed < s0.peak_bytes_kept
    assert plan.stages[1].peak_bytes == plan.stages[1].peak_bytes_kept


def test_infeasible_even_with_recompute_says_so(chain):
    with pytest.raises(InfeasibleMemoryError, match="recomputation considered") as info:
        _plan(chain, 2 * ACT)
    assert info.value.min_memory_bytes > 2 * ACT


def _random_problem(rng: np.random.Generator, n: int, p: int) -> PartitionProblem:
    fwd = rng.uniform(0.1, 1.0, n)
    prob = PartitionProblem(
        compute_s=fwd * rng.uniform(1.5, 3.0, n), static_bytes=rng.uniform(0, 50, n),
        act_bytes=rng.uniform(0, 100, n), cut_fwd_bytes=rng.uniform(0, 30, n + 1),
        cut_bwd_bytes=rng.uniform(0, 30, n + 1), num_stages=p, speed=rng.uniform(0.5, 2.0, p),
        bandwidth=np.full(p - 1, 100.0), latency_s=np.full(p - 1, 0.01),
        inflight=np.arange(p, 0, -1).astype(float), capacity_bytes=np.full(p, 1.0), fwd_s=fwd,
        input_bytes=float(rng.uniform(0, 30)))
    # A capacity between what fits with recomputation and what fits without: memory binds.
    lo = min_memory_with_recompute(prob)
    prob.capacity_bytes = np.full(p, lo * rng.uniform(1.0, 1.6))
    return prob


@pytest.mark.parametrize("seed", range(12))
def test_recompute_search_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    prob = _random_problem(rng, n=int(rng.integers(4, 8)), p=int(rng.integers(2, 4)))
    brute = brute_force_recompute(prob)
    found = solve_recompute(prob)
    assert brute is not None and found is not None
    assert found.fits_memory
    assert found.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-9)
    # Recomputing exactly the stages that do not fit otherwise: none of them could keep.
    for s in found.recompute:
        assert not evaluate(prob, found.cuts, [x for x in found.recompute if x != s]).fits_memory
    # Every candidate fits and none beats the optimum.
    for r in recompute_candidates(prob):
        assert r.fits_memory and r.bottleneck_s >= found.bottleneck_s * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_min_memory_with_recompute_is_exact(seed):
    rng = np.random.default_rng(100 + seed)
    prob = _random_problem(rng, n=5, p=2)
    need = min_memory_with_recompute(prob)
    best = math.inf
    for c in range(1, 5):
        for k in range(3):
            for again in itertools.combinations(range(2), k):
                best = min(best, max(evaluate(prob, [c], again).stage_mem_bytes))
    assert need == pytest.approx(best)


def test_chosen_recompute_set_is_the_fastest_subset_that_fits(chain):
    """For the plan's split, brute force over recompute subsets: the plan's is the fastest that fits."""
    memory = 12 * ACT + 4096
    plan = _plan(chain, memory)
    cuts = [plan.stages[1].first_segment]
    fitting = []
    for k in range(3):
        for again in itertools.combinations(range(2), k):
            step, peaks = _option_step(chain, cuts, list(again))
            if max(peaks) <= memory:
                fitting.append((step, list(again)))
    assert min(fitting)[1] == plan.recompute_stages
    assert min(fitting)[0] == pytest.approx(plan.predicted_step_s)


def test_plan_file_round_trip_and_old_files(chain, tmp_path):
    plan = _plan(chain, 12 * ACT + 4096)
    path = tmp_path / "plan.json"
    plan.save(path)
    back = Plan.load(path)
    assert back == plan and back.recompute_stages == [0]
    data = plan.to_dict()
    del data["recompute_stages"]
    for st in data["stages"]:
        del st["peak_bytes_kept"], st["peak_bytes_recomputed"]
    old = Plan.from_dict(data)
    assert old.recompute_stages == [] and old.stages[0].peak_bytes_kept == 0
    with pytest.raises(autopipe.errors.PlanFileError, match="recompute_stages"):
        Plan.from_dict({**plan.to_dict(), "recompute_stages": [5]})


def test_report_shows_recomputation(chain):
    plan = _plan(chain, 12 * ACT + 4096)
    text = plan.report()
    assert "Recomputation: stage 0 recomputes" in text
    assert "stage 0:" in text and "keeping activations" in text and "-> recomputes" in text
    assert "stage 1:" in text and "-> keeps" in text
    from autopipe.reporting.data import report_data
    from autopipe.reporting.markdown import plan_to_markdown

    data = report_data(plan)
    assert data["summary"]["recompute_stages"] == [0]
    assert "Recomputation: stage 0 recomputes" in plan_to_markdown(data)
    assert "Recomputation" not in _plan(chain, None).report()


def test_runtime_follows_the_plan(chain):
    plan = _plan(chain, 12 * ACT + 4096)
    assert resolve_recompute(FOLLOW_PLAN, plan.num_stages, plan.recompute_stages) == [0]
    assert resolve_recompute(FOLLOW_PLAN, 2, []) == []
    assert resolve_recompute(False, 2, plan.recompute_stages) == []  # the user's choice wins
    with pytest.raises(ValueError, match="recompute_stages"):
        resolve_recompute(FOLLOW_PLAN, 1, [3])
    with pytest.raises(ValueError, match="'auto'"):
        resolve_recompute("all", 2)


def test_cost_model_recompute_formulas():
    assert costmodel.stage_peak_bytes(100, 50, 3, recompute=True, input_bytes=5) == 100 + 3 * 5 + 50
    assert costmodel.recompute_backward_s(1.0, 2.0) == 3.0
    with pytest.raises(ValueError, match="recompute"):
        costmodel.stage_times_s([SegmentCost(1.0, 2.0, 0, 0, 0)] * 2, [1], 4, recompute=[2])


class _Widen(nn.Module):
    """A parameter-free module whose output is ``w`` floats per row: it sets the bytes sent at the cut after it."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x[:, :1].repeat(1, self.w))


def _widening_case():
    """Cut 7 sends 16 bytes, cut 6 1 kB: both are the lightest stage-0 splits, and cut 7 is preferred by both
    of the partitioner's tie-breaks (balance, least communication) while holding one segment more."""
    widths = [128] * 4 + [256, 64, 1] + [128] * 4 + [1]
    model = nn.Sequential(*[_Widen(w) for w in widths])

    def seg(k: int) -> SegmentCost:
        fwd, act = {5: (0.1, 0), 6: (0.0, 1000), 7: (1.1, 1000)}.get(k, (1.0, 1000))
        return SegmentCost(fwd_s=fwd, bwd_s=2 * fwd, param_bytes=0, act_bytes=act, out_bytes=64)

    return model, (torch.randn(4, 8),), [seg(k) for k in range(len(widths))]


def _plan_widening(memory, **kw):
    model, args, costs = _widening_case()
    dev = Device(memory=memory, bandwidth=1e12, latency_s=0.0, action_overhead_s=0.0)
    return partition_with(model, 2, example_args=args, cost=costs, devices=[dev, dev], loss_fn=False,
                              schedule="1F1B", n_microbatches=8, **kw)


def test_split_fitting_per_rank_without_recompute_is_found():
    """A split that fits per stage but not per rank (its rank also holds the tensor it sent) is not the
    only candidate: the search runs again under limits lowered by that difference, and the split that
    fits per rank keeping every activation wins over recomputing."""
    model, args, costs = _widening_case()
    traced = trace(model, args)
    graph = build_cost_graph(traced, costs)
    roomy = Device(memory=10**9, bandwidth=1e12, latency_s=0.0, action_overhead_s=0.0)
    option = cost_option(ScheduleOption("1F1B", 1, 8), traced=traced, cost_graph=graph, n_gpus=2,
                         rank_devices=[roomy, roomy], optimizer_factor=2.0, link_default=(1e12, 0.0),
                         objective="step")
    ranks = stage_ranks("1F1B", 2, 1)
    # The memory that cut 7 fits per stage exactly: per rank it is over by the bytes it sends.
    memory = evaluate(option.problem, [7]).stage_mem_bytes[0]
    peaks = {c: max(_rank_peaks(option, option.problem, [c], [], costs, traced, ranks, 2.0)[0]) for c in (6, 7)}
    assert peaks[7] > memory >= peaks[6]
    best_keeping = min(predict_split_step_s(option.problem, [c], costs, option, traced, ranks)
                       for c in range(1, 12)
                       if max(_rank_peaks(option, option.problem, [c], [], costs, traced, ranks, 2.0)[0]) <= memory)
    plan = _plan_widening(memory)
    assert plan.recompute_stages == [] and plan.split_points == ["6"]
    assert plan.predicted_step_s == pytest.approx(best_keeping)
    assert max(plan.rank_peak_bytes) <= memory


def test_recompute_false_never_recomputes(chain):
    memory = 12 * ACT + 4096
    assert _plan(chain, memory).recompute_stages == [0]
    keep = _plan(chain, memory, recompute=False)
    assert keep.recompute_stages == [] and max(keep.rank_peak_bytes) <= memory
    assert keep.predicted_step_s > _plan(chain, memory).predicted_step_s
    # 9 segments' activations: stage 0 holding 2 micro-batches fits only recomputing.
    assert _plan(chain, 9 * ACT).recompute_stages
    with pytest.raises(InfeasibleMemoryError, match="let stages recompute \\(recompute=.auto.\\)"):
        _plan(chain, 9 * ACT, recompute=False)
    with pytest.raises(ValueError, match=r"recompute='always'.*'auto'.*False"):
        _plan(chain, memory, recompute="always")
    with pytest.raises(ValueError, match=r"partition\(\) takes 'auto'.*False"):
        _plan(chain, memory, recompute=[0])  # stage indices checkpoint a Pipeline's hand split


@pytest.mark.slow  # many plans: the unit lane keeps to quick checks
def test_no_schedule_fits_says_recomputation_was_considered(chain):
    model, args, _, costs = chain
    dev = Device(memory=2 * ACT, bandwidth=1e12, latency_s=0.0, action_overhead_s=0.0)
    kw = dict(example_args=args, cost=costs, devices=[dev, dev], loss_fn=False, schedule="auto", n_microbatches=8)
    with pytest.raises(InfeasibleMemoryError, match="no schedule considered fits .* recomputation considered"):
        partition_with(model, 2, **kw)
    with pytest.raises(InfeasibleMemoryError, match="recompute=False"):
        partition_with(model, 2, recompute=False, **kw)
