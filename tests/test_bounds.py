"""Absurd counts, rates and timeouts are refused with a clear error before any work.

Each bound is checked where the work it guards would start: stage counts before tracing
(absolute) and right after it (against the legal split points), before torch's schedule
order is built or anything is profiled; micro-batch counts against what one schedule can
hold; timeouts against what torch's process groups can wait for.
"""

from __future__ import annotations

import math

import pytest

import autopipe
import autopipe.planning.planner as planner
import autopipe.planning.schedules as schedules
import autopipe.planning.simulator as simulator
from autopipe import Device
from autopipe.planning.plan_file import MAX_STAGES
from autopipe._spawn import MAX_TIMEOUT_S
from autopipe.runtime.distributed import check_timeout_s, init_distributed
from autopipe.planning.schedules import MAX_SCHEDULE_SIZE

from _time_limit import refused_within

FAST = autopipe.ProfileOptions(progress=False, repeats=1, warmup=0)
QUIET = autopipe.ProfileOptions(progress=False)


def _forbid(monkeypatch, module, name: str) -> None:
    """Make ``module.name`` fail the test if it is called: that work must not start."""
    def forbidden(*args, **kwargs):
        pytest.fail(f"{module.__name__}.{name} ran before the bad argument was refused")
    monkeypatch.setattr(module, name, forbidden)


# ---------------------------------------------------------------------- stage counts


@pytest.mark.parametrize("n_gpus", [MAX_STAGES + 1, 10**6, 10**12])
def test_absurd_n_gpus_is_refused_before_tracing_and_fast(small_transformer, monkeypatch, n_gpus):
    model, args = small_transformer
    _forbid(monkeypatch, planner, "trace")
    with refused_within(), pytest.raises(ValueError, match=rf"n_gpus={n_gpus} .*use at most {MAX_STAGES} ranks"):
        autopipe.partition(model, n_gpus, example_args=args, planner=autopipe.PlannerOptions(profiling=FAST))


def test_too_many_stages_for_the_split_points_is_refused_before_building_schedules(small_transformer, small_traced,
                                                                                   monkeypatch):
    # 1000 ranks x 2000 micro-batches: torch's order alone took 88 s and 2.3 GB.
    model, args = small_transformer
    _forbid(monkeypatch, schedules, "action_order_and_source")
    _forbid(monkeypatch, simulator, "action_order_and_source")
    _forbid(monkeypatch, planner, "profile_segments")
    with refused_within(), pytest.raises(ValueError, match=rf"use at most {small_traced.num_segments} stages"):
        autopipe.partition(model, 1000, example_args=args, planner=autopipe.PlannerOptions(profiling=FAST))


def test_too_many_stages_per_rank_is_refused_before_tracing(small_transformer, monkeypatch):
    model, args = small_transformer
    _forbid(monkeypatch, planner, "trace")
    with refused_within(), pytest.raises(ValueError, match=r"stages_per_rank=1000000 .*use at most 50000"):
        autopipe.partition(model, 2, example_args=args, schedule="Interleaved1F1B",
                           planner=autopipe.PlannerOptions(stages_per_rank=10**6, profiling=FAST))


# ---------------------------------------------------------------------- micro-batch counts


def test_absurd_micro_batch_count_is_refused_before_tracing(small_transformer, monkeypatch):
    model, args = small_transformer
    _forbid(monkeypatch, planner, "trace")
    _forbid(monkeypatch, schedules, "action_order_and_source")
    _forbid(monkeypatch, simulator, "action_order_and_source")
    with refused_within(), pytest.raises(ValueError, match=rf"n_microbatches=10000000 .*{MAX_SCHEDULE_SIZE}"):
        autopipe.partition(model, 2, example_args=args, n_microbatches=10**7,
                           planner=autopipe.PlannerOptions(profiling=FAST))


def test_a_step_past_the_schedule_bound_is_refused_before_profiling(small_transformer, monkeypatch):
    model, args = small_transformer
    _forbid(monkeypatch, planner, "profile_segments")
    with refused_within(), pytest.raises(ValueError, match=r"n_microbatches=100000 on 4 stages .*<= 65536"):
        autopipe.partition(model, 4, example_args=args, n_microbatches=100_000,
                           planner=autopipe.PlannerOptions(profiling=FAST))


def test_a_micro_batch_count_that_misses_a_huge_global_batch_is_refused_fast(small_transformer, monkeypatch):
    # The message lists the usable divisors without trying every number up to the batch.
    model, args = small_transformer
    _forbid(monkeypatch, planner, "trace")
    with refused_within(), pytest.raises(ValueError, match=r"use one of \[1, 73, 137, 10001\]"):
        autopipe.partition(model, 2, example_args=args, n_microbatches=4,
                           planner=autopipe.PlannerOptions(global_batch=10**12 + 1, profiling=FAST))


@pytest.mark.parametrize("schedule, n_ranks, stages_per_rank", [("1F1B", 4, 1), ("Interleaved1F1B", 2, 2)])
def test_validate_schedule_refuses_a_step_too_large_to_build(schedule, n_ranks, stages_per_rank):
    with refused_within(), pytest.raises(ValueError, match=r"n_microbatches=10000000 on 4 stages .*MAX_SCHEDULE_SIZE"):
        schedules.validate_schedule(schedule, n_ranks, 10**7, stages_per_rank)


def test_simulate_refuses_a_step_too_large_to_hold():
    with refused_within(), pytest.raises(ValueError, match="MAX_SCHEDULE_SIZE"):
        simulator.simulate([1.0] * 4, [2.0] * 4, schedule="GPipe", n_microbatches=10**7)


def test_the_schedule_bound_lets_a_step_at_the_bound_through():
    schedules.check_schedule_size(4, MAX_SCHEDULE_SIZE // 4)
    with pytest.raises(ValueError):
        schedules.check_schedule_size(4, MAX_SCHEDULE_SIZE // 4 + 1)


def test_checking_counts_alone_builds_no_order(monkeypatch):
    _forbid(monkeypatch, schedules, "action_order_and_source")
    assert schedules.validate_schedule("1F1B", 4, 10**7, check_order=False) == "1F1B"
    with pytest.raises(ValueError, match="n_microbatches >= n_ranks"):
        schedules.validate_schedule("1F1B", 4, 2, check_order=False)


# ---------------------------------------------------------------------- Device bandwidth and times


@pytest.mark.parametrize("value, expected", [("10GB", 10e9), ("10GB/s", 10e9), ("1.5 GiB/s", 1.5 * 2**30),
                                             (2e9, 2e9), (5, 5.0)])
def test_device_bandwidth_takes_what_parse_bytes_takes_per_second(value, expected):
    device = Device(bandwidth=value)
    assert device.bandwidth == pytest.approx(expected)
    assert isinstance(device.bandwidth, float)


@pytest.mark.parametrize("value", ["fast", "10 parsecs", "", [10e9], True, math.nan, math.inf, -1.0, 0])
def test_a_bad_device_bandwidth_names_the_argument_and_the_accepted_forms(value):
    with pytest.raises(ValueError, match=r"Device bandwidth=.*'10GB'"):
        Device(bandwidth=value)


@pytest.mark.parametrize("kwargs", [dict(latency_s="1ms"), dict(latency_s=math.inf), dict(action_overhead_s="0.7ms"),
                                    dict(action_overhead_s=[1e-3])])
def test_device_times_that_are_not_numbers_get_a_clear_error(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"Device {name}=.* must be a finite time >= 0 seconds"):
        Device(**kwargs)


def test_partition_takes_a_bandwidth_string_like_device(small_transformer):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(devices=Device(bandwidth="10GB"), cost="params", profiling=QUIET))
    assert [link.bandwidth for link in plan.machine.links] == [10e9]


# ---------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("timeout_s", [math.inf, math.nan, 1e10, MAX_TIMEOUT_S * 2, 0, -5.0, "600", True])
def test_a_timeout_torch_cannot_wait_for_is_refused_with_its_range(timeout_s):
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a finite number of seconds > 0 and <= 31536000"):
        check_timeout_s(timeout_s)


def test_a_year_is_the_longest_timeout():
    assert check_timeout_s(MAX_TIMEOUT_S) == MAX_TIMEOUT_S == 365 * 24 * 3600


def test_init_distributed_refuses_an_infinite_timeout_before_joining(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # joining would fail with another error
    with pytest.raises(ValueError, match="timeout_s=inf"):
        init_distributed(timeout_s=math.inf)


@pytest.mark.parametrize("timeout_s", [math.inf, 1e10])
def test_pipeline_refuses_a_timeout_torch_cannot_wait_for_before_joining(timeout_s, monkeypatch):
    import _runtime_workers as workers
    from autopipe.runtime import Pipeline

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=rf"timeout_s={timeout_s!r} must be a finite number of seconds"):
        Pipeline(workers.tutorial_model(), example_args=workers.example_args(), split_points=workers.SPLITS[2],
                 timeout_s=timeout_s)


def test_measure_link_refuses_a_timeout_torch_cannot_wait_for_before_starting_processes():
    from autopipe.machine.link import measure_link

    # A failure in a started process comes back as a RuntimeError: this ValueError is the check before any starts.
    with pytest.raises(ValueError, match="timeout_s=1e\\+300"):
        measure_link(device="cpu", timeout_s=1e300)


def test_bounds_leave_ordinary_plans_alone(small_transformer):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, n_microbatches=8,
                              planner=autopipe.PlannerOptions(cost="params", profiling=QUIET))
    assert plan.num_stages == 2 and plan.n_microbatches == 8
