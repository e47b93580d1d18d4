"""pipe.clip_grad_norm_: the unsplit model's global norm and clipped gradients, on every rank."""

from __future__ import annotations

import math

import pytest

import _clip_workers as workers
from _dist_utils import run_world


@pytest.mark.distributed
@pytest.mark.parametrize("schedule, norm_type", [("1F1B", 2.0), ("1F1B", math.inf), ("ZBVZeroBubble", 2.0)])
def test_global_norm_and_clipped_gradients_equal_the_unsplit_models(schedule, norm_type):
    results = run_world(workers.clip_run, 2, schedule, norm_type, 0.05, timeout_s=300)
    for r in results:
        assert r["clipped"]  # the bound is low enough that clipping happens
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-6 * r["ref_norm"]
        assert r["grad_diff"] <= 1e-5
    # A per-rank norm would differ from the global one: the test could tell them apart.
    assert any(abs(r["per_rank_norm"] - r["ref_norm"]) > 1e-3 * r["ref_norm"] for r in results)


@pytest.mark.distributed
def test_bad_clip_arguments_are_refused_before_communication():
    for messages in run_world(workers.bad_clip_args_run, 2, timeout_s=240):
        assert "max_norm=0.0" in messages[0]
        assert "max_norm=inf must be finite" in messages[1]
        assert "norm_type=-1.0" in messages[2]
