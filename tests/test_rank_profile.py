"""profile_in_ranks(): every rank profiles the model at once; all get the same mean costs."""

from __future__ import annotations

import functools

from dataclasses import replace

import pytest
import torch

import autopipe
from autopipe.planning.rank_profile import profile_in_ranks
from _dist_utils import run_world


def _small_model():
    from autopipe.models import seed_transformer

    return seed_transformer(vocab_size=100, num_layers=2, seq_len=8, d_model=32, num_heads=4, d_ff=64, batch=2)


def _profile_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    model, args = _small_model()
    costs = profile_in_ranks(model, args, device="cpu", warmup=0, repeats=2)
    own = profile_in_ranks.__module__
    times = [(c.fwd_s, c.bwd_s, c.accum_s) for c in costs]
    plan = autopipe.partition(model, world_size, args, n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu")))
    mine = torch.tensor([t for row in times for t in row], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return {"module": own, "n": len(costs), "same_everywhere": all(torch.equal(g, gathered[0]) for g in gathered),
            "positive": all(c.fwd_s > 0 for c in costs), "split": plan.split_points,
            "bytes": [c.param_bytes for c in costs]}


@pytest.mark.distributed
def test_every_rank_gets_the_same_mean_profile_and_so_the_same_plan():
    results = run_world(_profile_worker, 2, timeout_s=120, pg_timeout_s=60)
    first = results[0]
    assert first["module"] == "autopipe.planning.rank_profile" and first["n"] > 2 and first["positive"]
    assert all(r["same_everywhere"] for r in results)
    assert all(r["split"] == first["split"] and r["bytes"] == first["bytes"] for r in results)


def _bad_repeats_worker(rank: int, world_size: int) -> str:
    model, args = _small_model()
    try:
        profile_in_ranks(model, args, device="cpu", repeats=0)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.distributed
def test_bad_arguments_fail_on_every_rank_before_anyone_waits():
    results = run_world(_bad_repeats_worker, 2, timeout_s=60, pg_timeout_s=20)
    assert results == ["repeats=0 must be an integer >= 1"] * 2


def test_it_needs_a_process_group():
    model, args = _small_model()
    with pytest.raises(RuntimeError, match="profile_in_ranks\\(\\) is collective: start the process group first"):
        profile_in_ranks(model, args, device="cpu")


def _pipeline_worker(rank: int, world_size: int, flags: list[bool | None]) -> dict:
    """For each ``in_ranks`` flag, the pipeline that plans for itself; then one given devices with their own speeds."""
    import torch.nn.functional as F

    import autopipe.planning.planner as planner

    model, args = _small_model()
    seen: list[str] = []
    real = planner.plan_partition

    def spy(*a, **k):
        seen.append(type(k.get("cost")).__name__)
        return real(*a, **k)

    profiling = autopipe.ProfileOptions(progress=False, repeats=2, warmup=0)
    x = torch.cat([args[0]] * 2)
    results: dict = {}
    planner.plan_partition = spy
    try:
        for flag in flags:
            seen.clear()
            pipe = autopipe.Pipeline(model, example_args=args,
                                     loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                                     schedule="1F1B", n_microbatches=2,
                                     planner=autopipe.PlannerOptions(profiling=replace(profiling, in_ranks=flag)))
            loss = pipe.step(x, target=torch.zeros_like(x))
            results[flag] = {"planner_got": list(seen), "split": pipe.plan.split_points,
                             "loss_finite": loss is None or bool(torch.isfinite(loss))}
        # Devices with their own speeds: the default leaves the profile to rank 0 alone.
        seen.clear()
        with_devices = autopipe.Pipeline(model, example_args=args, schedule="1F1B", n_microbatches=2,
                                         planner=autopipe.PlannerOptions(profiling=profiling,
                                                                         devices=[autopipe.Device()] * 2))
        results["with_devices"] = {"planner_got": list(seen), "split": with_devices.plan.split_points}
    finally:
        planner.plan_partition = real
    return results


@functools.lru_cache(maxsize=None)
def pipeline_results() -> list[dict]:
    return run_world(_pipeline_worker, 2, [True, None], timeout_s=180)


@pytest.mark.distributed
@pytest.mark.parametrize("flag", [True, None])
def test_a_pipeline_plans_from_a_profile_every_rank_takes_by_default(flag):
    results = pipeline_results()
    # Only rank 0 plans: from the ranks' profile (SegmentCosts), then with devices from its own (None).
    assert results[0][flag]["planner_got"] == ["SegmentCosts"] and results[1][flag]["planner_got"] == []
    assert results[0][flag]["split"] == results[1][flag]["split"] and all(r[flag]["loss_finite"] for r in results)
    assert results[0]["with_devices"]["planner_got"] == ["NoneType"] and results[1]["with_devices"]["planner_got"] == []
    assert results[0]["with_devices"]["split"] == results[1]["with_devices"]["split"]


def test_the_default_profiles_in_the_ranks_only_when_nothing_else_gives_the_costs():
    from autopipe.runtime.plan_setup import profile_in_ranks_by_default

    PlannerOptions = autopipe.PlannerOptions
    assert profile_in_ranks_by_default(2, PlannerOptions(memory="1GiB", cost="measured"))
    assert not profile_in_ranks_by_default(1, PlannerOptions())  # one rank: its own profile is the ranks' profile
    # Costs given (a profile, a scaled profile), devices with their own speeds, an estimate.
    for option in (PlannerOptions(cost=[]), PlannerOptions(cost=object()), PlannerOptions(devices=[]),
                   PlannerOptions(cost="flops")):
        assert not profile_in_ranks_by_default(4, option), option


def test_profile_in_ranks_on_a_pipeline_is_checked_before_joining_a_job():
    model, args = _small_model()
    with pytest.raises(ValueError, match="ProfileOptions in_ranks='yes' must be True, False or None"):
        autopipe.Pipeline(model, example_args=args,
                          planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(in_ranks="yes")))
    with pytest.raises(ValueError, match="but a plan or split_points was given: there is nothing to plan"):
        autopipe.Pipeline(model, example_args=args, split_points=["layers.1"],
                          planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(in_ranks=True)))
    with pytest.raises(ValueError, match="in_ranks=True measures the costs, but the planner options give them"):
        autopipe.Pipeline(model, example_args=args,
                          planner=autopipe.PlannerOptions(cost=[], profiling=autopipe.ProfileOptions(in_ranks=True)))


def test_the_ranks_profile_as_many_rounds_as_the_planner_would_unless_told():
    from autopipe.runtime.plan_setup import rank_profile_settings

    planner = autopipe.ProfileOptions()  # what partition profiles with when not told
    assert rank_profile_settings(planner) == {"warmup": planner.warmup, "repeats": planner.repeats,
                                              "flush_cache": True, "fit_to_whole": None}
    assert rank_profile_settings(autopipe.ProfileOptions(repeats=9, flush_cache=False)) == {
        "warmup": planner.warmup, "repeats": 9, "flush_cache": False, "fit_to_whole": None}
