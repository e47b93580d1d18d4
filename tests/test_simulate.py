"""Specification of the schedules and their simulator (autopipe/planning/schedules.py, simulator.py, timeline.py)."""

from __future__ import annotations

import doctest
import itertools
import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.planning import schedules as schedules_module
from autopipe.planning import simulator as simulator_module
from autopipe.planning import timeline as timeline_module
from autopipe.planning.schedules import (
    SCHEDULES,
    Action,
    action_inputs,
    action_order,
    action_order_and_source,
    canonical_schedule_name,
    schedule_class,
    stage_ranks,
    validate_schedule,
)
from autopipe.planning.simulator import simulate

F_S, B_S = 1.0, 2.0  # uniform forward / backward seconds per micro-batch

# (schedule, n_ranks, n_microbatches, stages_per_rank) that torch accepts, a few per schedule.
COMBOS = [
    ("GPipe", 1, 1, 1), ("GPipe", 3, 2, 1), ("GPipe", 4, 8, 1),
    ("1F1B", 1, 3, 1), ("1F1B", 3, 3, 1), ("1F1B", 4, 10, 1),
    ("Interleaved1F1B", 2, 4, 2), ("Interleaved1F1B", 3, 6, 3), ("Interleaved1F1B", 4, 3, 2),
    ("LoopedBFS", 2, 3, 2), ("LoopedBFS", 4, 8, 2), ("LoopedBFS", 3, 5, 1),
    ("InterleavedZeroBubble", 2, 4, 2), ("InterleavedZeroBubble", 4, 8, 1),
    ("InterleavedZeroBubble", 3, 6, 2),
    ("ZBVZeroBubble", 1, 2, 2), ("ZBVZeroBubble", 2, 4, 2), ("ZBVZeroBubble", 4, 8, 2),
    ("DualPipeV", 1, 2, 2), ("DualPipeV", 2, 4, 2), ("DualPipeV", 3, 9, 2),
]


def uniform(schedule: str, p: int, m: int, v: int = 1, **kwargs):
    """Simulate p ranks x v stages, each stage 1/v of a uniform F_S / B_S rank."""
    n = p * v
    return simulate([F_S / v] * n, [B_S / v] * n, schedule=schedule, n_microbatches=m,
                    stages_per_rank=v, **kwargs)


def assert_dependencies_hold(timeline, comm_s: float = 0.0) -> None:
    """Every action starts after the tensors it needs have been computed and delivered."""
    eps = 1e-9
    last = timeline.n_stages - 1
    ranks = timeline.stage_ranks
    fwd_end = {(e.stage, e.microbatch): e.end_s for e in timeline.events if e.kind == "F"}
    grad_end = {(e.stage, e.microbatch): e.end_s for e in timeline.events if e.kind in "BI"}

    def comm(a: int, b: int) -> float:
        return 0.0 if ranks[a] == ranks[b] else comm_s

    for e in timeline.events:
        s, i = e.stage, e.microbatch
        if e.kind == "F" and s > 0:
            assert e.start_s >= fwd_end[(s - 1, i)] + comm(s - 1, s) - eps, e
        if e.kind in "BI":
            assert e.start_s >= fwd_end[(s, i)] - eps, e
            if s < last:
                assert e.start_s >= grad_end[(s + 1, i)] + comm(s, s + 1) - eps, e
        if e.kind == "W":
            assert e.start_s >= grad_end[(s, i)] - eps, e


# --- names and torch's classes ---------------------------------------------------------


def test_schedules_are_the_seven_canonical_names():
    assert SCHEDULES == ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                         "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("spelling", ["1f1b", "Schedule1F1B", "schedule1f1b", " 1F1B "])
def test_schedule_names_are_case_insensitive_with_optional_schedule_prefix(spelling):
    assert canonical_schedule_name(spelling) == "1F1B"


def test_unknown_schedule_name_is_rejected_with_the_valid_names():
    with pytest.raises(ValueError, match=r"'Zigzag'.*GPipe.*DualPipeV"):
        simulate([1.0], [1.0], schedule="Zigzag", n_microbatches=1)


def test_non_string_schedule_name_is_a_type_error():
    with pytest.raises(TypeError, match="schedule must be a str"):
        canonical_schedule_name(3)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_class_is_torchs_class_of_that_name(name):
    from torch.distributed.pipelining.schedules import get_schedule_class

    assert schedule_class(name.upper()) is get_schedule_class(name)


# --- closed forms for uniform stages ---------------------------------------------------


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (3, 5), (4, 4), (4, 8)])
def test_gpipe_and_1f1b_uniform_step_is_m_plus_p_minus_1_stage_times(schedule, p, m):
    assert uniform(schedule, p, m).step_s == pytest.approx((m + p - 1) * (F_S + B_S))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 8)])
def test_gpipe_and_1f1b_uniform_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    assert uniform(schedule, p, m).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 9)])
def test_1f1b_stage_s_holds_p_minus_s_microbatches_in_flight(p, m):
    assert uniform("1F1B", p, m).stage_peak_inflight == [min(m, p - s) for s in range(p)]


def test_interleaved_with_one_stage_per_rank_holds_2_p_minus_s_minus_1_not_1f1bs_p_minus_s():
    # torch's Interleaved1F1B warm-up is deeper than Schedule1F1B's even with v = 1.
    assert uniform("Interleaved1F1B", 4, 8).stage_peak_inflight == [7, 5, 3, 1]


def test_gpipe_holds_every_microbatch_in_flight_on_every_stage():
    assert uniform("GPipe", 4, 6).peak_inflight == [6, 6, 6, 6]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 4, 16), (3, 3, 3)])
def test_interleaved_bubble_shrinks_by_v_as_in_the_textbook(p, v, m):
    # Narayanan et al. 2021: bubble time (p - 1) (F + B) / v on top of m (F + B) of work.
    timeline = uniform("Interleaved1F1B", p, m, v)
    assert timeline.step_s == pytest.approx(m * (F_S + B_S) + (p - 1) * (F_S + B_S) / v)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 4)])
def test_interleaved_step_is_shorter_than_1f1b_for_the_same_work(p, v, m):
    assert uniform("Interleaved1F1B", p, m, v).step_s < uniform("1F1B", p, m).step_s


def test_zero_bubble_schedules_beat_1f1b_for_uniform_stages():
    one_f_one_b = uniform("1F1B", 4, 8).step_s
    assert uniform("InterleavedZeroBubble", 4, 8).step_s < one_f_one_b
    assert uniform("ZBVZeroBubble", 4, 8, 2).step_s < one_f_one_b
    assert uniform("DualPipeV", 4, 8, 2).step_s < one_f_one_b


def test_all_zero_times_give_a_zero_step_and_zero_bubble():
    timeline = simulate([0.0] * 2, [0.0] * 2, schedule="1F1B", n_microbatches=2)
    assert (timeline.step_s, timeline.bubble_fraction) == (0.0, 0.0)


# --- communication ---------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_communication_lengthens_the_step(schedule):
    v = 2 if schedule == "Interleaved1F1B" else 1
    assert uniform(schedule, 4, 8, v, comm_s=0.25).step_s > uniform(schedule, 4, 8, v).step_s


def test_per_cut_communication_is_charged_on_its_cut_both_ways():
    # GPipe, 2 stages, 1 micro-batch: F0, comm, F1, B1, comm, B0.
    timeline = simulate([1.0, 1.0], [2.0, 2.0], schedule="GPipe", n_microbatches=1, comm_s=[0.5])
    assert timeline.step_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_the_turn_of_a_v_costs_no_communication():
    # ZBV on 2 ranks: stages 1 and 2 share rank 1, so cut 1 never leaves the device.
    no_comm = uniform("ZBVZeroBubble", 2, 4, 2)
    turn_only = uniform("ZBVZeroBubble", 2, 4, 2, comm_s=[0.0, 5.0, 0.0])
    assert turn_only.step_s == no_comm.step_s


# --- lazy sends (gloo) ------------------------------------------------------------------


def test_a_lazy_send_waits_for_the_senders_running_action_to_end():
    # GPipe, 2 stages, 3 micro-batches, F = (2, 3), B = (4, 6). Eagerly, stage 1 takes micro-batch 1
    # at t = 5, when it is free. But stage 0 sent it at t = 4 and was then busy with micro-batch 2
    # (4-6), and gloo moves a send posted before its receive only when the sender next calls in:
    # stage 1 starts it at 6, and the step ends one second later (33 -> 34).
    kw = dict(schedule="GPipe", n_microbatches=3)
    eager = simulate([2.0, 3.0], [4.0, 6.0], **kw)
    lazy = simulate([2.0, 3.0], [4.0, 6.0], lazy_sends=True, **kw)
    start = {(e.stage, e.kind, e.microbatch): e.start_s for e in lazy.events}
    assert [start[(1, "F", i)] for i in range(3)] == [2.0, 6.0, 9.0]
    assert (eager.step_s, lazy.step_s) == (33.0, 34.0)


def test_a_receive_posted_first_gets_its_data_at_once_even_with_lazy_sends():
    # GPipe, stage 1 faster forward and slower backward: it always waits for its next input,
    # and stage 0 for its next gradient, so every receive is posted before its send.
    kw = dict(schedule="GPipe", n_microbatches=4, comm_s=0.25)
    assert simulate([2.0, 1.0], [2.0, 4.0], lazy_sends=True, **kw).step_s == simulate(
        [2.0, 1.0], [2.0, 4.0], **kw).step_s == 2 + 3 * 2 + 0.25 + 1 + 4 * 4 + 0.25 + 2


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(COMBOS), st.lists(st.floats(0.1, 3.0), min_size=24, max_size=24), st.floats(0.0, 1.0))
def test_lazy_sends_never_shorten_a_step(combo, times, comm):
    schedule, p, m, v = combo
    n = p * v
    fwd, bwd = times[:n], [2 * t for t in times[n:2 * n]]
    kw = dict(schedule=schedule, n_microbatches=m, stages_per_rank=v, comm_s=comm)
    assert simulate(fwd, bwd, lazy_sends=True, **kw).step_s >= simulate(fwd, bwd, **kw).step_s - 1e-9


def test_lazy_sends_must_be_a_bool():
    with pytest.raises(TypeError, match="lazy_sends must be True or False, got 'yes'"):
        simulate([1.0], [2.0], n_microbatches=1, lazy_sends="yes")


# --- the order comes from torch --------------------------------------------------------


def test_v_schedules_place_stages_r_and_2p_minus_1_minus_r_on_rank_r():
    assert stage_ranks("ZBVZeroBubble", 3) == [0, 1, 2, 2, 1, 0]


def test_looped_schedules_place_stage_s_on_rank_s_mod_p():
    assert stage_ranks("Interleaved1F1B", 3, 2) == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("schedule,p,m,v", [c for c in COMBOS if c[0] != "1F1B"])
def test_action_order_is_torchs_pipeline_order_without_idle_and_comm_actions(schedule, p, m, v):
    raw = schedules_module._torch_pipeline_order(schedule_class(schedule), p, m, v)
    assert action_order(schedule, n_ranks=p, n_microbatches=m, stages_per_rank=v) == raw
    assert uniform(schedule, p, m, v).order_source.startswith("torch.distributed.pipelining")


@pytest.mark.parametrize("p,m", [(2, 2), (3, 5), (4, 8)])
def test_1f1b_order_matches_torch_on_every_rank_where_torchs_order_is_complete(p, m):
    # torch's Schedule1F1B.pipeline_order skips F0 on the last rank (its executor,
    # _step_microbatches, does not); autopipe uses the executor's order, which must agree
    # with torch's IR everywhere else.
    raw = schedules_module._torch_pipeline_order(schedule_class("1F1B"), p, m, 1)
    ours = action_order("1F1B", n_ranks=p, n_microbatches=m)
    complete = [r for r in range(p) if sorted(raw[r]) == sorted(ours[r])]
    assert complete == list(range(p - 1)) or complete == list(range(p))
    for rank in complete:
        assert raw[rank] == ours[rank]


def test_1f1b_rank_runs_warmup_forwards_then_alternates_backward_and_forward():
    order = action_order("1F1B", n_ranks=3, n_microbatches=5)
    assert [str(a) for a in order[1]] == ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2",
                                          "1F4", "1B3", "1B4"]


@pytest.mark.parametrize("schedule,p,m,v", COMBOS)
def test_every_action_of_every_rank_runs_exactly_once(schedule, p, m, v):
    timeline = uniform(schedule, p, m, v)
    ran = sorted((e.rank, e.stage, e.kind, e.microbatch) for e in timeline.events)
    expected = sorted((r, a.stage, a.kind, a.microbatch)
                      for r, actions in enumerate(action_order(schedule, n_ranks=p,
                                                               n_microbatches=m,
                                                               stages_per_rank=v))
                      for a in actions)
    assert ran == expected
    for s, i in itertools.product(range(p * v), range(m)):
        kinds = sorted(k for (_, stage, k, mb) in ran if (stage, mb) == (s, i))
        assert kinds in (["B", "F"], ["F", "I", "W"])


@pytest.mark.parametrize("schedule,p,m,v", COMBOS)
def test_events_respect_data_dependencies(schedule, p, m, v):
    assert_dependencies_hold(uniform(schedule, p, m, v, comm_s=0.1), comm_s=0.1)


@pytest.mark.parametrize("schedule,p,m,v", COMBOS)
def test_each_rank_runs_its_actions_one_at_a_time_in_torchs_order(schedule, p, m, v):
    timeline = uniform(schedule, p, m, v)
    order = action_order(schedule, n_ranks=p, n_microbatches=m, stages_per_rank=v)
    for rank in range(p):
        events = timeline.per_rank(rank)
        assert [Action(e.stage, e.kind, e.microbatch) for e in events] == order[rank]
        for before, after in zip(events, events[1:]):
            assert after.start_s >= before.end_s - 1e-9


def test_an_order_that_waits_on_itself_is_reported_as_a_deadlock():
    # Rank 0 wants stage 0's backward before its forward; rank 1 waits for that forward.
    order = [[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]]
    message = r"deadlocks: rank 0 waits at 0B0, rank 1 waits at 1F0"
    with pytest.raises(ValueError, match=message):
        schedules_module._check_no_deadlock(order, 2, "custom")
    with pytest.raises(ValueError, match=message):
        simulator_module._place_in_time(order, [0, 1], [1.0] * 2, [1.0] * 2, [0.5] * 2, [0.0], [0.0] * 2,
                                        schedule="custom")


@pytest.mark.parametrize("schedule,p,m,v", COMBOS)
def test_every_action_starts_once_the_results_action_inputs_names_are_ready(schedule, p, m, v):
    # action_inputs is the dependency rule the deadlock check uses; the placement must obey it.
    timeline = uniform(schedule, p, m, v, comm_s=0.1)
    end = {(e.stage, "F" if e.kind == "F" else "B", e.microbatch): e.end_s
           for e in timeline.events if e.kind != "W"}
    for e in timeline.events:
        for kind, src in action_inputs(Action(e.stage, e.kind, e.microbatch), timeline.n_stages):
            assert e.start_s >= end[(src, kind, e.microbatch)] - 1e-9, e


def test_the_action_order_is_read_once_per_schedule_and_counts():
    first, source = action_order_and_source("Interleaved1F1B", 2, 4, 2)
    assert action_order_and_source("Interleaved1F1B", 2, 4, 2)[0] is first
    assert source.endswith("ScheduleInterleaved1F1B.pipeline_order")


def test_an_order_missing_an_action_is_reported():
    order = [[Action(0, "F", 0), Action(0, "I", 0)]]
    problems = schedules_module._order_problems(order, [0], 1)
    assert problems == ["stage 0 micro-batch 0 needs one B or one I and one W"]


# --- zero-bubble backward split --------------------------------------------------------


def test_input_grad_and_weight_grad_take_bwd_minus_wgrad_and_wgrad():
    timeline = simulate([1.0] * 2, [3.0] * 2, schedule="InterleavedZeroBubble",
                        n_microbatches=2, wgrad_s=[1.0, 0.5])
    durations = {(e.stage, e.kind): e.duration_s for e in timeline.events}
    assert durations[(0, "I")] == 2.0 and durations[(0, "W")] == 1.0
    assert durations[(1, "I")] == 2.5 and durations[(1, "W")] == 0.5


def test_weight_grad_defaults_to_half_of_the_backward():
    timeline = simulate([1.0] * 2, [3.0] * 2, schedule="ZBVZeroBubble", n_microbatches=2,
                        stages_per_rank=2)
    assert {e.duration_s for e in timeline.events if e.kind in "IW"} == {1.5}


# --- heterogeneous stages: bounds and the exact 1F1B relation --------------------------

stage_time = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])


@st.composite
def pipelines(draw, min_ranks: int = 1, max_ranks: int = 4):
    p = draw(st.integers(min_ranks, max_ranks))
    m = draw(st.integers(p, p + 5))
    fwd = draw(st.lists(stage_time, min_size=p, max_size=p))
    bwd = draw(st.lists(stage_time, min_size=p, max_size=p))
    comm = draw(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=p - 1, max_size=p - 1))
    return p, m, fwd, bwd, comm


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_heterogeneous_step_covers_m_heaviest_stages_and_one_trip_through_all(schedule):
    fwd, bwd, m = [1.0, 3.0, 0.5], [2.0, 4.0, 1.0], 4
    step = simulate(fwd, bwd, schedule=schedule, n_microbatches=m).step_s
    assert step >= m * max(f + b for f, b in zip(fwd, bwd))
    assert step >= sum(fwd) + sum(bwd)


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_gpipe_step_is_two_flow_shops_for_any_stage_times(pipeline):
    p, m, fwd, bwd, comm = pipeline
    step = simulate(fwd, bwd, schedule="GPipe", n_microbatches=m, comm_s=comm).step_s
    expected = (sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd) + 2 * sum(comm))
    assert step == pytest.approx(expected)


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_1f1b_closed_form_is_exact_when_the_last_stage_is_slowest_both_ways(pipeline):
    # Zero communication, and the last stage has the largest forward AND the largest
    # backward: it then never waits, and everything else hides under its m (F + B).
    p, m, fwd, bwd, _ = pipeline
    fwd[-1], bwd[-1] = max(fwd), max(bwd)
    step = simulate(fwd, bwd, schedule="1F1B", n_microbatches=m).step_s
    per_stage = [f + b for f, b in zip(fwd, bwd)]
    assert step == pytest.approx(sum(per_stage) + (m - 1) * max(per_stage))


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_1f1b_step_lies_between_the_proved_bounds_for_any_stage_times(pipeline):
    p, m, fwd, bwd, comm = pipeline
    step = simulate(fwd, bwd, schedule="1F1B", n_microbatches=m, comm_s=comm).step_s
    # Rank s cannot start before its inputs' first trip, works m (F_s + B_s), and its last
    # gradient still has to travel back to stage 0.
    lower = max(sum(fwd[:s]) + sum(bwd[:s]) + 2 * sum(comm[:s]) + m * (fwd[s] + bwd[s])
                for s in range(p))
    assert step >= lower - 1e-9
    if not any(comm):
        # Fixed order => step is a longest path, monotone in every time: pad to uniform.
        assert step <= (m + p - 1) * (max(fwd) + max(bwd)) + 1e-9


@pytest.mark.parametrize(
    "fwd,bwd,comm,m,step,closed_form",
    [
        # First stage is the bottleneck: its forwards hide in the warm-up -> shorter.
        ([1.0, 1.0], [2.0, 1.0], [0.0], 2, 7.0, 8.0),
        # A middle bottleneck waits for a light neighbour's round trip -> longer.
        ([0.5, 3.0, 1.0], [4.0, 2.0, 0.5], [0.0, 0.0], 3, 21.5, 21.0),
        # The last stage ties the largest F + B without the largest B -> longer.
        ([3.0, 0.5, 0.5, 1.5], [0.5, 3.0, 0.5, 2.0], [0.0] * 3, 5, 26.0, 25.5),
        # Slowest last stage, but the forward it needs arrives late over the cut -> longer.
        ([3.0, 4.0], [4.0, 4.0], [1.0], 3, 34.0, 33.0),
    ],
)
def test_1f1b_closed_form_is_not_exact_for_every_heterogeneous_split(fwd, bwd, comm, m, step,
                                                                      closed_form):
    per_stage = [f + b for f, b in zip(fwd, bwd)]
    assert sum(per_stage) + (m - 1) * max(per_stage) + 2 * sum(comm) == closed_form
    assert simulate(fwd, bwd, schedule="1F1B", n_microbatches=m, comm_s=comm).step_s == step


# --- the Timeline ----------------------------------------------------------------------


def test_bubble_fraction_is_idle_share_of_ranks_times_step():
    timeline = simulate([1.0, 2.0], [2.0, 1.0], schedule="1F1B", n_microbatches=3)
    expected = 1 - sum(timeline.busy_s) / (timeline.n_ranks * timeline.step_s)
    assert timeline.bubble_fraction == pytest.approx(expected)
    assert timeline.busy_s == [9.0, 9.0]


def test_per_rank_rejects_a_rank_outside_the_pipeline():
    with pytest.raises(ValueError, match=r"rank=2 must be an integer >= 0 and <= 1"):
        uniform("1F1B", 2, 2).per_rank(2)


def test_peak_activation_bytes_weights_each_stage_by_its_own_size():
    # Interleaved, 2 ranks x 2 stages: stage 2 (rank 0) is 10x heavier than stage 0.
    timeline = uniform("Interleaved1F1B", 2, 4, 2)
    weighted = timeline.peak_activation_bytes([1, 1, 10, 1])
    assert weighted[1] == timeline.peak_inflight[1]
    assert timeline.peak_inflight[0] < weighted[0] <= 10 * timeline.peak_inflight[0]


def test_multi_stage_schedules_keep_every_sent_tensor_until_the_step_ends():
    # torch's _PipelineScheduleRuntime waits on a step's sends only at its end. Interleaved,
    # 2 ranks x 2 stages, 4 micro-batches, 1 byte per send: rank 0 sends forward from stages 0
    # and 2 and back from stage 2, 12 sends kept by the end; so does rank 1.
    timeline = uniform("Interleaved1F1B", 2, 4, 2)
    assert timeline.peak_activation_bytes([0] * 4, send_bytes=([1, 1, 1, 0], [0, 1, 1, 1])) == [12, 12]


def test_gpipe_keeps_its_backward_sends_to_the_end_and_1f1b_keeps_one_send():
    # GPipe, 2 ranks, 4 micro-batches, 1 byte per send: rank 1 sends 4 gradients back, all
    # kept to the end; rank 0's forward sends are outputs its stage keeps for its backward anyway.
    gpipe = uniform("GPipe", 2, 4)
    assert gpipe.peak_activation_bytes([0, 0], send_bytes=([1, 0], [0, 1])) == [0, 4]
    assert gpipe.peak_activation_bytes([10, 10], send_bytes=([1, 0], [0, 1])) == [40, 40]
    one_f_one_b = uniform("1F1B", 2, 4)
    assert one_f_one_b.peak_activation_bytes([0, 0], send_bytes=([1, 0], [0, 1])) == [1, 1]


def test_the_turn_of_a_v_keeps_what_it_hands_over_until_the_step_ends():
    # ZBV on 2 ranks: stages 1 and 2 share rank 1, so the cut between them is handed over, not
    # sent. torch keeps each micro-batch's tensor in the receiving stage's slot until the next
    # step refills it: 4 outputs and 4 gradients of 5 bytes on rank 1 by the end, none on rank 0.
    timeline = uniform("ZBVZeroBubble", 2, 4, 2)
    turn_only = timeline.peak_activation_bytes([0] * 4, send_bytes=([0, 5, 0, 0], [0, 0, 5, 0]))
    assert turn_only == [0, 40]
    # The output joins the kept tensors only when stage 1's saved tensors, charged with one
    # output per micro-batch in flight under a split backward, go with its weight-grad: each
    # micro-batch's output counts once, 4 x 5 bytes at most.
    both = timeline.peak_activation_bytes([0, 5, 0, 0], send_bytes=([0, 5, 0, 0], [0, 0, 0, 0]))
    assert both == [0, 20]


def test_send_bytes_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="send_bytes must be"):
        uniform("1F1B", 2, 2).peak_activation_bytes([1, 1], send_bytes=([1], [0, 1]))


def test_chrome_trace_has_one_complete_event_per_action_on_its_rank_track_in_us():
    timeline = uniform("1F1B", 2, 2)
    trace = json.loads(json.dumps(timeline.to_chrome_trace()))  # must be JSON-serialisable
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.events)
    assert {e["tid"] for e in complete} == {0, 1}
    first = min(complete, key=lambda e: (e["tid"], e["ts"]))
    assert (first["name"], first["ts"], first["dur"]) == ("F0 stage 0", 0.0, F_S * 1e6)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["rank 0", "rank 1"]


def test_text_chart_draws_each_rank_with_labels_and_idle_dots():
    chart = simulate([1.0, 1.0], [1.0, 1.0], schedule="GPipe", n_microbatches=2).to_text()
    assert chart.splitlines() == ["rank 0 |F0F1....B0B1|", "rank 1 |..F0F1B0B1..|"]


def test_text_chart_names_the_stage_when_a_rank_holds_several():
    assert uniform("Interleaved1F1B", 2, 2, 2).to_text().startswith("rank 0 |0F0")


# --- validation ------------------------------------------------------------------------


def test_negative_time_is_rejected_naming_the_stage():
    with pytest.raises(ValueError, match=r"bwd_s\[1\] must be a finite time >= 0.*-1.0"):
        simulate([1.0, 1.0], [1.0, -1.0], n_microbatches=2)


def test_forward_and_backward_lengths_must_match():
    with pytest.raises(ValueError, match=r"bwd_s must have one value per fwd_s \(2\), got 3"):
        simulate([1.0, 1.0], [1.0, 1.0, 1.0], n_microbatches=2)


def test_comm_sequence_needs_one_value_per_cut():
    with pytest.raises(ValueError, match=r"comm_s must have one value per the cuts"):
        simulate([1.0, 1.0], [1.0, 1.0], n_microbatches=2, comm_s=[0.1, 0.1])


def test_negative_scalar_comm_is_rejected():
    with pytest.raises(ValueError, match=r"comm_s must be a finite time >= 0 seconds, got -0.5"):
        simulate([1.0, 1.0], [1.0, 1.0], n_microbatches=2, comm_s=-0.5)


@pytest.mark.parametrize("bad", [0, -3])
def test_fewer_than_one_microbatch_is_rejected(bad):
    with pytest.raises(ValueError, match=rf"n_microbatches={bad} must be an integer >= 1"):
        simulate([1.0], [1.0], n_microbatches=bad)


def test_non_integer_microbatch_count_is_a_type_error():
    with pytest.raises(TypeError, match=r"n_microbatches=2.0 must be an integer >= 1"):
        simulate([1.0], [1.0], n_microbatches=2.0)


def test_weight_grad_longer_than_the_backward_is_rejected():
    with pytest.raises(ValueError, match=r"wgrad_s\[0\] = 3.0 exceeds bwd_s\[0\] = 2.0"):
        simulate([1.0], [2.0], schedule="InterleavedZeroBubble", n_microbatches=1, stages_per_rank=1,
                 wgrad_s=[3.0])


def test_stage_count_must_be_a_multiple_of_stages_per_rank():
    with pytest.raises(ValueError, match=r"len\(fwd_s\) = 3 stages must be a multiple of"):
        simulate([1.0] * 3, [1.0] * 3, schedule="Interleaved1F1B", n_microbatches=2,
                 stages_per_rank=2)


def test_validate_schedule_returns_the_canonical_name():
    assert validate_schedule("scheduleinterleaved1f1b", 4, 8, 2) == "Interleaved1F1B"


@pytest.mark.parametrize(
    "args,message",
    [
        (("1F1B", 4, 3), r"n_microbatches >= n_ranks \(4\), got n_microbatches=3"),
        (("GPipe", 2, 4, 2), r"exactly 1 stage per rank, got stages_per_rank=2"),
        (("ZBVZeroBubble", 2, 4, 1), r"exactly 2 stages per rank in a V, got stages_per_rank=1"),
        (("DualPipeV", 2, 3), r"n_microbatches >= number of stages .* = 4\), got n_microbatches=3"),
        (("Interleaved1F1B", 4, 9, 2), r"multiple of max\(1, n_microbatches // n_ranks\) = 2"),
        (("InterleavedZeroBubble", 2, 5), r"multiple of .* = 2, got n_microbatches=5"),
        (("LoopedBFS", 0, 4), r"n_ranks=0 must be an integer >= 1"),
    ],
)
def test_validate_schedule_rejects_combinations_torch_cannot_run(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


@pytest.mark.parametrize("module", [schedules_module, simulator_module, timeline_module])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_examples_in_docs_simulator_md_print_what_they_show():
    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "simulator.md"
    # Drop the Markdown code fences so doctest sees each example's output end.
    text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("```"))
    test = doctest.DocTestParser().get_doctest(text, {}, path.name, str(path), 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0


# --------------------------------------------------------------------------- per-action overhead
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_per_action_overhead_adds_to_every_forward_and_backward(schedule):
    # Uniform stages: (m + p - 1)(F + B) becomes (m + p - 1)(F + o + B + o).
    p, m, f, b, o = 4, 8, 1.0, 2.0, 0.25
    t = simulate([f] * p, [b] * p, schedule=schedule, n_microbatches=m, action_overhead_s=o)
    assert t.step_s == pytest.approx((m + p - 1) * (f + b + 2 * o))


def test_zero_bubble_schedules_pay_the_overhead_on_input_and_weight_grads_separately():
    # ZBV runs F, I and W per micro-batch and stage: three actions, three overheads.
    kw = dict(schedule="ZBVZeroBubble", n_microbatches=4)
    free = simulate([1.0] * 4, [2.0] * 4, **kw)
    paid = simulate([1.0] * 4, [2.0] * 4, action_overhead_s=0.1, **kw)
    per_rank = [len(paid.per_rank(r)) for r in range(paid.n_ranks)]
    assert per_rank == [4 * 2 * 3] * 2
    assert paid.busy_s == pytest.approx([b + 0.1 * n for b, n in zip(free.busy_s, per_rank)])


def test_per_stage_overhead_charges_each_stage_its_own():
    t = simulate([1.0, 1.0], [1.0, 1.0], schedule="GPipe", n_microbatches=1, action_overhead_s=[0.0, 0.5])
    assert t.step_s == pytest.approx(1.0 + 1.5 + 1.5 + 1.0)


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), [0.0], [0.0, -1.0]])
def test_a_bad_action_overhead_is_refused(bad):
    with pytest.raises(ValueError, match="action_overhead_s"):
        simulate([1.0, 1.0], [1.0, 1.0], schedule="GPipe", n_microbatches=2, action_overhead_s=bad)


def test_split_backward_schedules_hold_activations_until_the_weight_grad():
    # InterleavedZeroBubble splits the backward into I and W; W still needs the layers' saved
    # inputs, so a micro-batch's activations are held until its W (measured with LiveBytes on
    # the MLP under ZBV). Released at I instead, rank r would peak at 8 - r micro-batches.
    timeline = simulate([0.5] * 8, [1.0] * 8, schedule="InterleavedZeroBubble", n_microbatches=8,
                        stages_per_rank=2)

    def walk(release: str) -> list[int]:
        now, peak = [0] * 4, [0] * 4
        for e in sorted(timeline.events, key=lambda e: (e.rank, e.start_s)):
            now[e.rank] += 1 if e.kind == "F" else -1 if e.kind == release else 0
            peak[e.rank] = max(peak[e.rank], now[e.rank])
        return peak

    assert walk("I") == [8, 7, 6, 5]
    assert timeline.peak_inflight == walk("W") == [8, 8, 8, 8]
    assert uniform("1F1B", 2, 4).peak_inflight == [2, 1]  # no W: B frees them, as before
