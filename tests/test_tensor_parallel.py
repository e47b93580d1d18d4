"""Tensor-parallel stages (autopipe.runtime.tensor_parallel): a traced stage sharded over 2 gloo
ranks, and a pp 2 x tp 2 pipeline of them under torch's schedule on 4, compute the unsplit
model's loss and every gradient, sharded as the planner's own analysis says."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn

import _tensor_parallel_workers as workers
from _dist_utils import run_world
from autopipe.layouts.sharding import ShardedMatmul, TensorParallelPlan, find_tensor_parallel
from autopipe.runtime.tensor_parallel import parallelize_stage

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def results(name: str) -> list[dict]:
    return run_world(workers.stage_run, 2, name, timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["seed_transformer", "llama", "qwen2"])
def test_a_sharded_stage_gives_the_unsplit_loss_and_every_gradient(name):
    if name != "seed_transformer":
        pytest.importorskip("transformers", reason="transformers is not installed (pip install 'autopipe[hf]')")
    for rank in results(name):
        assert rank["loss"] == pytest.approx(rank["expected_loss"], abs=TOL)
        assert rank["worst_grad"] <= TOL
        assert rank["out_type"] == "Tensor"  # what leaves the stage is plain, whole


@pytest.mark.distributed
def test_under_bf16_autocast_a_sharded_stage_is_within_bf16_rounding_of_the_unsplit_model():
    for rank in run_world(workers.stage_run, 2, "seed_transformer", True, timeout_s=300):
        assert rank["loss"] == pytest.approx(rank["expected_loss"], rel=2 ** -7)
        # Sharded, bf16 moves the gradients from fp32 about as far as it does unsplit.
        assert 0 < rank["sharded_from_fp32"] <= 2 * rank["unsplit_from_fp32"]


@functools.lru_cache(maxsize=None)
def pipeline_results(name: str) -> list[dict]:
    return run_world(workers.pipeline_run, 4, name, "1F1B", timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["seed_transformer", "llama"])
def test_a_pp2_tp2_pipeline_of_sharded_stages_gives_the_unsplit_losses_and_gradients(name):
    if name == "llama":
        pytest.importorskip("transformers", reason="transformers is not installed (pip install 'autopipe[hf]')")
    ranks = pipeline_results(name)
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in ranks:
        assert rank["worst_grad"] <= TOL
        if rank["pp_rank"] == 1:  # the last stage computes the loss of each micro-batch
            assert rank["losses"] == pytest.approx(rank["expected_losses"], abs=TOL)


@pytest.mark.distributed
def test_each_rank_holds_half_of_every_sharded_matrix_along_its_side():
    rank = results("seed_transformer")[0]
    assert set(rank["sharded"].values()) == {"column", "row"}
    for module, shard in rank["sharded"].items():
        local, whole = rank["local_shapes"][module + ".weight"]
        dim = 0 if shard == "column" else 1  # nn.Linear's weight is (out, in)
        assert local[dim] * 2 == whole[dim] and local[1 - dim] == whole[1 - dim]


@pytest.mark.distributed
def test_a_checkpoint_of_sharded_stages_loads_into_the_unsplit_model_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp

    run_world(workers.save_run, 2, "seed_transformer", str(tmp_path / "tp2"), timeout_s=300)
    expected, args = workers._model("seed_transformer")  # the same step, unsplit
    expected(*args).float().pow(2).mean().backward()
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    loaded, _ = workers._model("seed_transformer")
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()  # whatever the load leaves unset would show
    state = loaded.state_dict()
    with warnings.catch_warnings():  # torch says it assumes a single process: it is one, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(tmp_path / "tp2"))
    loaded.load_state_dict(state)
    for name, p in expected.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p, rtol=0, atol=1e-6)


class _Mesh:
    """Stands for a mesh of ``n`` ranks where nothing may be communicated."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_heads_that_do_not_divide_are_refused_before_anything_moves():
    model = nn.MultiheadAttention(12, 3, batch_first=True)
    plan = TensorParallelPlan([ShardedMatmul("q.weight", 12, 12, "column", 0),
                               ShardedMatmul("out.weight", 12, 12, "row", 0)], heads={0: (3, 3)})
    with pytest.raises(ValueError, match="degree 2 cannot shard this model: 3 attention heads"):
        parallelize_stage(model, _Mesh(2), plan)


def test_a_model_with_nothing_to_shard_is_refused_naming_why():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plan = find_tensor_parallel(torch.export.export(model, (torch.randn(2, 4),)))
    with pytest.raises(ValueError, match="nothing to shard"):
        parallelize_stage(model, _Mesh(2), plan)
