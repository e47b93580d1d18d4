"""Compiled stages (``PlannerOptions(compile=...)``): each stage module compiled in place, equal to eager.

On 2 gloo ranks the model of ``_precision_workers`` trains compiled (dynamo with the
``aot_eager`` backend: the test checks what dynamo captures, not inductor's code) under the
schedules with one whole backward per stage, against the unsplit model in eager; a
split-backward schedule is refused before any stage is built.
"""

from __future__ import annotations

import functools

import pytest

import _precision_workers as workers
from _dist_utils import run_world
from autopipe import PlannerOptions
from autopipe.runtime.stages import compile_options

SCHEDULES = ["1F1B"]  # GPipe, Interleaved1F1B and LoopedBFS run alike (docs/training.md)


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_world(workers.compiled_run, 2, SCHEDULES, timeout_s=400)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_stages_train_like_the_eager_unsplit_model(schedule):
    for r in (r[schedule] for r in results()):
        assert r["graphs"] > 0  # dynamo compiled this rank's stages
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-4
        assert r["grad_diff"] <= 1e-4
        assert abs(r["eval_loss"] - r["ref_loss"]) <= 1e-4


def test_a_split_backward_schedule_is_refused_with_compiled_stages():
    for r in results():
        assert "planner.compile with schedule='ZBVZeroBubble'" in r["split_backward"]
        assert "GPipe, 1F1B, Interleaved1F1B or LoopedBFS" in r["split_backward"]


def test_compile_takes_true_or_torch_compile_arguments():
    assert compile_options(True) == {} and compile_options({"mode": "max-autotune"}) == {"mode": "max-autotune"}
    assert compile_options(False) is None
    with pytest.raises(TypeError, match="PlannerOptions compile='yes' must be True, False or a dict"):
        PlannerOptions(compile="yes")
