"""Schedule-aware planning: simulated objective, schedule='auto', heterogeneous devices, calibration."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

import autopipe
from autopipe.planning.profile import profile_segments
from _planning import partition_with


@pytest.fixture(scope="module")
def costs(small_traced):
    """Segment costs from counted FLOPs at a fixed device speed: every plan below is the same
    on every machine, however busy (a measured profile would move the splits)."""
    return profile_segments(small_traced, cost="flops", device_flops=1e9, progress=False)


def test_step_objective_is_never_worse_than_the_bottleneck_split(small_transformer, costs):
    model, args = small_transformer
    kw = dict(example_args=args, cost=costs, n_microbatches=4)
    by_step = partition_with(model, 2, objective="step", **kw)
    by_bottleneck = partition_with(model, 2, objective="bottleneck", **kw)
    assert by_step.predicted_step_s <= by_bottleneck.predicted_step_s * (1 + 1e-12)
    assert by_step.objective == "step" and by_bottleneck.objective == "bottleneck"
    assert 0.0 <= by_step.search.step_gap < 1.0
    assert by_step.search.step_lower_bound_s <= by_step.predicted_step_s


def test_auto_schedule_picks_the_fastest_alternative_that_fits(small_transformer, costs):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, schedule="auto", n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=costs))
    alts = plan.alternatives
    assert {a.schedule for a in alts} >= {"GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"}
    fitting = [a for a in alts if a.fits]
    assert plan.predicted_step_s == min(a.predicted_step_s for a in fitting)
    assert plan.num_stages == 2 * plan.stages_per_rank
    assert "schedules considered" in plan.report()


def test_auto_schedule_respects_memory(small_transformer, costs):
    model, args = small_transformer
    free = autopipe.partition(model, 2, example_args=args, schedule="auto", n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=costs))
    peaks = sorted({a.peak_bytes for a in free.alternatives if a.peak_bytes})
    limit = peaks[len(peaks) // 2]  # some options fit, some do not
    plan = autopipe.partition(model, 2, example_args=args, schedule="auto", n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=costs, memory=limit))
    assert max(plan.rank_peak_bytes) <= limit
    assert any(not a.fits for a in plan.alternatives)


def test_faster_device_gets_more_work(small_transformer, costs):
    model, args = small_transformer
    even = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, objective="bottleneck"))
    fast_first = autopipe.partition(model, 2, example_args=args,
                                    planner=autopipe.PlannerOptions(cost=costs, objective="bottleneck", devices=[autopipe.Device(speed=4.0), autopipe.Device(speed=1.0)]))
    assert fast_first.stages[0].last_segment >= even.stages[0].last_segment
    compute = lambda s: (s.fwd_s + s.bwd_s)  # noqa: E731  (already divided by speed)
    raw = [compute(s) * d for s, d in zip(fast_first.stages, (4.0, 1.0))]
    raw_even = [compute(s) for s in even.stages]
    assert raw[0] / sum(raw) >= raw_even[0] / sum(raw_even)


def test_each_device_memory_is_respected(small_transformer, costs):
    model, args = small_transformer
    free = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, objective="bottleneck"))
    small = int(min(s.peak_bytes for s in free.stages) * 1.05)
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, objective="bottleneck", devices=[autopipe.Device(memory=small), autopipe.Device(memory="1GiB")]))
    assert plan.stages[0].peak_bytes <= small


@pytest.mark.parametrize("kwargs, message", [
    (dict(speed=0), "speed=0 must be a finite number > 0"),
    (dict(speed=-1.0), "speed=-1.0 must be"),
    (dict(memory="-3GiB"), "Device memory='-3GiB' is not a memory size"),
    (dict(bandwidth=0), "bandwidth=0 must be > 0"),
    (dict(action_overhead_s=-1e-3), "action_overhead_s=-0.001 must be a finite time >= 0"),
])
def test_bad_device_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        autopipe.Device(**kwargs)


def test_device_list_must_match_n_gpus(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="devices has 3 entries but n_gpus=2"):
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(devices=[autopipe.Device()] * 3))


def test_interleaved_needs_a_valid_micro_batch_count(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="1F1B' needs n_microbatches >= n_ranks"):
        autopipe.partition(model, 4, example_args=args, schedule="1F1B", n_microbatches=2)
    with pytest.raises(ValueError, match="multiple of"):
        autopipe.partition(model, 2, example_args=args, schedule="Interleaved1F1B", n_microbatches=5,
                           planner=autopipe.PlannerOptions(stages_per_rank=2))


def test_unknown_objective(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="objective='fast' is not known"):
        autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(objective="fast"))


def test_calibrated_costs_feed_a_new_plan(small_transformer, costs):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, objective="bottleneck"))
    # Pretend stage 0 ran 3x slower than profiled: the re-plan must move work off it.
    times = [3 * plan.stages[0].time_s, plan.stages[1].time_s]
    cal = plan.calibrate(times)
    replanned = autopipe.partition(model, 2, example_args=args,
                                   planner=autopipe.PlannerOptions(cost=cal.segment_costs(), objective="bottleneck"))
    assert replanned.stages[0].last_segment <= plan.stages[0].last_segment


def test_auto_microbatches_tries_divisors_of_the_global_batch(small_transformer):
    from autopipe.planning.scaling import profile_scaling

    model, args = small_transformer  # example micro-batch of 2 samples
    scaled = profile_scaling(model, args, sizes=[1, 2, 4], cost="flops", progress=False)
    plan = autopipe.partition(model, 2, example_args=args, n_microbatches="auto",
                              planner=autopipe.PlannerOptions(global_batch=8, cost=scaled))
    tried = {a.n_microbatches for a in plan.alternatives}
    assert tried == {2, 4, 8}  # 1F1B needs at least 2 micro-batches on 2 ranks
    assert plan.n_microbatches in tried
    assert plan.microbatch_size * plan.n_microbatches == 8 and plan.global_batch == 8
    best = min(a.predicted_step_s for a in plan.alternatives if a.fits)
    assert plan.predicted_step_s == best


def test_auto_microbatches_needs_a_global_batch(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="needs global_batch="):
        autopipe.partition(model, 2, example_args=args, n_microbatches="auto")


def test_micro_batch_count_must_divide_the_global_batch(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match=r"n_microbatches=3 does not divide global_batch=8; use one of \[1, 2, 4, 8\]"):
        autopipe.partition(model, 2, example_args=args, n_microbatches=3,
                           planner=autopipe.PlannerOptions(global_batch=8))


# --------------------------------------------------------------------------- per-action overhead
def test_the_runtime_overhead_per_action_is_charged_and_recorded(small_transformer, costs):
    model, args = small_transformer
    kw = dict(example_args=args, cost=costs, n_microbatches=4, schedule="1F1B")
    free = partition_with(model, 2, devices=autopipe.Device(action_overhead_s=0.0), **kw)
    paid = partition_with(model, 2, devices=autopipe.Device(action_overhead_s=2e-3), **kw)
    assert free.action_overhead_s() == [0.0, 0.0] and paid.action_overhead_s() == [2e-3, 2e-3]
    # 1F1B, 2 ranks, 4 micro-batches: 8 actions per rank, all on the critical path's rank or more.
    assert paid.predicted_step_s >= free.predicted_step_s + 8 * 2e-3 - 1e-12
    assert paid.search.step_lower_bound_s >= free.search.step_lower_bound_s + 8 * 2e-3 - 1e-12
    assert paid.search.step_lower_bound_s <= paid.predicted_step_s
    from autopipe.reporting.timeline import plan_timeline
    assert plan_timeline(paid).step_s + paid.step_tail_s() == pytest.approx(paid.predicted_step_s)


def test_cpu_plans_charge_the_measured_default_overhead(small_transformer, costs):
    from autopipe.machine.device import default_action_overhead_s

    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu")))
    assert plan.action_overhead_s() == [default_action_overhead_s("cpu")] * 2
    assert default_action_overhead_s("cpu") > 0


def test_cpu_plans_model_gloos_lazy_sends_and_report_them(small_transformer, costs):
    from autopipe.machine.device import sends_are_lazy
    from autopipe.reporting.timeline import plan_timeline

    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, schedule="1F1B", n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu")))
    assert sends_are_lazy("cpu") and not sends_are_lazy("cuda")
    assert plan.machine.lazy_sends is True and plan.simulation_options()["lazy_sends"] is True
    # The prediction, the report's timeline and calibrate all simulate the same way.
    assert plan_timeline(plan).step_s + plan.step_tail_s() == pytest.approx(plan.predicted_step_s)
    assert plan.simulated_step_s() == pytest.approx(plan.predicted_step_s)
    eager = autopipe.simulate([s.fwd_s for s in plan.stages], [s.bwd_s for s in plan.stages],
                              comm_s=plan.cut_comm_s(), **{**plan.simulation_options(), "lazy_sends": False})
    assert plan.predicted_step_s >= eager.step_s - 1e-12
    plan.machine = replace(plan.machine, lazy_sends=False)  # a plan that records eager sends simulates them
    assert plan.simulation_options()["lazy_sends"] is False


def test_each_device_carries_its_own_action_overhead(small_transformer, costs):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(cost=costs, devices=[
        autopipe.Device(action_overhead_s=1e-3), autopipe.Device(action_overhead_s=4e-3)]))
    assert plan.action_overhead_s() == [1e-3, 4e-3]


@pytest.mark.parametrize("value", [-1e-3, float("inf"), "1ms", True])
def test_a_bad_action_overhead_is_named_before_any_work(small_transformer, value):
    model, args = small_transformer
    with pytest.raises(ValueError, match="action_overhead_s"):
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(devices=autopipe.Device(action_overhead_s=value)))


# --------------------------------------------------------------------------- the loss
def _lm_loss(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def test_the_loss_is_charged_to_the_last_stage_in_time_and_memory(small_transformer, costs):
    import torch

    model, args = small_transformer
    target = torch.randint(0, 500, args[0].shape)
    kw = dict(example_args=args, cost=costs, n_microbatches=4, schedule="GPipe")
    without = partition_with(model, 2, loss_fn=False, **kw)  # no loss costed at all
    charged = partition_with(model, 2, loss_fn=_lm_loss, example_target=target, **kw)
    loss = asdict(charged.loss)
    # log-softmax over the 500-word vocabulary for 2 x 8 tokens, float32, at least once
    assert loss["act_bytes"] >= 2 * 8 * 500 * 4 and loss["fwd_s"] > 0 and loss["bwd_s"] > 0
    assert loss["batch"] == 2
    if charged.split_points == without.split_points:
        last = charged.stages[-1]
        assert last.act_bytes == without.stages[-1].act_bytes + loss["act_bytes"]
        assert last.fwd_s == pytest.approx(without.stages[-1].fwd_s + loss["fwd_s"])
    assert sum(s.act_bytes for s in charged.stages) == sum(s.act_bytes for s in without.stages) + loss["act_bytes"]


def test_a_loss_without_its_target_is_refused_before_any_work(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="give loss_fn and example_target together"):
        autopipe.partition(model, 2, example_args=args, loss_fn=_lm_loss)
    with pytest.raises(TypeError, match="loss_fn=3 must be callable"):
        autopipe.partition(model, 2, example_args=args, loss_fn=3, example_target=0)


def test_profile_loss_leaves_the_model_unchanged(small_transformer):
    import torch

    from autopipe.planning.profile import profile_loss

    model, args = small_transformer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cost = profile_loss(model, args, None, _lm_loss, torch.randint(0, 500, args[0].shape), device="cpu",
                        warmup=0, repeats=1)
    assert cost.act_bytes > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_last_stage_holds_the_outputs_only_where_a_training_step_keeps_them(small_traced, costs):
    # A training step asks torch for no outputs (torch 2.10 and later): the last stage keeps
    # none. An older torch keeps each micro-batch's output to return them merged.
    from autopipe.planning.costgraph import build_cost_graph
    from autopipe.planning.problem import build_problem
    from autopipe.planning.schedules import training_merges_outputs

    graph = build_cost_graph(small_traced, list(costs))
    kw = dict(num_stages=2, stage_devices=[autopipe.Device()] * 2, inflight=[1, 1], optimizer_factor=2.0,
              link_default=(1e9, 0.0))
    none = build_problem(graph, small_traced, n_microbatches=0, **kw)
    eight = build_problem(graph, small_traced, n_microbatches=8, **kw)
    assert costs[-1].out_bytes > 0
    kept = 8 * costs[-1].out_bytes if training_merges_outputs() else 0
    assert eight.static_bytes[-1] - none.static_bytes[-1] == kept
    assert list(eight.static_bytes[:-1]) == list(none.static_bytes[:-1])


def test_each_stage_s_backward_carries_its_gradient_accumulation_spread_over_the_micro_batches(small_transformer,
                                                                                              costs):
    # All but the first micro-batch add their weight gradients into .grad: a stage's backward
    # per micro-batch is its segments' bwd_s + accum_s x (m - 1) / m, and the step grows with it.
    from dataclasses import replace

    model, args = small_transformer
    kw = dict(example_args=args, schedule="1F1B", n_microbatches=4)
    none = [replace(c, accum_s=0.0) for c in costs]
    some = [replace(c, accum_s=0.25 * c.bwd_s) for c in costs]
    base = partition_with(model, 2, cost=none, **kw)
    plan = partition_with(model, 2, cost=some, **kw)
    for st in plan.stages:
        segs = some[st.first_segment: st.last_segment + 1]
        assert st.bwd_s == pytest.approx(sum(c.bwd_s + c.accum_s * 3 / 4 for c in segs))
    assert plan.predicted_step_s > base.predicted_step_s
    # The plan keeps the raw per-segment figures, so it can be re-made for another m.
    assert [c.accum_s for c in plan.segment_costs()] == pytest.approx([c.accum_s for c in some])
    one = partition_with(model, 2, cost=some, **{**kw, "n_microbatches": 1, "schedule": "GPipe"})
    for st in one.stages:  # a single micro-batch accumulates nothing
        assert st.bwd_s == pytest.approx(sum(c.bwd_s for c in some[st.first_segment: st.last_segment + 1]))


def test_calibration_scales_the_gradient_accumulation_with_the_rest_of_the_backward(small_transformer, costs):
    # A stage's backward includes its segments' accumulation; calibrated segment costs must
    # add up to the calibrated stage again, or re-planning from them would drift.
    from dataclasses import replace

    model, args = small_transformer
    some = [replace(c, accum_s=0.25 * c.bwd_s) for c in costs]
    plan = autopipe.partition(model, 2, example_args=args, schedule="1F1B", n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=some))
    measured = {"fwd_s": [st.fwd_s * 1.5 for st in plan.stages], "bwd_s": [st.bwd_s * 2.0 for st in plan.stages]}
    new = plan.calibrate(measured)
    segs = new.segment_costs()
    for st, b in zip(new.stages, measured["bwd_s"]):
        part = segs[st.first_segment: st.last_segment + 1]
        assert sum(c.step_bwd_s(4) for c in part) == pytest.approx(b)
        old = some[st.first_segment: st.last_segment + 1]
        assert [c.accum_s for c in part] == pytest.approx([2.0 * c.accum_s for c in old])


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_the_planner_and_the_runtime_read_one_schedule_record(small_transformer, costs, schedule):
    # partition() and Pipeline left to their defaults hold the same stages per rank: the
    # registry's, which also names torch's class.
    from autopipe.planning.schedules import SCHEDULE_SPECS, schedule_class
    from autopipe.runtime.plan_setup import PlanRequest, settle_plan

    model, args = small_transformer
    spec = SCHEDULE_SPECS[schedule]
    assert schedule_class(schedule).__name__ == spec.torch_class
    plan = autopipe.partition(model, 2, example_args=args, schedule=schedule, n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost=costs))
    assert plan.stages_per_rank == spec.default_stages_per_rank
    # The runtime settles a hand split against its own default before any communication: one
    # split point short of the planner's stage count is refused, naming the same default.
    short = plan.split_points[:-1]
    request = PlanRequest.checked(model, split_points=short, schedule=schedule, n_microbatches=4)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=rf"2 ranks x stages_per_rank={plan.stages_per_rank} need {plan.num_stages}"):
        settle_plan(request, model, args, None, None, rank=0, world_size=2, device=cpu, comm_device=cpu)
