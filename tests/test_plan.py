"""Plan: JSON round trip, versioning (version-1 files convert), calibration, and the split_spec torch accepts."""

from __future__ import annotations

import copy
import json
import pathlib
from dataclasses import replace

import pytest
from torch.distributed.pipelining import SplitPoint

from autopipe.errors import PlanFileError
from autopipe.machine.device import default_link
from autopipe.planning.plan import PLAN_FORMAT_VERSION, BaselinePlan, Plan, StagePlan
from autopipe.planning.plan_file import READ_FORMAT_VERSIONS
from autopipe.planning.plan_records import Link, MachineModel

#: A plan written by autopipe: schedule="auto", n_microbatches=4 with global_batch=8, a loss,
#: memory limits, and calibrated once.
SAVED_FILE = pathlib.Path(__file__).parent / "data" / "plan_auto_calibrated.json"


def _plan() -> Plan:
    # No bytes cross the cut, so the step is compute alone (whatever link the device type assumes).
    stages = [
        StagePlan(index=i, fqns=[f"layers.{i}"], first_segment=i, last_segment=i, fwd_s=1e-3, bwd_s=2e-3,
                  comm_s=1e-4, param_bytes=10, act_bytes=20, peak_bytes=50, send_bytes=0, recv_bytes=0)
        for i in range(2)
    ]
    return Plan(num_stages=2, split_points=["layers.1"], stages=stages, schedule="1F1B", n_microbatches=4,
                bottleneck_s=3.1e-3, predicted_step_s=1.6e-2, lower_bound_s=3e-3,
                baselines=[BaselinePlan("equal_layers", "d", ["layers.1"], 3.1e-3, 1.6e-2, 50)])


def test_split_spec_is_what_torch_pipeline_takes():
    assert _plan().split_spec == {"layers.1": SplitPoint.BEGINNING}


def test_json_round_trip_keeps_everything(tmp_path):
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["format_version"] == PLAN_FORMAT_VERSION
    assert data["split_spec"] == {"layers.1": "BEGINNING"}


def test_newer_format_is_refused_naming_the_versions_read(tmp_path):
    data = _plan().to_dict()
    data["format_version"] = PLAN_FORMAT_VERSION + 1
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"format_version=3 \(written by a newer autopipe\) is not supported; "
                                            r"this autopipe reads versions \[2\]") as info:
        Plan.load(tmp_path / "p.json")
    assert info.value.field == "format_version"
    assert READ_FORMAT_VERSIONS == (2,) and PLAN_FORMAT_VERSION == 2


def test_a_plan_has_no_untyped_extras():
    assert not hasattr(_plan(), "extras")
    assert "extras" not in _plan().to_dict()


def test_a_version_2_file_has_no_extras():
    data = {**_plan().to_dict(), "extras": {}}
    with pytest.raises(PlanFileError, match=r"unknown field\(s\) \['extras'\]") as info:
        Plan.from_dict(data)
    assert info.value.field == "extras"


def test_not_json_is_a_clear_error(tmp_path):
    (tmp_path / "p.json").write_text("not json")
    with pytest.raises(ValueError, match="is not a plan JSON file"):
        Plan.load(tmp_path / "p.json")


def test_balance_is_lower_bound_over_bottleneck():
    assert _plan().balance == pytest.approx(3e-3 / 3.1e-3)


def test_calibrate_with_per_stage_times_rescales_stages_and_prediction():
    plan = _plan()
    cal = plan.calibrate([6e-3, 3e-3])  # stage 0 measured twice as slow, stage 1 as predicted
    assert cal.stages[0].fwd_s == pytest.approx(2e-3) and cal.stages[0].bwd_s == pytest.approx(4e-3)
    assert cal.stages[1].fwd_s == pytest.approx(1e-3)
    assert cal.bottleneck_s == pytest.approx(6e-3 + 1e-4)
    assert cal.predicted_step_s > plan.predicted_step_s
    assert plan.stages[0].fwd_s == 1e-3  # the original is untouched


def test_a_plan_predicts_its_step_at_another_sequence_length_and_says_which_it_was_made_for(tmp_path):
    plan = _plan()
    plan.input_shapes = [[2, 12], [2, 12]]  # token ids and a mask of one micro-batch
    assert plan.sequence_length == 12
    assert plan.predict_at(12) == pytest.approx(plan.simulated_step_s())
    # A step of compute alone: twice the tokens per micro-batch, twice the step.
    assert plan.predict_at(24) == pytest.approx(2 * plan.simulated_step_s())
    assert plan.predict_at(6) == pytest.approx(plan.simulated_step_s() / 2)
    assert "made for micro-batches of inputs shaped (2, 12), (2, 12) (sequence length 12" in plan.report()
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").input_shapes == [[2, 12], [2, 12]]
    with pytest.raises(ValueError, match=r"length=0 must be an integer >= 1 \(the sequence length"):
        plan.predict_at(0)
    plan.input_shapes = [[2]]
    with pytest.raises(ValueError, match=r"predict_at\(length=8\): the plan records no input with a sequence"):
        plan.predict_at(8)


def test_calibrate_with_a_step_time_scales_everything_by_one_factor():
    plan = _plan()
    cal = plan.calibrate({"step_s": 2 * plan.predicted_step_s})
    assert cal.calibration.fwd_factor == [2.0, 2.0] and cal.calibration.bwd_factor == [2.0, 2.0]


def test_calibrate_rejects_the_wrong_number_of_stages():
    with pytest.raises(ValueError, match="measured has 3 stage times but the plan has 2 stages"):
        _plan().calibrate([1.0, 1.0, 1.0])


def test_calibrate_rejects_non_positive_times():
    with pytest.raises(ValueError, match="must all be > 0"):
        _plan().calibrate([1.0, 0.0])


def test_calibrate_with_a_step_time_leaves_the_per_action_overhead_alone():
    # Only compute scales: the calibrated plan's simulated step is the measured one.
    plan = _plan()
    plan.machine = MachineModel(action_overhead_s=[5e-4, 5e-4])
    plan.predicted_step_s = plan.simulated_step_s()
    cal = plan.calibrate({"step_s": 1.5 * plan.predicted_step_s})
    assert cal.predicted_step_s == pytest.approx(1.5 * plan.predicted_step_s, rel=1e-9)
    assert cal.calibration.fwd_factor[0] > 1.5  # compute grows more than the step
    assert cal.action_overhead_s() == [5e-4, 5e-4]


def test_a_plan_without_an_overhead_record_charges_none():
    assert _plan().machine.action_overhead_s == [] and _plan().action_overhead_s() == [0.0, 0.0]


def test_a_plan_without_links_charges_its_device_types_link():
    plan = _plan()
    plan.stages[0].send_bytes = 2 * 10**6
    assert plan.links() == [Link(*default_link("cpu"))]  # CPU's default link
    assert plan.cut_comm_s() == pytest.approx([2e6 / default_link("cpu")[0] + default_link("cpu")[1]])
    plan.machine = MachineModel(links=[Link(1e9, 0.0)])
    assert plan.cut_comm_s() == pytest.approx([2e-3])


def test_calibrating_a_plan_with_no_compute_to_scale_ends():
    # A step longer than its overhead alone, and no compute to scale: the search stops.
    plan = _plan()
    for st in plan.stages:
        st.fwd_s = st.bwd_s = 0.0
    plan.machine = MachineModel(action_overhead_s=[1e-3, 1e-3])
    plan.predicted_step_s = plan.simulated_step_s()
    cal = plan.calibrate({"step_s": 10 * plan.predicted_step_s})
    assert cal.predicted_step_s == pytest.approx(plan.predicted_step_s)


def test_a_step_under_what_the_plan_charges_beyond_compute_is_refused():
    plan = _plan()
    plan.machine = MachineModel(action_overhead_s=[1e-3, 1e-3])
    plan.predicted_step_s = plan.simulated_step_s()
    floor = plan.simulated_step_s(0.0)
    with pytest.raises(ValueError, match="step_s=.* beyond compute"):
        plan.calibrate({"step_s": 0.5 * floor})
    assert plan.calibrate({"step_s": 2 * floor}).predicted_step_s == pytest.approx(2 * floor)


def test_solve_increasing_finds_the_crossing_and_stops_when_there_is_none():
    from autopipe.planning.simulator import solve_increasing

    assert solve_increasing(lambda x: 2 * x, 5.0) == pytest.approx(2.5, rel=1e-12)
    assert solve_increasing(lambda x: 1.0 + x, 0.5) == 0.0
    assert solve_increasing(lambda x: 1.0, 2.0, iterations=10) == 2.0 ** 10


def test_calibrating_a_plan_without_stage_times_takes_the_measured_ones():
    # A plan made from split points alone has no profile: every stage time is 0.
    plan = _plan()
    for st in plan.stages:
        st.fwd_s = st.bwd_s = 0.0
    cal = plan.calibrate({"fwd_s": [1e-3, 2e-3], "bwd_s": [3e-3, 4e-3]})
    assert [(st.fwd_s, st.bwd_s) for st in cal.stages] == [(1e-3, 3e-3), (2e-3, 4e-3)]
    assert cal.calibration.fwd_factor == [None, None]
    assert cal.predicted_step_s > 0
    totals = plan.calibrate([3e-3, 6e-3])  # totals: backward = 2 x forward when nothing was planned
    assert [st.fwd_s for st in totals.stages] == pytest.approx([1e-3, 2e-3])


def test_calibrating_scales_the_profile_of_each_stage_by_its_factor():
    plan = Plan.load(SAVED_FILE)
    before = copy.deepcopy(plan.segments)
    cal = plan.calibrate([2 * st.time_s - 2 * st.comm_s for st in plan.stages])
    for st in plan.stages:
        for k in range(st.first_segment, st.last_segment + 1):
            assert cal.segments[k].fwd_s == pytest.approx(2 * before[k].fwd_s)
            assert cal.segments[k].accum_s == pytest.approx(2 * before[k].accum_s)
    assert plan.segments == before  # the original is untouched
    assert cal.segment_costs()[0] == replace(before[0], fwd_s=cal.segments[0].fwd_s, bwd_s=cal.segments[0].bwd_s,
                                             accum_s=cal.segments[0].accum_s).cost()


def test_a_tuning_record_is_saved_and_read_back_and_a_bad_one_is_refused(tmp_path):
    from autopipe.planning.plan_records import TuningRecord

    plan = _plan()
    plan.tuning = TuningRecord(split_points=[["layers.1"], ["layers.2"]], predicted_step_s=[0.02, 0.021],
                               measured_step_s=[0.025, 0.023], rounds=3, chosen=1, vs_chosen=[1.08, 1.0],
                               round_steps_s=[[0.025, 0.024, 0.026], [0.023, 0.022, 0.024]])
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").tuning == plan.tuning
    data = json.loads((tmp_path / "plan.json").read_text())
    # out of range; one ratio for two splits; one split's rounds; two rounds of three
    for key, bad in {"chosen": 2, "vs_chosen": [1.0], "round_steps_s": [[0.025, 0.024, 0.026]],
                     "rounds": 2}.items():
        wrong = copy.deepcopy(data)
        wrong["tuning"][key] = bad
        (tmp_path / "bad.json").write_text(json.dumps(wrong))
        with pytest.raises(PlanFileError, match="tuning"):
            Plan.load(tmp_path / "bad.json")
    for key in ("vs_chosen", "round_steps_s"):  # a record written without the ratios or rounds still reads
        del data["tuning"][key]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Plan.load(tmp_path / "old.json").tuning
    assert old.vs_chosen == [] and old.round_steps_s == []
