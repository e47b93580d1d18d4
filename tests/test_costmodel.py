"""The cost model: each formula on hand-computed numbers, and one answer wherever a plan's cost is asked."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest

import autopipe
from autopipe.planning import costmodel
from autopipe.planning.costmodel import StepTail
from autopipe.planning.partitioner import PartitionProblem, rank_work_lower_bound_s


def _seg(fwd: float, bwd: float, accum: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(fwd_s=fwd, bwd_s=bwd, accum_s=accum)


def test_the_cost_model_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import autopipe.planning.costmodel as c; print(c.cut_time_s(8, 4, 2.0, 1.0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "5.0"


def test_the_backward_in_a_step_spreads_the_accumulation_over_all_but_the_first_micro_batch():
    assert costmodel.step_backward_s(2.0, 0.8, 4) == pytest.approx(2.0 + 0.8 * 3 / 4)
    assert costmodel.step_backward_s(2.0, 0.8, 1) == 2.0  # one micro-batch: nothing to add into


def test_stage_times_sum_segments_between_the_cuts_and_divide_by_speed():
    segs = [_seg(1.0, 2.0, 0.4), _seg(3.0, 4.0), _seg(5.0, 6.0, 0.8)]
    fwd, bwd = costmodel.stage_times_s(segs, [1], n_microbatches=2, speed=[1.0, 2.0])
    assert fwd == pytest.approx([1.0, (3.0 + 5.0) / 2])
    assert bwd == pytest.approx([2.0 + 0.4 / 2, (4.0 + 6.0 + 0.8 / 2) / 2])
    with pytest.raises(ValueError, match="speed has 3 entries but cuts=\\[1\\] make 2 stages"):
        costmodel.stage_times_s(segs, [1], n_microbatches=2, speed=[1.0, 1.0, 1.0])


def test_a_cut_costs_its_larger_direction_over_the_bandwidth_plus_the_latency():
    assert costmodel.cut_time_s(4e6, 6e6, bandwidth=2e9, latency_s=1e-4) == pytest.approx(3e-3 + 1e-4)
    assert costmodel.cut_time_s(0, 0, bandwidth=2e9, latency_s=1e-4) == 0.0  # nothing crosses: no message
    assert costmodel.cut_times_s([2e9, 0], [0, 1e9], [1e9, 1e9], [0.5, 0.25]) == pytest.approx([2.5, 1.25])
    with pytest.raises(ValueError, match="one entry per cut"):
        costmodel.cut_times_s([1.0], [1.0, 2.0], [1.0], [0.0])


def test_the_step_tail_merges_broadcasts_and_all_reduces_tied_gradients():
    tail = costmodel.step_tail(n_microbatches=8, out_bytes=1e6, n_ranks=4, bandwidth=1e9, latency_s=1e-5,
                               copy_bandwidth=1e10, shared_bytes=[(4e6, 2), (1e6, 1)])
    assert tail.merge_outputs_s == pytest.approx(8 * 1e6 / 1e10)
    assert tail.loss_broadcast_s == 1e-5
    assert tail.start_agreement_s == 1e-5  # every rank agrees to start: one small all-reduce
    # Packed and unpacked (2 copies), ring all-reduce over 2 ranks: 2 (h-1)/h of the bytes, 2 (h-1) hops;
    # a tied weight held on one rank costs nothing.
    assert tail.shared_grads_s == pytest.approx(2 * 4e6 / 1e10 + 2 * 1 / 2 * 4e6 / 1e9 + 2 * 1e-5)
    assert tail.total_s == pytest.approx(tail.merge_outputs_s + tail.loss_broadcast_s + tail.start_agreement_s
                                         + tail.shared_grads_s)
    assert tail.any_split_s == pytest.approx(tail.merge_outputs_s + tail.loss_broadcast_s + tail.start_agreement_s)
    one_rank = costmodel.step_tail(n_microbatches=8, out_bytes=0, n_ranks=1, bandwidth=1e9, latency_s=1e-5,
                                   copy_bandwidth=1e10)
    assert one_rank == StepTail()


def test_the_predicted_step_is_the_simulated_schedule_plus_the_tail():
    # 1F1B, 2 stages of 1 + 2 s, 4 micro-batches, no communication: (m + p - 1) x 3 s.
    tail = StepTail(merge_outputs_s=0.25, loss_broadcast_s=0.5)
    step = costmodel.predicted_step_s([1.0, 1.0], [2.0, 2.0], [], schedule="1F1B", n_microbatches=4,
                                      stages_per_rank=1, tail=tail)
    assert step == pytest.approx(15.0 + 0.75)
    # One micro-batch through 2 stages: F0, send (1 s), F1, B1, send back (1 s), B0.
    one = costmodel.predicted_step_s([1.0, 1.0], [2.0, 2.0], [1.0], schedule="GPipe", n_microbatches=1,
                                     stages_per_rank=1)
    assert one == pytest.approx(1.0 + 1.0 + 1.0 + 2.0 + 1.0 + 2.0)


def test_memory_formulas():
    assert costmodel.state_bytes(100, 80, optimizer_factor=2.0) == 100 + 80 * 3
    assert costmodel.stage_peak_bytes(340, 50, inflight=3) == 490


def test_rank_peak_bytes_adds_static_bytes_to_the_simulated_peak_and_counts_the_merge():
    timeline = costmodel.simulate_step([1.0, 1.0], [2.0, 2.0], [], schedule="1F1B", n_microbatches=4,
                                       stages_per_rank=1)
    kw = dict(stage_static_bytes=[1000, 2000], stage_act_bytes=[100, 10], cut_fwd_bytes=[0], cut_bwd_bytes=[0],
              split_backward=False)
    # 1F1B holds 2 micro-batches on stage 0, 1 on stage 1.
    assert costmodel.rank_peak_bytes(timeline, **kw) == [1000 + 2 * 100, 2000 + 10]
    # The last rank concatenates the kept outputs at the step's end: at least static + merge bytes.
    assert costmodel.rank_peak_bytes(timeline, merge_bytes=500, **kw) == [1200, 2500]
    # Bytes counted twice on one rank come off its static bytes.
    assert costmodel.rank_peak_bytes(timeline, overcount=[300, 0], **kw) == [900, 2010]


def test_the_lower_bounds():
    assert costmodel.bottleneck_lower_bound_s([1.0, 1.0, 1.0, 5.0], [1.0, 1.0]) == 5.0
    assert costmodel.bottleneck_lower_bound_s([1.0, 1.0, 1.0, 1.0], [1.0, 1.0]) == 2.0
    problem = PartitionProblem.uniform(compute_s=[1.0, 1.0, 1.0, 1.0], num_stages=2)
    timeline = costmodel.simulate_step([1.0, 1.0], [1.0, 1.0], [], schedule="1F1B", n_microbatches=4,
                                       stages_per_rank=1)
    tail = StepTail(merge_outputs_s=0.5, loss_broadcast_s=0.25, shared_grads_s=100.0)
    # Each rank does at least half the work (2 s) per micro-batch; tied gradients are not in the bound.
    rank_work = rank_work_lower_bound_s(problem, 1, [1.0, 1.0])
    assert rank_work == pytest.approx(2.0) == rank_work_lower_bound_s(problem, 2, [1.0, 1.0])
    bound = costmodel.step_lower_bound_s(rank_work, 4.0, timeline, n_microbatches=4, action_overhead_s=[0.0, 0.0],
                                         tail=tail)
    assert bound == pytest.approx(4 * 2.0 + 0.75)
    # 8 actions per rank, 0.1 s each.
    paid = costmodel.step_lower_bound_s(rank_work, 4.0, timeline, n_microbatches=4, action_overhead_s=[0.1, 0.1],
                                        tail=StepTail())
    assert paid == pytest.approx(8.0 + 8 * 0.1)


# --------------------------------------------------------------------------- one answer everywhere


@pytest.fixture(scope="module")
def plan(small_transformer):
    model, args = small_transformer
    return autopipe.partition(model, 2, example_args=args, n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost="flops", profiling=autopipe.ProfileOptions(device="cpu", progress=False)))


def test_the_planner_the_plan_and_the_reports_predict_the_same_step(plan):
    from autopipe.reporting.data import report_data
    from autopipe.reporting.timeline import cut_comm_s, plan_timeline

    timeline = plan_timeline(plan)
    assert plan.simulated_step_s() == pytest.approx(plan.predicted_step_s, rel=1e-12)
    assert timeline.step_s + plan.step_tail.total_s == pytest.approx(plan.predicted_step_s, rel=1e-12)
    assert plan.split_step_s(plan.split_points) == pytest.approx(plan.predicted_step_s, rel=1e-12)
    data = report_data(plan, timeline=timeline)
    assert data["summary"]["predicted_step_s"] == plan.predicted_step_s
    assert data["summary"]["step_tail_s"] == asdict(plan.step_tail)
    # Every cut the report shows is the cost model's cut time on the plan's bytes and links.
    link = plan.machine.links[0]
    seg = plan.segments[plan.stages[1].first_segment]
    expected = costmodel.cut_time_s(seg.cut_fwd_bytes, seg.cut_bwd_bytes, link.bandwidth, link.latency_s)
    assert cut_comm_s(plan) == [expected] == [data["stages"][0]["cut_comm_s"]]


def test_a_baselines_prediction_is_its_splits_simulated_step(plan):
    from autopipe.reporting.timeline import split_timeline

    for baseline in (b for b in plan.baselines if not b.reason):  # those with a split
        assert plan.split_step_s(baseline.split_points) == pytest.approx(baseline.predicted_step_s, rel=1e-12)
        assert split_timeline(plan, baseline.split_points).step_s + plan.step_tail_s() == pytest.approx(
            baseline.predicted_step_s, rel=1e-12)


def test_a_plans_stage_times_are_the_cost_models_on_its_profile(plan):
    cuts = [st.first_segment for st in plan.stages[1:]]
    fwd, bwd = costmodel.stage_times_s(plan.segments, cuts, plan.n_microbatches)
    assert [st.fwd_s for st in plan.stages] == pytest.approx(fwd, rel=1e-12)
    assert [st.bwd_s for st in plan.stages] == pytest.approx(bwd, rel=1e-12)
