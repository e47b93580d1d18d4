"""Tensor-parallel stages (autopipe.runtime.tensor_parallel): ``Pipeline`` with
``DataParallelOptions(tensor_parallel=2)`` on pp 2 x tp 2 (4 gloo ranks) and pp 2 x tp 2 x dp 2 (8, FSDP)
computes the unsplit model's loss and every gradient, sharded as the planner's own analysis says; it
steps at other lengths and evaluates; a pp 2 x tp 2 checkpoint resumes at pp 4 and loads into the
unsplit model."""

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


#: A ``tensor_parallel=2`` Pipeline on pp 2 x tp 2: (model, schedule, dp, planner.recompute, bf16 autocast,
#: a second step at another length).
PP_TP = {
    "seed-1F1B+selective": ("seed_transformer", "1F1B", 1, "selective", False, True),  # then another length
    "qwen2-Interleaved1F1B+full": ("qwen2", "Interleaved1F1B", 1, "full"),
    "llama-ZBVZeroBubble": ("llama", "ZBVZeroBubble"),
    "seed-1F1B+bf16": ("seed_transformer", "1F1B", 1, "none", True),
    "gpt2-1F1B": ("gpt2", "1F1B", 1, "none", False, True),  # fused q, k, v in a Conv1D; then another length
    # The output layer sharded along the vocabulary, a cross-entropy under loss_parallel, norms on sequence
    # shards; then another length.
    "seed-1F1B+loss_parallel+sp": ("seed_transformer", "1F1B", 1, "none", False, True, True, True),
}
#: The same on pp 2 x tp 2 x dp 2 (8 ranks), FSDP over dp, sequence parallel: q, k and v fused in one
#: nn.Linear, whose strided shard FSDP2 cuts along the other dimension.
PP_TP_DP = {"fused-1F1B+fsdp+sp": ("fused", "1F1B", 2, "none", False, False, False, True)}
#: Models without Hugging Face's transformers.
PLAIN = ("seed_transformer", "fused")


def _transformers_imports() -> bool:
    return workers.name_imports("transformers")


@functools.lru_cache(maxsize=None)
def pipeline_results(world: int) -> dict:
    cases = PP_TP if world == 4 else PP_TP_DP
    runnable = {k: c for k, c in cases.items() if c[0] in PLAIN or _transformers_imports()}
    ranks = run_world(workers.pipe_cases, world, runnable, timeout_s=600)
    return {key: [rank[key] for rank in ranks] for key in runnable}


def _case(world: int, key: str) -> list[dict]:
    found = pipeline_results(world)
    if key not in found:
        pytest.skip("transformers is not installed (pip install 'autopipe[hf]')")
    return found[key]


@pytest.mark.distributed
@pytest.mark.parametrize("world,key", [(4, k) for k in PP_TP if "bf16" not in k] + [(8, k) for k in PP_TP_DP])
def test_a_tensor_parallel_pipeline_gives_the_unsplit_loss_gradients_and_norm(world, key):
    ranks = _case(world, key)
    case = {**PP_TP, **PP_TP_DP}[key]
    dp, checkpoint = (case[2] if len(case) > 2 else 1), (case[3] if len(case) > 3 else "none")
    held: set[str] = set()
    for rank in ranks:
        assert rank["loss"] == pytest.approx(rank["expected_loss"], abs=TOL)
        assert rank["worst_grad"] <= TOL
        assert rank["norm"] == pytest.approx(rank["expected_norm"], rel=TOL)  # every shard counted once
        assert rank["without_grad"] == [] and rank["sharded"]
        assert bool(rank["checkpointed"]) == (checkpoint != "none")
        held |= set(rank["grads"])
    assert held == set(ranks[0]["model_params"])  # every parameter is some rank's
    # tp innermost: ranks 2k and 2k + 1 shard the same stage; then dp, then pp.
    assert [r["place"] for r in ranks] == [(i // (2 * dp), i // 2 % dp, i % 2) for i in range(world)]
    assert [n["rank"] for n in ranks[0]["nodes"]] == list(range(world))


@pytest.mark.distributed
def test_each_rank_holds_half_of_every_sharded_matrix_along_its_side():
    rank = _case(4, "seed-1F1B+selective")[0]
    assert rank["local_shapes"]
    for name, (local, whole) in rank["local_shapes"].items():
        row = name.rpartition(".")[0].endswith(("out_linear", "fc2"))
        if row and name.endswith("bias"):  # added after the all-reduce: whole on every rank
            assert local == whole, name
            continue
        dim = 1 if row else 0  # nn.Linear's weight is (out, in): columns shard outputs, rows inputs
        assert local[dim] * 2 == whole[dim] and local[:dim] + local[dim + 1:] == whole[:dim] + whole[dim + 1:], name


@pytest.mark.distributed
def test_a_fused_qkv_matrix_is_sharded_by_head_in_each_of_its_parts():
    # GPT-2's c_attn: a Conv1D, (in, out), holding q, k and v; each rank holds its half of each.
    rank = _case(4, "gpt2-1F1B")[0]
    fused = {n: shapes for n, shapes in rank["local_shapes"].items() if n.endswith("c_attn.weight")}
    assert fused and all(local == (64, 96) and whole == (64, 192) for local, whole in fused.values())
    assert rank["strided"] == sorted(fused)  # placed as what it holds: a slice of every part


@pytest.mark.distributed
def test_with_loss_parallel_the_output_layer_is_sharded_along_the_vocabulary_and_its_loss_is_the_unsplit_one():
    # Its loss, gradients and norm are the unsplit model's: the first test of this file.
    ranks = _case(4, "seed-1F1B+loss_parallel+sp")
    for rank in ranks:  # a step whose loss_fn raised (a target too short) first: every rank was told, none hung
        assert "in loss_fn" in rank["failed_step"] and "failed on rank 2, 3" in rank["failed_step"]
    last = [rank for rank in ranks if rank["forward_worst"] is not None]
    assert len(last) == 2  # the tp group of the last stage holds the output layer, half the vocabulary each
    for rank in last:
        assert rank["local_shapes"]["out_linear.weight"] == ((64, 64), (128, 64))
        assert rank["forward_worst"] <= TOL  # pipe(x) gives the whole logits


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["seed-1F1B+selective", "gpt2-1F1B", "seed-1F1B+loss_parallel+sp"])
def test_a_step_at_another_length_traces_sharded_stages_that_train_as_the_unsplit_model(key):
    for rank in _case(4, key):
        assert rank["short"]["loss"] == pytest.approx(rank["short"]["expected"], abs=TOL)
        assert rank["short"]["worst_grad"] <= TOL


@pytest.mark.distributed
@pytest.mark.parametrize("key", ["seed-1F1B+selective", "qwen2-Interleaved1F1B+full", "llama-ZBVZeroBubble",
                                 "gpt2-1F1B"])
def test_each_block_all_reduces_as_often_as_the_layout_model_charges(key):
    # Twice forward, twice backward: q, k and v (and gate and up) read one replicated input, so one
    # all-reduce of its gradient, not one each; selective recomputation keeps the reductions' outputs.
    # GPT-2's fused q/k/v bias is whole on every rank: its gradient is all-gathered once per block.
    from autopipe.layouts.blocks import tp_collectives

    recompute = PP_TP[key][3] if len(PP_TP[key]) > 3 else "none"
    per_block = sum(tp_collectives(2, recompute=recompute).values())
    if recompute == "full":
        # The layout model charges the forward's two again; torch's checkpoint stops recomputing at the
        # last tensor the backward needs, so the block's last all-reduce (its output's) is not run again.
        per_block -= 1
    for rank in _case(4, key):
        assert rank["blocks"] > 0
        times = rank["n_microbatches"] * rank["blocks"]
        gathers = {"all_gather_into_tensor": times} if key.startswith("gpt2") else {}
        assert rank["collectives"] == {"all_reduce": times * per_block, **gathers}


@pytest.mark.distributed
@pytest.mark.parametrize("world,key", [(4, "seed-1F1B+loss_parallel+sp"), (8, "fused-1F1B+fsdp+sp")])
def test_under_sequence_parallelism_each_block_reduce_scatters_and_gathers_as_the_layout_model_charges(world, key):
    # Each all-reduce becomes a reduce-scatter and an all-gather: 4 of each per block and micro-batch.
    # A stage's input arrives whole, so where its first column's input gradient meets the residual
    # path's sequence shards decides whether that one is reduce-scattered or all-reduced (DTensor
    # picks): at most one per micro-batch and stage (1F1B: one stage per rank) differs.
    from autopipe.layouts.blocks import tp_collectives

    per_block = sum(tp_collectives(2, recompute="none").values())
    for rank in _case(world, key):
        charged = rank["n_microbatches"] * rank["blocks"] * per_block
        assert charged - rank["n_microbatches"] <= rank["collectives"]["reduce_scatter_tensor"] <= charged
        assert rank["collectives"]["all_gather_into_tensor"] >= charged
        assert rank["replicated_whole"]  # the norms: replicated DTensors, gradients summed over the group


@pytest.mark.distributed
def test_under_bf16_autocast_a_tensor_parallel_pipeline_is_within_bf16_rounding_of_the_unsplit_model():
    for rank in _case(4, "seed-1F1B+bf16"):
        assert rank["loss"] == pytest.approx(rank["expected_loss"], rel=2 ** -7)
        # Sharded, bf16 moves the gradients from fp32 about as far as it does unsplit.
        assert 0 < rank["sharded_from_fp32"] <= 2 * rank["unsplit_from_fp32"]


@pytest.mark.distributed
def test_a_bad_degree_nothing_to_shard_and_indivisible_heads_are_refused_on_every_rank():
    for rank in run_world(workers.refusals, 4, timeout_s=300):
        assert "tensor_parallel=3 x data_parallel=1 does not divide the world size 4" in rank["degree"]
        assert "cannot shard _Normed: nothing to shard" in rank["nothing"]
        assert "3 attention heads (group 0) do not divide by tp=2" in rank["heads"]
        assert "selective checkpointing allows one backward per region" in rank["selective_split_backward"]
        if "tied_head" in rank:  # transformers is installed
            assert "cannot shard the output layer's lm_head.weight: it is tied to transformer.wte.weight" \
                in rank["tied_head"]


@pytest.mark.distributed
def test_a_sequence_parallel_pp2_tp2_checkpoint_resumes_model_and_optimizer_at_pp4_and_loads_into_the_unsplit_model(
        tmp_path):
    import torch.distributed.checkpoint as dcp

    ranks = run_world(workers.resume_run, 4, "fused", str(tmp_path / "pp2tp2"), True, timeout_s=300)
    for rank in ranks:  # the pp 4 pipeline's second AdamW step is the pp 2 x tp 2 one's
        assert rank["resumed_second"] == pytest.approx(rank["second"], abs=TOL)
        assert rank["worst_after"] <= TOL
    loaded, _ = workers._model("fused", layers=4)
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()  # whatever the load leaves unset would show
    state = loaded.state_dict()
    with warnings.catch_warnings():  # torch says it assumes a single process: it is one, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(tmp_path / "pp2tp2"))
    for name, p in ranks[0]["saved"].items():
        torch.testing.assert_close(state[name], p, rtol=0, atol=0)


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


def test_loss_parallel_without_tensor_parallelism_is_refused_before_anything_runs():
    from autopipe import DataParallelOptions
    from autopipe.runtime import Pipeline

    model, args = workers._model("seed_transformer")
    with pytest.raises(ValueError, match=r"loss_parallel=True\) shards over the tensor-parallel"):
        Pipeline(model, example_args=args, loss_fn=workers._cross_entropy,
                 data_parallel=DataParallelOptions(loss_parallel=True))


class _Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_a_matrix_whose_module_does_more_than_one_product_is_refused_naming_it():
    model = nn.Sequential(_Doubled(4, 8), nn.ReLU(), nn.Linear(8, 4))
    exported = torch.export.export(model, (torch.randn(2, 4),))
    plan = find_tensor_parallel(exported)
    assert [m.shard for m in plan.sharded()] == ["column", "row"]
    with pytest.raises(ValueError, match="0 does not run one matrix product on its own weight"):
        parallelize_stage(torch.export.unflatten(exported), _Mesh(2), plan)


@pytest.mark.distributed
def test_in_eval_mode_a_model_with_dropout_traces_sharded_stages_that_forward_as_the_unsplit_model():
    ranks = run_world(workers.eval_run, 4, timeout_s=300)
    last = [r for r in ranks if r]
    assert len(last) == 2  # both ranks of the last stage's tensor-parallel group
    for rank in last:  # dropout makes the eval-mode trace another one
        assert rank["traced_worst"] <= TOL and rank["short_worst"] <= TOL
