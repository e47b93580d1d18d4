"""Mixed precision (``PlannerOptions(mixed_precision="bf16")``): planned under autocast, run under it.

On 2 gloo ranks every schedule trains :class:`_precision_workers.TwoDtypes`, whose cuts carry
a bfloat16 activation and a float32 one under bfloat16 autocast, and must equal the unsplit
model under the same autocast within bfloat16 round-off; each stage must receive the dtypes
autocast gives the tensors it is sent (not the float32 they were traced in).
"""

from __future__ import annotations

import functools

import pytest
import torch

import _precision_workers as workers
import autopipe
from _dist_utils import run_world
from autopipe import PlannerOptions, ProfileOptions
from autopipe.planning.schedules import SCHEDULES

QUICK = ProfileOptions(progress=False, warmup=0, repeats=1)


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_world(workers.mixed_precision_run, 2, timeout_s=300)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_like_the_unsplit_model_under_the_same_autocast(schedule):
    for r in (r[schedule] for r in results()):
        # The same bfloat16 products summed per micro-batch instead of over the whole batch.
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-3 * abs(r["ref_loss"])
        assert r["grad_diff"] <= 2e-2 * r["grad_scale"], r
        assert abs(r["eval_loss"] - r["ref_loss"]) <= 1e-3 * abs(r["ref_loss"])
        # The same under the user's own torch.autocast around step() and evaluate() (no option).
        assert abs(r["user_loss"] - r["ref_loss"]) <= 1e-3 * abs(r["ref_loss"]), r
        assert abs(r["user_eval_loss"] - r["ref_loss"]) <= 1e-3 * abs(r["ref_loss"]), r
        assert r["user_grad_diff"] <= 2e-2 * r["grad_scale"], r


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_cut_carries_the_dtypes_autocast_gives_its_tensors(schedule):
    received = {s: dtypes for r in results() for s, dtypes in r[schedule]["received"].items()}
    # After ``a``: its output in bfloat16 beside sin(x) in float32; after ``c`` and ``d``: bfloat16 alone.
    assert sorted(received[1]) == ["torch.bfloat16", "torch.float32"]
    if len(received) > 1:
        assert sorted(received[2]) == ["torch.bfloat16", "torch.float32"] and received[3] == ["torch.bfloat16"]


def test_the_plan_is_profiled_in_the_precision_it_trains_in(tmp_path):
    model, x = workers.TwoDtypes(), torch.randn(64, 8)
    plans = {p: autopipe.partition(model, 2, (x,), loss_fn=False, n_microbatches=2,
                                   planner=PlannerOptions(mixed_precision=p, profiling=QUICK)) for p in (None, "bf16")}
    assert plans["bf16"].mixed_precision == "bf16" and plans[None].mixed_precision == ""
    # Saved activations in bfloat16 take about half the bytes; weights stay float32.
    saved = {p: sum(s.act_bytes for s in plan.segments) for p, plan in plans.items()}
    assert saved["bf16"] < 0.75 * saved[None]
    assert [s.param_bytes for s in plans["bf16"].segments] == [s.param_bytes for s in plans[None].segments]
    # The cut before ``b`` sends a's output (64 x 16, bfloat16 under autocast) and sin(x) (64 x 8, float32).
    cut = {p: next(s.cut_fwd_bytes for s in plan.segments if s.name == "b") for p, plan in plans.items()}
    assert cut == {None: 64 * 16 * 4 + 64 * 8 * 4, "bf16": 64 * 16 * 2 + 64 * 8 * 4}
    plans["bf16"].save(tmp_path / "plan.json")
    assert autopipe.Plan.load(tmp_path / "plan.json").mixed_precision == "bf16"


def test_an_unknown_precision_is_named_with_the_accepted():
    with pytest.raises(ValueError, match="PlannerOptions mixed_precision='fp8'.*'bf16', 'fp16'"):
        PlannerOptions(mixed_precision="fp8")
