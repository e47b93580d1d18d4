"""Measuring links and devices: the fit alone, two gloo processes on loopback, Device lists."""

from __future__ import annotations

import math

import pytest

from autopipe.machine.device import Device
from autopipe.machine.link import fit_link, measure_link, measure_link_in_group
from autopipe.machine.speed import measure_device_speed, measure_devices
from autopipe.runtime.overhead_probe import fit_action_overhead, measure_action_overhead

from _dist_utils import run_world

# 1 KiB for the latency, 32 MiB for the bandwidth: large enough that a scheduling delay of a
# few ms on a busy machine (seen under pytest-xdist) cannot make it look faster than 1 KiB
SMALL_SIZES = (1 << 10, 1 << 25)


# --------------------------------------------------------------------------- fit_link


def test_fit_recovers_known_bandwidth_and_latency():
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    times = [50e-6 + n / 2.5e9 for n in sizes]
    bandwidth, latency_s, error = fit_link(sizes, times)
    assert bandwidth == pytest.approx(2.5e9, rel=1e-9)
    assert latency_s == pytest.approx(50e-6, rel=1e-9)
    assert error == 0.0


def test_fit_reports_the_worst_relative_miss():
    sizes = [1000, 2000, 4000]
    times = [1e-6 + n / 1e9 for n in sizes]
    times[1] *= 1.5  # one sample 50% slow
    _, _, error = fit_link(sizes, times)
    assert 0.1 < error < 1.0


def test_a_negative_latency_from_noise_becomes_zero():
    sizes = [1 << 20, 1 << 22, 1 << 24]
    times = [n / 1e9 - 1e-5 for n in sizes]
    bandwidth, latency_s, _ = fit_link(sizes, times)
    assert latency_s == 0.0
    assert 0.9e9 < bandwidth < 1.1e9


def test_fit_rejects_times_that_do_not_grow_with_size():
    with pytest.raises(ValueError, match="does not grow"):
        fit_link([1024, 1 << 20], [2e-3, 1e-3])


def test_fit_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match="sizes_bytes="):
        fit_link([1024, 1024], [1e-3, 1e-3])


# --------------------------------------------------------------------------- measure_link


@pytest.mark.distributed
def test_link_between_two_gloo_processes_has_finite_positive_figures():
    link = measure_link(device="cpu", sizes_bytes=SMALL_SIZES, repeats=5, warmup=1, timeout_s=90)
    assert link.backend == "gloo" and link.devices == ("cpu", "cpu")
    assert 0 < link.bandwidth_bytes_per_s < math.inf
    assert 0 <= link.latency_s < math.inf
    assert [len(s) for s in link.samples_s] == [5, 5]
    assert Device(**link.device_kwargs()).bandwidth == link.bandwidth_bytes_per_s


@pytest.mark.distributed
def test_a_measurement_past_its_timeout_is_killed_and_raises():
    # 10,000 round trips of 32 MiB take minutes: the 0.2 s deadline must end them.
    with pytest.raises(TimeoutError, match="timeout_s=0.2"):
        measure_link(device="cpu", sizes_bytes=(1 << 20, 32 << 20), repeats=10_000, timeout_s=0.2)


def _in_group_worker(rank: int, world_size: int) -> dict:
    link = measure_link_in_group(0, 1, sizes_bytes=SMALL_SIZES, repeats=3, warmup=1)
    return link.to_dict()


@pytest.mark.distributed
def test_both_ends_of_an_existing_group_return_the_same_measurement():
    ends = run_world(_in_group_worker, 2, timeout_s=90, pg_timeout_s=30)
    assert ends[0] == ends[1]
    assert ends[0]["bandwidth_bytes_per_s"] > 0 and ends[0]["latency_s"] >= 0


def test_in_group_measurement_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        measure_link_in_group(0, 1)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"sizes_bytes": (0, 1024)}, "sizes_bytes="),
        ({"sizes_bytes": (1024, 1024)}, "sizes_bytes="),
        ({"sizes_bytes": "1024"}, "sizes_bytes="),
        ({"repeats": 0}, "repeats="),
        ({"warmup": -1}, "warmup="),
        ({"timeout_s": 0}, "timeout_s="),
        ({"timeout_s": math.inf}, "timeout_s="),
        ({"backend": "mpi"}, "backend="),
        ({"device": "cpu", "backend": "nccl"}, "backend="),
        ({"device": ("cpu", "cpu", "cpu")}, "device="),
        ({"device": "tpu"}, "device="),
    ],
)
def test_bad_arguments_raise_before_any_process_starts(kwargs, name):
    # A failure inside a started process comes back as a RuntimeError or TimeoutError, so a
    # ValueError naming the argument can only come from the checks made before any starts.
    with pytest.raises(ValueError, match=name):
        measure_link(**kwargs)


# --------------------------------------------------------------------------- devices


def test_a_device_is_exactly_as_fast_as_itself():
    assert measure_device_speed("cpu", reference="cpu") == 1.0


def test_speed_against_a_given_flop_rate_is_a_positive_ratio():
    speed = measure_device_speed("cpu", reference=1e6)
    assert 0 < speed < math.inf


@pytest.mark.parametrize("reference", [0, -1.0, math.inf, True])
def test_a_reference_that_is_not_a_positive_flop_rate_raises(reference):
    with pytest.raises(ValueError, match="reference="):
        measure_device_speed("cpu", reference=reference)


def test_cpu_ranks_get_speed_one_and_the_given_memory():
    ranks = measure_devices(["cpu", "cpu"], memory="1GiB", reference="cpu", measure_links=False)
    assert [d.speed for d in ranks] == [1.0, 1.0]
    assert [d.memory_bytes for d in ranks] == [2**30, 2**30]
    assert all(d.bandwidth is None and d.latency_s is None for d in ranks)


@pytest.mark.distributed
def test_each_rank_but_the_last_gets_its_link_measured_once_per_pair():
    ranks = measure_devices(["cpu"] * 3, reference="cpu", sizes_bytes=SMALL_SIZES, repeats=2, timeout_s=90)
    assert ranks[-1].bandwidth is None and ranks[-1].latency_s is None  # the last rank sends to no one
    # Both links are the pair (cpu, cpu): measured once, so the same figures, not two noisy runs.
    assert ranks[0].bandwidth == ranks[1].bandwidth > 0
    assert ranks[0].latency_s == ranks[1].latency_s >= 0


def test_a_memory_list_of_the_wrong_length_raises():
    with pytest.raises(ValueError, match="memory has 3 entries"):
        measure_devices(["cpu", "cpu"], memory=["1GiB"] * 3, measure_links=False)


# --------------------------------------------------------------------------- runtime overhead


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_the_fit_recovers_the_overhead_a_simulated_step_was_made_with(schedule, v):
    from autopipe.planning.simulator import simulate

    p = 2 * v
    step = simulate([0.0] * p, [0.0] * p, schedule=schedule, n_microbatches=4, stages_per_rank=v,
                    comm_s=1e-4, action_overhead_s=2.5e-3).step_s
    fitted = fit_action_overhead(step, schedule, v, 2, 4, 1e-4)
    assert fitted == pytest.approx(2.5e-3, rel=1e-9)


def test_a_step_no_longer_than_its_transfers_fits_no_overhead():
    assert fit_action_overhead(1e-6, "1F1B", 1, 2, 4, 1e-3) == 0.0


@pytest.mark.distributed
def test_overhead_of_a_real_two_rank_pipeline_is_usable():
    m = measure_action_overhead(schedules=[("1F1B", 1)], steps=2, timeout_s=180)
    assert m.backend == "gloo" and m.n_ranks == 2 and list(m.per_schedule_s) == ["1F1B-1"]
    # The fit is clipped at zero: on a busy host the stages' compute times the slowdown (both
    # measured at other moments than the steps) can already exceed the measured step.
    assert 0 <= m.action_overhead_s < m.step_s["1F1B-1"]
    assert m.action_overhead_s == m.per_schedule_s["1F1B-1"]
    assert 0 < m.concurrent_slowdown < math.inf
    assert "ms per action" in m.summary()
    assert Device(speed=1 / m.concurrent_slowdown, action_overhead_s=m.action_overhead_s).speed > 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"n_ranks": 1}, "n_ranks="),
        ({"steps": 0}, "steps="),
        ({"schedules": []}, "schedules="),
        ({"schedules": ["1F1B"]}, "schedules entry"),
        ({"schedules": [("Nope", 1)]}, "Nope"),
        ({"schedules": [("Interleaved1F1B", 8)]}, "the probe model has 8 layers"),
        ({"device": "tpu"}, "device="),
        ({"timeout_s": 0}, "timeout_s="),
    ],
)
def test_bad_overhead_arguments_raise_before_any_process_starts(kwargs, name):
    # As for the link: only the checks before any process starts raise a ValueError.
    with pytest.raises(ValueError, match=name):
        measure_action_overhead(**kwargs)
