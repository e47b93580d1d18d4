"""A step gives the unsplit model's numbers or raises on every rank: never a wrong number in silence.

Scenarios run in a few spawned gloo worlds of 2 CPU ranks (``_guard_workers.py``); each
test checks one behaviour of their results.
"""

from __future__ import annotations

import functools

import pytest

import _guard_workers as workers
from _dist_utils import run_world

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def autocast_results() -> dict[str, list[dict]]:
    scenarios = [(kind, "autocast_run", (kind,)) for kind in ("mlp", "transformer")]
    per_rank = run_world(workers.scenarios_run, 2, scenarios, timeout_s=300)
    return {key: [r[key] for r in per_rank] for key, _, _ in scenarios}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_a_bfloat16_tensor_crossing_a_cut_under_autocast_is_read_as_what_it_is(kind):
    # The cut is traced in float32; under autocast the sending stage computes it in bfloat16.
    for r in autocast_results()[kind]:
        assert abs(r["loss"] - r["ref_loss"]) < TOL, r
        # Micro-batches accumulate bfloat16 products in another order than the whole batch.
        assert r["grad_diff"] < 2e-2 * r["grad_scale"], r


def test_a_stage_output_in_another_dtype_than_traced_is_widened_or_refused():
    import torch
    import torch.nn as nn

    from autopipe.runtime.compat import guard_stage_boundaries

    class Cast(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.dtype = dtype

        def forward(self, x):
            return x.to(self.dtype) * 3

    narrow = Cast(torch.bfloat16)
    narrow._autopipe_wire = {"inputs": {}, "outputs": {}, "traced": {0: torch.float32}}
    guard_stage_boundaries(narrow)
    assert narrow(torch.ones(2)).dtype == torch.float32
    wide = Cast(torch.float64)
    wide._autopipe_wire = {"inputs": {}, "outputs": {}, "traced": {0: torch.float32}}
    guard_stage_boundaries(wide)
    with pytest.raises(TypeError, match="stage output 0 is torch.float64 but was traced as torch.float32"):
        wide(torch.ones(2))


@functools.lru_cache(maxsize=None)
def eval_results() -> list[dict]:
    return run_world(workers.eval_mode_run, 2, timeout_s=300)


@pytest.mark.distributed
def test_eval_mode_runs_the_eval_graph_of_functional_dropout_and_training_branches():
    per_rank = eval_results()
    for r in per_rank:
        assert r["loss_diff"] < TOL, r
    assert per_rank[0]["out_diff"] is None and per_rank[1]["out_diff"] < TOL, per_rank
