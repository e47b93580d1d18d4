"""Modules and weights used several times, with the uses spread over stages (CPU, gloo, 2 or 3 ranks).

One embedding is looked up twice on the first stage and is also the output layer on the
last; one block is called on both sides of a cut (torch.export names its second call
``shared@1``). Every use's gradient reaches the one parameter, the optimizer updates it,
and the checkpoint lists the model's own names (``_reuse_workers.py``).
"""

from __future__ import annotations

import functools

import pytest

import _reuse_workers as workers
from _dist_utils import run_world

TOL = 1e-5
PARAM_TOL = 1e-4  # after 3 AdamW steps (see tests/test_tied.py)
ALL_PARAMS = {"emb.weight", "head.weight", "shared.lin.weight", "shared.lin.bias"} | {
    f"l{i}.lin.{kind}" for i in range(4) for kind in ("weight", "bias")}


@functools.lru_cache(maxsize=None)
def results(case: str) -> list[dict]:
    return run_world(workers.reuse_run, workers.CASES[case][3], case, timeout_s=300)


pytestmark = [pytest.mark.distributed, pytest.mark.parametrize("case", list(workers.CASES))]


def test_every_use_of_a_shared_weight_or_block_gives_the_unsplit_gradient(case):
    per_rank = results(case)
    assert set().union(*(r["grad_diff"] for r in per_rank)) == ALL_PARAMS - {"head.weight"}
    for r in per_rank:
        assert max(r["loss_diff"]) < TOL
        assert max(r["grad_diff"].values()) < TOL, r["grad_diff"]


def test_a_block_called_on_two_stages_is_held_and_updated_under_its_own_name(case):
    for r in results(case):
        assert not any("@" in n for n in r["held"]), r["held"]
        assert max(r["param_diff"].values()) < PARAM_TOL, r["param_diff"]
    holders = [r for r in results(case) if "shared.lin.weight" in r["held"]]
    assert holders, "no rank holds the reused block"


def test_the_full_state_dict_has_the_models_keys_and_evaluates_like_the_pipeline(case):
    for r in results(case):
        assert r["full_keys"] == r["model_keys"]
        assert r["rebuilt_diff"] < PARAM_TOL
        assert r["evaluate_diff"] < TOL
