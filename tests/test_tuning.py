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
    # another beats it round by round and nothing beats that one.
    steps = r0["round_steps"]
    assert steps == r1["round_steps"] and len(steps) == len(r0["splits"]) and all(len(s) == 2 for s in steps)
    assert [statistics.median(s) for s in steps] == pytest.approx(r0["measured"])
    unbeaten = [k for k in range(len(steps)) if min(paired_ratio(s, steps[k]) for s in steps) >= 1.0]
    own_stays = 0 in unbeaten or not unbeaten  # unbeaten, or the splits beat each other in a circle
    assert r0["chosen"] == (0 if own_stays else min(unbeaten, key=lambda k: statistics.median(steps[k])))
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
