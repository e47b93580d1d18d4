"""Specification of tied parameters in autopipe.Pipeline: one matrix used several ways, on one
stage, on several stages of a rank and on several ranks (CPU, gloo, loopback).

A parameter's gradient is the sum over all of its uses, every copy holds the same value
(from the build on), and ranks given different models are refused. The scenarios run in
a few spawned worlds (``_tied_workers.py``), each once per session; the tests below each
check one behaviour of their results. The helpers of ``autopipe.runtime.params`` are
checked in this process.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

import _tied_workers as workers
from _dist_utils import run_world
from autopipe.runtime.params import (first_model_difference, first_use_ranks, model_signature, model_state_names,
                                     stage_aliases)

TOL = 1e-5
# Parameters after 3 AdamW steps: Adam divides each gradient by its running RMS, so a
# gradient element near zero turns a 1e-10 rounding difference (micro-batches summed in
# another order) into a visible one; a lost use of a tied matrix moves it by 1e-2.
PARAM_TOL = 1e-4

THREE_WAY_CASES = ("1F1B", "ZBV-one-rank", "ZBV-two-ranks", "1F1B+checkpoint", "ZBV-two-ranks+checkpoint")
SEEDED_KINDS = tuple(workers.SEEDED_CASES)
# How many ranks hold the tied matrix in each case (ZBV-one-rank: both uses' stages on rank 0).
HOLDERS = {"1F1B": 2, "ZBV-one-rank": 1, "ZBV-two-ranks": 2}


@functools.lru_cache(maxsize=None)
def three_way_results() -> dict[str, list[dict]]:
    scenarios = [(case, "three_way_run", (case,)) for case in THREE_WAY_CASES]
    scenarios.append(("eval", "eval_trace_run", ()))
    per_rank = run_world(workers.scenarios_run, 2, scenarios, timeout_s=600)
    return {key: [r[key] for r in per_rank] for key, _, _ in scenarios}


@functools.lru_cache(maxsize=None)
def seeded_and_mismatch_results() -> dict[str, list[dict]]:
    scenarios = [(kind, "seeded_run", (kind,)) for kind in SEEDED_KINDS]
    scenarios.append(("mismatch", "mismatch_run", ()))
    per_rank = run_world(workers.scenarios_run, 2, scenarios, timeout_s=600)
    return {key: [r[key] for r in per_rank] for key, _, _ in scenarios}


@functools.lru_cache(maxsize=None)
def t5_results() -> list[dict]:
    pytest.importorskip("transformers")
    return run_world(workers.t5_run, 2, "1F1B", timeout_s=600)


def assert_first_step_matches_unsplit(results: list[dict]) -> None:
    """Loss within TOL on every rank; every parameter held somewhere, its gradient within TOL."""
    assert set().union(*(r["grad_diff"] for r in results)) == set(results[0]["all_param_names"])
    for r in results:
        assert abs(r["losses"][0] - r["ref_losses"][0]) < TOL
        assert max(r["grad_diff"].values()) < TOL, r["grad_diff"]


# ---------------------------------------------------------------------- three uses, two on one stage
@pytest.mark.distributed
@pytest.mark.parametrize("case", THREE_WAY_CASES)
def test_three_way_tie_gives_the_unsplit_loss_and_every_gradient(case):
    assert_first_step_matches_unsplit(three_way_results()[case])


@pytest.mark.distributed
@pytest.mark.parametrize("case", THREE_WAY_CASES)
def test_three_way_tie_trains_like_the_unsplit_model_for_3_adamw_steps(case):
    for r in three_way_results()[case]:
        assert all(abs(a - b) < TOL for a, b in zip(r["losses"], r["ref_losses"])), r
        assert max(r["param_diff"].values()) < PARAM_TOL, r["param_diff"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", THREE_WAY_CASES)
def test_every_copy_of_the_tied_matrix_is_equal_after_3_adamw_steps(case):
    results = three_way_results()[case]
    assert all(r["copies_equal"] for r in results)
    assert results[0]["copies"] == HOLDERS[case.partition("+")[0]]


@pytest.mark.distributed
def test_uses_on_one_stage_are_one_parameter_listed_once():
    # 1F1B: stage 1 reads the matrix as the decoder's embedding and as the head.
    for r in three_way_results()["1F1B"]:
        assert r["alias"]["objects"] == 1
        assert list(r["alias"]["listed"].values()) == [1]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["ZBV-one-rank", "ZBV-two-ranks"])
def test_split_backward_uses_on_one_rank_share_one_memory(case):
    # torch's split weight backward needs a Parameter per use within a stage; they share memory.
    for r in three_way_results()[case]:
        if r["alias"]["held"]:
            assert r["alias"]["storages"] == 1


@pytest.mark.distributed
def test_eval_mode_trace_reads_every_alias_of_the_tied_matrix():
    results = three_way_results()["eval"]
    assert not any(r["traced_before_eval"] for r in results)  # the eval-mode trace waits for eval mode
    assert all(r["separate_eval_trace"] for r in results)  # dropout: traced again for eval
    assert all(r["alias"]["objects"] == 1 for r in results)
    last = results[1]
    assert last["eval_output_diff"] is not None and last["eval_output_diff"] < TOL


@pytest.mark.distributed
def test_t5_tied_embeddings_and_head_train_exactly_with_1f1b():
    results = t5_results()
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) < TOL
        assert max(r["grad_diff"].values()) < TOL, {k: v for k, v in r["grad_diff"].items() if v >= TOL}
    assert set().union(*(r["grad_diff"] for r in results)) == set(results[0]["all_param_names"])


# ---------------------------------------------------------------------- copies start equal
@pytest.mark.distributed
@pytest.mark.parametrize("kind", SEEDED_KINDS)
def test_differently_seeded_copies_start_as_the_first_use_ranks(kind):
    results = seeded_and_mismatch_results()[kind]
    assert all(r["ranks_differ_before"] for r in results)  # the seeds did give different matrices
    assert all(r["shared_held"] and r["shared_equals_source"] for r in results)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", SEEDED_KINDS)
def test_differently_seeded_ranks_train_like_the_unsplit_model_they_make_up(kind):
    results = seeded_and_mismatch_results()[kind]
    assert_first_step_matches_unsplit(results)
    for r in results:
        assert all(abs(a - b) < TOL for a, b in zip(r["losses"], r["ref_losses"])), r
        assert max(r["param_diff"].values()) < PARAM_TOL, r["param_diff"]
        assert r["copies_equal"]


# ---------------------------------------------------------------------- ranks given different models
@pytest.mark.distributed
def test_a_different_parameter_shape_on_one_rank_is_a_value_error_on_every_rank():
    for r in seeded_and_mismatch_results()["mismatch"]:
        assert r["shape"].startswith("ValueError: the ranks were given different models"), r["shape"]
        assert "'decoder.layers.0.weight'" in r["shape"] and "(17, 16)" in r["shape"]


@pytest.mark.distributed
def test_a_weight_tied_on_one_rank_only_is_a_value_error_on_every_rank():
    for r in seeded_and_mismatch_results()["mismatch"]:
        assert r["tie"].startswith("ValueError:"), r["tie"]
        assert "'lm_head.weight'" in r["tie"] and "tied to 'shared.weight'" in r["tie"]


@pytest.mark.distributed
def test_the_job_goes_on_after_ranks_disagreed():
    assert all(math.isfinite(r["step_after"]) for r in seeded_and_mismatch_results()["mismatch"])


# ---------------------------------------------------------------------- the helpers, in this process
def test_stage_aliases_lists_both_copies_pipeline_makes_on_one_stage():
    model = workers.tied_model()
    pipe = pipeline(model, (workers.batch(0)[0][:2],), split_spec={"decoder": SplitPoint.BEGINNING})
    aliases = stage_aliases(pipe.get_stage_module(1), model_state_names(model))
    assert sorted(aliases["shared.weight"]) == ["decoder.embed_tokens.weight", "lm_head.weight"]
    assert aliases["decoder.layers.0.weight"] == ["decoder.layers.0.weight"]


def test_first_use_rank_is_the_rank_of_the_lowest_stage_using_it():
    # ZBV on 2 ranks: stages 0..3 on ranks 0, 1, 1, 0.
    assert first_use_ranks([["h0"], ["w", "h1"], ["w"], ["w", "head"]], [0, 1, 1, 0]) == \
        {"h0": 0, "w": 1, "h1": 1, "head": 0}


def test_model_signature_sees_ties_but_not_values():
    a, b = workers.tied_model(seed=0), workers.tied_model(seed=1)
    assert model_signature(a) == model_signature(b)
    b.lm_head.weight = nn.Parameter(b.shared.weight.detach().clone())
    assert model_signature(a) != model_signature(b)
    assert "'lm_head.weight'" in first_model_difference([model_signature(a), model_signature(b)])


def test_first_model_difference_names_a_dtype_and_a_missing_tensor():
    a = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert first_model_difference([model_signature(a)] * 3) is None
    b = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.float64))
    assert first_model_difference([model_signature(a), model_signature(b)]).startswith("'1.weight'")
    assert "torch.float64" in first_model_difference([model_signature(a), model_signature(b)])
    c = nn.Sequential(nn.Linear(2, 2))
    difference = first_model_difference([model_signature(a), model_signature(a), model_signature(c)])
    assert difference.startswith("'1.weight'") and "rank 2 has no such tensor" in difference
