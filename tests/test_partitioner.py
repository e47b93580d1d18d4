"""solve_bottleneck(): exact for its cost model (checked against brute force), and fast."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import InfeasibleMemoryError
from autopipe.planning.partitioner import PartitionProblem, brute_force, evaluate, solve_bottleneck


@st.composite
def problems(draw):
    n = draw(st.integers(1, 8))
    p = draw(st.integers(1, min(n, 4)))
    pos = st.floats(0.01, 10.0)
    arr = lambda k, s=pos: np.array(draw(st.lists(s, min_size=k, max_size=k)))  # noqa: E731
    return PartitionProblem(
        compute_s=arr(n),
        static_bytes=arr(n),
        act_bytes=arr(n),
        cut_fwd_bytes=arr(n + 1, st.floats(0, 10)),
        cut_bwd_bytes=arr(n + 1, st.floats(0, 10)),
        num_stages=p,
        speed=arr(p, st.floats(0.25, 4)),
        bandwidth=arr(p - 1, st.floats(0.5, 20)),
        latency_s=arr(p - 1, st.floats(0, 1)),
        inflight=arr(p, st.integers(1, 4).map(float)),
        capacity_bytes=arr(p, st.floats(5, 200)),
    )


@settings(max_examples=300, deadline=None)
@given(problems())
def test_optimal_against_brute_force(problem):
    best = brute_force(problem)
    if best is None:
        with pytest.raises(InfeasibleMemoryError):
            solve_bottleneck(problem)
        return
    found = solve_bottleneck(problem)
    assert found.fits_memory
    assert found.bottleneck_s == pytest.approx(best.bottleneck_s, rel=1e-8)


@settings(max_examples=100, deadline=None)
@given(problems())
def test_same_problem_same_answer(problem):
    try:
        a, b = solve_bottleneck(problem), solve_bottleneck(problem)
    except InfeasibleMemoryError:
        return
    assert a.cuts == b.cuts


def test_heavy_last_segment_gets_its_own_stage():
    r = solve_bottleneck(PartitionProblem.uniform([1, 1, 1, 1, 1, 1, 6], num_stages=2))
    assert r.cuts == [6] and r.bottleneck_s == 6


def test_communication_moves_the_cut_to_a_cheap_boundary():
    # Cutting after segment 1 sends 100 bytes, after segment 2 only 1 byte.
    prob = PartitionProblem.uniform([1, 1, 1, 1], num_stages=2, cut_bytes=[0, 100, 100, 1, 0], bandwidth=10.0)
    assert solve_bottleneck(prob).cuts == [3]


def test_faster_device_gets_more_work():
    prob = PartitionProblem.uniform([1.0] * 9, num_stages=2)
    prob.speed = np.array([2.0, 1.0])
    assert solve_bottleneck(prob).cuts == [6]


def test_memory_limit_forces_a_different_split():
    free = PartitionProblem.uniform([1, 1, 1, 3], num_stages=2)
    assert solve_bottleneck(free).cuts == [3]
    tight = PartitionProblem.uniform([1, 1, 1, 3], num_stages=2, static_bytes=[1, 1, 1, 1], capacity_bytes=2)
    r = solve_bottleneck(tight)
    assert r.cuts == [2] and max(r.stage_mem_bytes) <= 2


def test_infeasible_memory_says_the_smallest_that_fits():
    prob = PartitionProblem.uniform([1, 1, 1], num_stages=2, static_bytes=[4, 4, 4], capacity_bytes=5)
    with pytest.raises(InfeasibleMemoryError, match="smallest per-device memory that fits is 8 B") as info:
        solve_bottleneck(prob)
    assert info.value.min_memory_bytes == 8


def test_too_many_stages_is_a_clear_error():
    with pytest.raises(ValueError, match="num_stages=5 exceeds the 3 segments"):
        PartitionProblem.uniform([1, 1, 1], num_stages=5)


def test_evaluate_rejects_bad_cuts():
    prob = PartitionProblem.uniform([1, 1, 1], num_stages=2)
    with pytest.raises(ValueError, match="strictly increasing"):
        evaluate(prob, [0])


def test_large_problem_is_solved_exactly_by_its_own_bounds():
    rng = np.random.default_rng(0)
    prob = PartitionProblem.uniform(rng.random(10_000), num_stages=64)
    r = solve_bottleneck(prob)
    # No split beats the lower bound; the answer is within one segment of it (no comm here).
    lower = prob.compute_s.sum() / 64
    assert lower <= r.bottleneck_s <= lower + prob.compute_s.max()
    assert r.searched["upper"] - r.searched["lower"] <= 1e-9 * r.searched["upper"]
