"""The chosen split is the fastest the planner compared: never predicted slower than what it reports.

Random problems (layer widths, so the bytes crossing each cut, and injected segment costs)
under every schedule: the plan's predicted step is at most every reported alternative's
that fits, and, where there are few splits, it is the lowest predicted step of them all
(brute force with the simulated step as the objective). Costs are injected: nothing is timed.
"""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pytest
import torch
from torch import nn

import autopipe
from autopipe import ProfileOptions
from autopipe.planning.costgraph import SegmentCost
from autopipe.planning.partitioner import PartitionProblem, every_split
from autopipe.planning.plan_records import BaselinePlan
from autopipe.planning.split_candidates import (BRUTE_FORCE_MAX, CLOSE_CALL, close_call_note, layer_problem,
                                               prefer_layer_split)

pytestmark = pytest.mark.unit

#: (schedule, stages per rank): every schedule, the looped ones with two stages per rank.
LAYOUTS = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2), ("InterleavedZeroBubble", 2),
           ("ZBVZeroBubble", 2), ("DualPipeV", 2)]
QUIET = ProfileOptions(progress=False)


def random_case(seed: int, n_layers: int) -> tuple[nn.Module, tuple[torch.Tensor], list[SegmentCost]]:
    """A chain of linear layers of random widths and random (injected) costs per segment."""
    rng = np.random.default_rng(seed)
    widths = [int(w) for w in rng.integers(4, 400, size=n_layers + 1)]
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))
    fwd = rng.uniform(2e-4, 5e-3, size=n_layers)
    costs = [SegmentCost(fwd_s=float(f), bwd_s=float(f * rng.uniform(1.5, 2.5)), param_bytes=4 * a * b,
                         act_bytes=4 * 2 * a, out_bytes=4 * 2 * b, trainable_param_bytes=4 * a * b)
             for f, a, b in zip(fwd, widths, widths[1:])]
    return model, (torch.randn(2, widths[0]),), costs


def plan_for(seed: int, n_layers: int, schedule: str, v: int) -> autopipe.Plan:
    model, args, costs = random_case(seed, n_layers)
    return autopipe.partition(model, 2, args, schedule=schedule, n_microbatches=4, loss_fn=False,
                              planner=autopipe.PlannerOptions(cost=costs, stages_per_rank=v, profiling=QUIET))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule, v", LAYOUTS)
def test_no_reported_alternative_is_predicted_faster_than_the_chosen_split(seed, schedule, v):
    plan = plan_for(seed, 9, schedule, v)
    for b in plan.baselines:
        if b.fits_memory and not b.reason:
            assert plan.predicted_step_s <= b.predicted_step_s * (1 + 1e-9), (b.name, b.split_points)
    assert "faster in the simulated step" not in plan.report()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schedule, v", LAYOUTS)
def test_on_a_small_problem_the_chosen_split_is_the_brute_force_best_by_simulated_step(seed, schedule, v):
    n_layers = 6
    plan = plan_for(seed + 10, n_layers, schedule, v)
    p = plan.num_stages
    assert math.comb(n_layers - 1, p - 1) <= BRUTE_FORCE_MAX  # so the planner costed every split
    names = [s.name for s in plan.segments]
    best = min(plan.split_step_s([names[c] for c in cuts]) for cuts in combinations(range(1, n_layers), p - 1))
    assert plan.predicted_step_s == pytest.approx(best, rel=1e-9)
    assert plan.split_step_s(plan.split_points) == pytest.approx(plan.predicted_step_s, rel=1e-9)


def test_the_layer_problem_merges_segments_and_keeps_the_cuts_between_layers():
    problem = PartitionProblem.uniform([1.0, 2.0, 3.0, 4.0, 5.0], 2, cut_bytes=[0, 10, 20, 30, 40, 0])
    merged = layer_problem(problem, [0, 2, 3])
    assert merged.compute_s.tolist() == [3.0, 3.0, 9.0]
    assert merged.cut_fwd_bytes.tolist() == [0, 20, 30, 0]
    assert merged.cut_fwd_messages.tolist() == [0, 1, 1, 0]
    assert [r.cuts for r in every_split(merged)] == [[1], [2]]


def test_a_cut_inside_a_block_wins_only_beyond_the_margin_and_never_against_a_peer():
    from types import SimpleNamespace as S

    inside, layer = S(cuts=[3], bottleneck_s=1.0), S(cuts=[4], bottleneck_s=1.0)
    starts = [0, 4]
    assert prefer_layer_split([(1.00, inside, True), (1.02, layer, True)], starts, margin=0.03) == 1
    assert prefer_layer_split([(1.00, inside, True), (1.05, layer, True)], starts, margin=0.03) == 0
    assert prefer_layer_split([(1.00, inside, True), (1.02, layer, True)], starts, margin=0.0) == 0
    # A reported peer split faster than the layer-level one: the fastest overall stands.
    peer = S(cuts=[2], bottleneck_s=1.0)
    assert prefer_layer_split([(1.00, inside, True), (1.02, layer, True), (1.01, peer, True)], starts,
                              margin=0.03, peers=[[2]]) == 0
    # What does not fit never wins.
    assert prefer_layer_split([(0.5, inside, False), (1.02, layer, True)], starts, margin=0.0) == 1


def test_a_profile_whose_rounds_disagree_is_called_noisy_in_the_plan():
    from autopipe.machine.passes import WholePass
    from autopipe.planning.planner import NOISY_PROFILE_SPREAD
    from autopipe.planning.profile import SegmentCosts

    model, args, costs = random_case(0, 6)
    notes = {}
    for spread in (0.02, NOISY_PROFILE_SPREAD + 0.1):
        profile = SegmentCosts(costs)
        profile.whole = WholePass(1.0, 2.0, 0.1, 1.0, 2.0, 0.1, scales=(1.0, 1.0, 1.0), fitted=False,
                                  round_spread=spread)
        plan = autopipe.partition(model, 2, args, n_microbatches=4, loss_fn=False,
                                  planner=autopipe.PlannerOptions(cost=profile, profiling=QUIET))
        notes[spread] = [n for n in plan.notes if n.startswith("the profile is noisy")]
    quiet, noisy = notes.values()
    assert quiet == [] and len(noisy) == 1 and "autopipe.tune" in noisy[0] and "35%" in noisy[0]


def test_a_reported_split_predicted_within_a_close_call_is_named_in_the_notes():
    plan = plan_for(0, 9, "1F1B", 1)

    def peer(split, ratio, **kw):
        return BaselinePlan(name="flops_dp", description="", split_points=split, bottleneck_s=0.0,
                            predicted_step_s=plan.predicted_step_s * ratio, peak_bytes=0, **kw)

    other = [str(int(plan.split_points[0]) + 1)]
    plan.baselines = [peer(other, 1.02), peer(["1"], 1.2)]
    note = close_call_note(plan)
    assert note and f"split {other} is predicted 2.0% slower" in note and "autopipe.tune" in note
    for beside in ([peer(other, 1 + CLOSE_CALL)], [peer(list(plan.split_points), 1.0)],  # far enough; the same split
                   [peer(other, 1.01, fits_memory=False)], [peer([], 1.0, reason="not applicable: ...")]):
        plan.baselines = beside
        assert close_call_note(plan) is None, beside
    # partition() adds the note exactly where a reported split is that close (some seeds have one).
    plans = [plan_for(seed, 9, "1F1B", 1) for seed in range(8)]
    noted = [any(n.startswith("a close call") for n in p.notes) for p in plans]
    assert noted == [close_call_note(p) is not None for p in plans] and 0 < sum(noted) < len(plans)
