"""autopipe.tune: real steps of a plan's best splits on the ranks, the fastest kept, every rank agreeing.

Nothing here asserts on a time: the test checks that the ranks agree, that what was measured
is recorded, and that the pipeline it returns trains as the unsplit model does.
"""

from __future__ import annotations

import functools
import statistics

import pytest

import _tuning_workers as workers
from _dist_utils import run_world
from autopipe.machine.timing import paired_ratio
from autopipe.runtime.tuning import faster_beyond_noise

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def tuned() -> list[dict]:
    return run_world(workers.tune_run, 2, 3, timeout_s=300)


@pytest.mark.distributed
def test_every_rank_measures_the_same_candidates_and_keeps_the_same_split():
    r0, r1 = tuned()
    assert r0["splits"] == r1["splits"] and r0["chosen"] == r1["chosen"]
    assert r0["measured"] == r1["measured"]  # the slowest rank's times, all-reduced
    assert r0["splits"][0] == r0["plan_split"]  # the plan's own split competes first
    assert len(r0["splits"]) >= 2 and len({tuple(s) for s in r0["splits"]}) == len(r0["splits"])
    assert len(r0["measured"]) == len(r0["predicted"]) == len(r0["splits"]) and r0["rounds"] == 2
    assert all(t > 0 for t in r0["measured"])
    # The choice and the ratios follow from the recorded rounds: the plan's own split unless
    # another beats it beyond the noise of their paired ratios.
    steps = r0["round_steps"]
    assert steps == r1["round_steps"] and len(steps) == len(r0["splits"]) and all(len(s) == 2 for s in steps)
    assert [statistics.median(s) for s in steps] == pytest.approx(r0["measured"])
    assert r0["chosen"] == faster_beyond_noise(steps)
    assert r0["vs_chosen"] == r1["vs_chosen"] == [paired_ratio(s, steps[r0["chosen"]]) for s in steps]
    assert r0["pipe_split"] == r0["splits"][r0["chosen"]]


@pytest.mark.distributed
def test_tuning_leaves_the_weights_and_the_pipeline_trains_as_the_unsplit_model():
    for r in tuned():
        assert r["untouched"] and r["grads_clear"], r
        assert abs(r["loss"] - r["ref_loss"]) < TOL, r
        assert r["grad_diff"] < TOL, r


@pytest.mark.distributed
def test_tune_refuses_what_it_sets_itself_and_counts_below_one():
    for errors in run_world(workers.bad_arguments_run, 2, timeout_s=300):
        assert "split_points" in errors["split_points"] and "plan=" in errors["split_points"]
        assert "rounds" in errors["rounds"]
        assert "candidates" in errors["candidates"]


@pytest.mark.unit
def test_another_split_replaces_the_plans_own_only_beyond_the_noise_of_the_rounds():
    own = [1.0, 1.2, 0.9, 1.1, 1.0]
    clearly = [0.9 * t for t in own]  # a tenth faster in every round
    mixed = [0.8, 1.3, 0.85, 1.15, 0.95]  # faster by the median ratio (0.95), slower in two rounds of five
    assert paired_ratio(mixed, own) < 1.0
    assert faster_beyond_noise([own, mixed]) == 0
    assert faster_beyond_noise([own, mixed, clearly]) == 2
    assert faster_beyond_noise([own, [1.01 * t for t in own]]) == 0
    # Of two splits both clearly faster than the plan's own, the one the other does not beat.
    quickest = [0.8 * t for t in own]
    assert faster_beyond_noise([own, clearly, quickest]) == 2
    # Three splits, each clearly faster than the own, beating each other in a circle: the own stays.
    x, y, z = [0.5, 0.6, 0.7, 0.5, 0.6], [0.6, 0.7, 0.5, 0.6, 0.7], [0.7, 0.5, 0.6, 0.7, 0.5]
    assert paired_ratio(x, y) < 1 and paired_ratio(y, z) < 1 and paired_ratio(z, x) < 1
    assert faster_beyond_noise([own, x, y, z]) == 0
