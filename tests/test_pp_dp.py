"""Specification of pipeline x data parallel (``Pipeline(data_parallel=...)``: a mesh or a degree) on CPU.

Four gloo ranks form a ``dp=2 x pp=2`` mesh; both ways of reducing over ``dp`` (FSDP2
``fully_shard`` per stage, and replicated parameters averaged by all-reduce) train the seed
Transformer, untied and with a tied embedding, under GPipe, 1F1B and Interleaved1F1B, each
replica stepping the rows its ``DistributedSampler`` yields (and once every rank the global
batch), with the loss, every gradient, the clipped norm and the gathered state dict equal to
the unsplit model's on the global batch. One world per reduction runs every case
(``_pp_dp_workers.py``). The argument checks that need no world run in this process.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import _pp_dp_workers as workers
from _dist_utils import run_world
from autopipe.runtime.data_parallel import DataParallel, check_mesh_arguments, resolve_data_parallel

TOL = 1e-5
CASES = [f"{s}{t}" for t in ("", "+tied") for s in workers.SCHEDULES]
# (mode, case): every case under both reductions, each replica given its rows or every rank the global batch.
MODE_CASES = [(m, c) for m in ("fsdp", "replicate") for c in [*CASES, "1F1B+global"]]


@functools.lru_cache(maxsize=None)
def results(dp_mode: str) -> list[dict]:
    # The FSDP world is given a mesh, the replicated one a degree: both ways of asking.
    return run_world(workers.pp_dp_run, 4, dp_mode, dp_mode == "fsdp", timeout_s=240)


@pytest.mark.parametrize("dp_mode, case", MODE_CASES)
def test_loss_and_every_gradient_equal_the_unsplit_model_on_the_global_batch(dp_mode, case):
    per_rank = [r[case] for r in results(dp_mode)]
    assert {(r["dp_rank"], r["pp_rank"]) for r in per_rank} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    held = set()
    for r in per_rank:
        assert r["dp_mode"] == dp_mode
        assert abs(r["loss"] - r["ref_loss"]) <= TOL  # the global batch's mean, on every rank
        assert max(r["grad_diff"].values()) <= TOL, r["grad_diff"]
        held |= set(r["grad_diff"])
    # Each replica holds every parameter of the model between its two pp ranks.
    assert held == {n for r in per_rank for n in r["grad_diff"]} and "embedding.weight" in held


@pytest.mark.parametrize("dp_mode, case", MODE_CASES)
def test_clip_grad_norm_and_full_state_dict_match_the_unsplit_model_and_load_back(dp_mode, case):
    for r in (r[case] for r in results(dp_mode)):
        assert abs(r["norm"] - r["ref_norm"]) <= TOL * max(1.0, r["ref_norm"])
        assert r["clipped_diff"] <= TOL
        assert r["state_keys_match"] and r["state_diff"] == 0.0
        assert r["load_diff"] == 0.0


@pytest.mark.parametrize("dp_mode", ["fsdp", "replicate"])
def test_bf16_mixed_precision_equals_the_unsplit_model_under_autocast(dp_mode):
    for r in (r["1F1B+bf16"] for r in results(dp_mode)):
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-2 * abs(r["ref_loss"]), r
        assert r["grad_diff"] <= 5e-2 * r["grad_scale"], r


@pytest.mark.parametrize("dp_mode", ["fsdp", "replicate"])
def test_replicas_padded_to_their_own_lengths_equal_the_unsplit_model_or_fsdp_refuses(dp_mode):
    for r in results(dp_mode):
        case = r["lengths"]
        if dp_mode == "fsdp":
            assert case["error"].startswith("ValueError: the batch's inputs have sizes [") and \
                "after the rows, but the pipeline was traced at [9]: FSDP shards" in case["error"], case
            assert math.isfinite(case["after"])
            assert case["eval_error"].startswith("ValueError: data_parallel mode 'fsdp' shards the training trace's")
        else:
            assert abs(case["loss"] - case["ref_loss"]) < 1e-5 and case["grad_diff"] < 1e-5, case


@pytest.mark.parametrize("dp_mode", ["fsdp", "replicate"])
def test_tied_embedding_gradient_is_summed_within_each_replica(dp_mode):
    for r in results(dp_mode):
        case = r["1F1B+tied"]
        # Both pp ranks hold the tied matrix (embedding on stage 0, output layer on stage 1).
        assert "embedding.weight" in case["grad_diff"] and case["grad_diff"]["embedding.weight"] <= TOL


@pytest.mark.parametrize("dp_mode", ["fsdp", "replicate"])
def test_a_plan_for_pp_x_dp_builds_its_mesh_from_the_plan(dp_mode):
    for r in results(dp_mode):
        case = r["from_plan"]
        assert case["plan"] == (2, dp_mode, 2) and case["built"] == case["plan"]
        assert case["loss"] > 0


@pytest.mark.parametrize("dp_mode", ["fsdp", "replicate"])
def test_bad_mesh_and_bad_global_batch_raise_clear_errors_on_every_rank(dp_mode):
    for r in results(dp_mode):
        assert "dimensions named 'dp' and 'pp'" in r["bad_mesh_error"] and "('data', 'pp')" in r["bad_mesh_error"]
        refused = r["1F1B+global"]["bad_batch_error"]  # the case's exact step came after it
        assert "12 rows" in refused and "dp=2" in refused
        error = r["1F1B"]["global_to_replica_error"]  # DDP's convention by default: the global batch is named as such
        assert "shape (16, 9)" in error and "pass a batch of shape (8, 9)" in error
        assert "DistributedSampler" in error and "batch='global'" in error


def test_mesh_and_degree_together_are_refused():
    with pytest.raises(ValueError, match="give data_parallel a mesh or degree=2, not both"):
        check_mesh_arguments(object(), 2, "fsdp")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_degree_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=f"data_parallel degree={value!r} must be a positive integer"):
        check_mesh_arguments(None, value, "fsdp")


def test_unknown_mode_lists_the_accepted():
    with pytest.raises(ValueError, match=r"data_parallel mode='ddp' is not one of \['fsdp', 'replicate'\]"):
        check_mesh_arguments(None, 2, "ddp")


def test_mesh_must_be_a_device_mesh():
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh, got tuple"):
        check_mesh_arguments((2, 2), None, "fsdp")


def test_degree_that_does_not_divide_the_world_is_refused_before_any_group():
    with pytest.raises(ValueError, match="data_parallel degree=3 does not divide the world size 4"):
        resolve_data_parallel(None, 3, "fsdp", world_size=4, device_type="cpu")
    assert resolve_data_parallel(None, 1, "fsdp", world_size=4, device_type="cpu") is None


def test_each_replica_takes_its_contiguous_rows_of_the_global_batch():
    dp = DataParallel(mesh=None, mode="replicate", dp_size=2, pp_size=2, dp_rank=1, pp_rank=0,
                      replicas=[[0, 1], [2, 3]], batch="global")
    x = torch.arange(16).reshape(8, 2)
    args, kwargs, target = dp.shard(((x,), {"scale": torch.tensor(2.0)}, x[:, 0]), 2)
    assert torch.equal(args[0], x[4:]) and torch.equal(target, x[4:, 0]) and kwargs["scale"].item() == 2.0
    with pytest.raises(ValueError, match="a global batch of 6 rows .* dp=2 replicas x n_microbatches=2"):
        dp.shard(torch.zeros(6, 2), 2)


def test_a_replicas_own_rows_are_taken_as_they_are():
    dp = DataParallel(mesh=None, mode="replicate", dp_size=2, pp_size=2, dp_rank=1, pp_rank=0,
                      replicas=[[0, 1], [2, 3]])
    x = torch.arange(16).reshape(8, 2)
    assert dp.batch == "replica" and dp.batch_replicas == 1 and dp.shard(x, 2) is x


def test_the_batch_convention_is_checked_where_it_is_written():
    from autopipe import DataParallelOptions

    with pytest.raises(ValueError, match="DataParallelOptions batch='local'.*'replica', 'global'"):
        DataParallelOptions(degree=2, batch="local")
