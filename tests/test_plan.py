"""Plan: JSON round trip, versioning, and the split_spec torch accepts."""

from __future__ import annotations

import json

import pytest
from torch.distributed.pipelining import SplitPoint

from autopipe.plan import PLAN_FORMAT_VERSION, BaselinePlan, Plan, StagePlan


def _plan() -> Plan:
    stages = [
        StagePlan(index=i, fqns=[f"layers.{i}"], first_segment=i, last_segment=i, fwd_s=1e-3, bwd_s=2e-3,
                  comm_s=1e-4, param_bytes=10, act_bytes=20, peak_bytes=50, send_bytes=8, recv_bytes=8)
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


def test_newer_format_is_refused(tmp_path):
    data = _plan().to_dict()
    data["format_version"] = PLAN_FORMAT_VERSION + 1
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format_version"):
        Plan.load(tmp_path / "p.json")


def test_not_json_is_a_clear_error(tmp_path):
    (tmp_path / "p.json").write_text("not json")
    with pytest.raises(ValueError, match="is not a plan JSON file"):
        Plan.load(tmp_path / "p.json")


def test_balance_is_lower_bound_over_bottleneck():
    assert _plan().balance == pytest.approx(3e-3 / 3.1e-3)
