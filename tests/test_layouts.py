"""Layouts at scale: a block's sharded costs against hand counts, memory per rank against the
sharded tensors' sizes, the schedule's closed form against the simulator, and the search
against brute force."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from autopipe.layouts.blocks import (activation_bytes, block_flops, block_matmuls, block_params_per_rank,
                                     tp_collectives, tp_divides)
from autopipe.layouts.gpu import GpuCosts
from autopipe.layouts.layout import Layout
from autopipe.layouts.search import candidate_layouts, search_layouts
from autopipe.layouts.shapes import TransformerShape, megatron_gpt
from autopipe.layouts.step import predict_step
from autopipe.machine.topology import Topology
from autopipe.planning.simulator import simulate

LLAMA_8B = TransformerShape.named("llama3-8b")
H100 = GpuCosts("H100", Topology(gpus_per_node=8, intra="nvlink4", inter="ib-ndr"))


# ----------------------------------------------------------------------------- one block, counted by hand


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_llama_blocks_flops_at_tp_are_the_hand_count_over_tp(tp):
    h, kv, f, s = 4096, 8 * 128, 14336, 8192
    # q, k and v, attention output, gate and up, down: 2 FLOPs per weight and token.
    by_hand = 2 * (h * h + 2 * kv * h + h * h + 2 * f * h + h * f)
    flops = block_flops(LLAMA_8B, tp)
    assert flops["matmul"] == pytest.approx(by_hand / tp)
    # Scores (q k^T) and weighted values: 2 x 2 x seq x hidden per token, over the heads a rank holds.
    assert flops["attention"] == pytest.approx(4 * s * h / tp)
    assert block_flops(LLAMA_8B, tp, causal_skip=True)["attention"] == pytest.approx(2 * s * h / tp)


def test_the_column_and_row_shards_are_megatrons():
    shards = {m.name: (m.shard, m.shape_at(4)) for m in block_matmuls(LLAMA_8B)}
    assert shards == {"q": ("column", (1024, 4096)), "kv": ("column", (512, 4096)), "out": ("row", (4096, 1024)),
                      "gate_up": ("column", (7168, 4096)), "down": ("row", (4096, 3584))}


def test_tensor_parallelism_adds_two_collectives_each_way_and_two_more_under_full_recomputation():
    assert tp_collectives(1, recompute="full") == {"forward": 0, "backward": 0}
    assert tp_collectives(8, recompute="none") == {"forward": 2, "backward": 2}
    assert tp_collectives(8, recompute="full") == {"forward": 2, "backward": 4}
    # Each moves the micro-batch's tokens x hidden activation: the step charges it on the in-node link.
    layout = Layout(tp=8, micro_batch=1, global_batch=1, sequence_parallel=True)
    p = predict_step(LLAMA_8B, layout, H100)
    one = H100.allreduce_s(8192 * 4096 * 2, 8, crosses_nodes=False)
    assert p.parts_s["tp_comm"] == pytest.approx(32 * 4 * one)


def test_heads_that_do_not_divide_name_the_degree():
    assert tp_divides(LLAMA_8B, 16) == "8 key-value heads do not divide by tp=16"
    odd = megatron_gpt(4, 768, 12)
    assert "12 attention heads do not divide by tp=8" == tp_divides(odd, 8)
    with pytest.raises(ValueError, match="cannot run .* heads do not divide by tp=8"):
        predict_step(odd, Layout(tp=8), H100)


# ----------------------------------------------------------------------------- memory per rank


def _sharded_block_numel(shape: TransformerShape, tp: int) -> int:
    """Elements a rank holds of one block, from the meta tensors Megatron's sharding leaves it."""
    torch = pytest.importorskip("torch")
    total = 0
    for m in block_matmuls(shape):
        weight = torch.empty(m.out_features, m.in_features, device="meta")
        dim = 0 if m.shard == "column" else 1
        total += torch.chunk(weight, tp, dim=dim)[0].numel()
        if shape.kind == "gpt":  # a column-parallel bias is sharded, a row-parallel one whole
            bias = torch.empty(m.out_features, device="meta")
            total += torch.chunk(bias, tp)[0].numel() if m.shard == "column" else bias.numel()
    norms = 2 * shape.hidden * (2 if shape.kind == "gpt" else 1)
    return total + norms


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [LLAMA_8B, megatron_gpt(4, 1024, 16)], ids=["llama", "gpt"])
def test_parameters_per_rank_are_the_sharded_tensors_sizes(shape, tp):
    assert block_params_per_rank(shape, tp) == pytest.approx(_sharded_block_numel(shape, tp))


def test_a_meta_llama_from_hugging_face_has_the_parameters_its_shape_counts():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shape = TransformerShape.from_hf_config(config.to_dict())
    assert shape.params() == sum(p.numel() for p in model.parameters())
    assert shape.block_params() == sum(p.numel() for p in model.model.layers[0].parameters())


def test_activations_follow_korthikanti_for_a_gpt_block():
    gpt = megatron_gpt(4, 1024, 16, seq_len=2048)
    h, a, s = 1024, 16, 2048
    # 34 h + 5 a s bytes per token without parallelism (Korthikanti et al. 2022, Eq. 1).
    assert activation_bytes(gpt, 1, recompute="none", sequence_parallel=False, flash=False) == pytest.approx(34 * h + 5 * a * s)
    # Tensor parallelism alone leaves 10 h replicated; with sequence parallelism all of it divides.
    assert activation_bytes(gpt, 8, recompute="none", sequence_parallel=False, flash=False) == \
        pytest.approx(10 * h + 24 * h / 8 + 5 * a * s / 8)
    # Korthikanti's count with sequence parallelism assumes Megatron-LM gathers the norm outputs again.
    assert activation_bytes(gpt, 8, recompute="selective", sequence_parallel=True, flash=False,
                            sp_regather=True) == pytest.approx(34 * h / 8)
    # torch's tensor-parallel API keeps them as gathered: 4h bytes stay whole.
    assert activation_bytes(gpt, 8, recompute="selective", sequence_parallel=True, flash=False) == \
        pytest.approx(30 * h / 8 + 4 * h)
    assert activation_bytes(gpt, 8, recompute="full", sequence_parallel=True, flash=False) == pytest.approx(2 * h / 8)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_llama_blocks_kept_bytes_are_the_hand_count(tp):
    s = TransformerShape.named("llama3-8b")
    h, f, kv = s.hidden, s.ffn, s.kv_width
    sp = tp > 1
    seq = h / tp if sp else h  # a tensor sharded along the sequence under sequence parallelism
    # No checkpointing: both norm inputs, both norm outputs as the column-parallel projections
    # gathered them (whole), q, k, v and the attention output, gate, up, activation, product.
    none = 2 * (2 * seq + 2 * h + (2 * h + 2 * kv) / tp + 4 * f / tp)
    assert activation_bytes(s, tp, recompute="none", sequence_parallel=sp, flash=True) == pytest.approx(none)
    # torchtitan's op-level policy: the input, q, v, the attention output, gate, and down before its reduction.
    selective = 2 * (seq + (h + kv + h + f) / tp + h)
    assert activation_bytes(s, tp, recompute="selective", sequence_parallel=sp, flash=True) == pytest.approx(selective)
    assert activation_bytes(s, tp, recompute="full", sequence_parallel=sp, flash=True) == pytest.approx(2 * seq)


def test_checkpointing_more_blocks_needs_less_memory_and_more_time():
    base = Layout(pp=4, dp=2, micro_batch=1, global_batch=32, dp_mode="fsdp")
    none, some, every = (predict_step(LLAMA_8B, replace(base, recompute="full", recompute_layers=k), H100)
                         for k in (0, 4, None))
    assert none.memory_bytes > some.memory_bytes > every.memory_bytes
    assert none.step_s < some.step_s < every.step_s
    assert none.parts_s["recompute"] == 0 and every.parts_s["recompute"] > some.parts_s["recompute"] > 0


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2)])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_the_pipeline_time_charged_equals_the_simulators_for_equal_stages(schedule, v, pp, m):
    # A tiny vocabulary: the output layer adds next to nothing to the last stage, so stages are equal.
    shape = TransformerShape(layers=16, hidden=512, heads=8, ffn=2048, vocab=8, seq_len=128, tied=True)
    p = predict_step(shape, Layout(pp=pp, micro_batch=1, global_batch=m, schedule=schedule, virtual_stages=v), H100)
    charged = p.parts_s["compute"] + p.parts_s["pp_comm"] + p.parts_s["bubble"]
    # compute and sends are the fullest rank's: per micro-batch, v stages' forward and backward
    per_stage = (p.parts_s["compute"] + p.parts_s["pp_comm"]) / m / v
    sim = simulate([per_stage / 3] * (pp * v), [2 * per_stage / 3] * (pp * v), schedule=schedule, n_microbatches=m,
                   stages_per_rank=v)
    assert charged == pytest.approx(sim.step_s, rel=0.03)


def test_interleaving_shrinks_the_bubble():
    base = Layout(tp=8, pp=8, dp=1, micro_batch=1, global_batch=16, recompute="full", sequence_parallel=True)
    one = predict_step(TransformerShape.named("llama3-405b"), base, H100)
    two = predict_step(TransformerShape.named("llama3-405b"), replace(base, schedule="Interleaved1F1B",
                                                                       virtual_stages=2), H100)
    assert two.parts_s["bubble"] < one.parts_s["bubble"] and two.step_s < one.step_s


# ----------------------------------------------------------------------------- the search


def _brute_force(shape, n_gpus, global_batch, gpu):
    best = None
    for layout in candidate_layouts(shape, n_gpus, global_batch, gpu.topology.gpus_per_node, base=Layout()):
        try:
            p = predict_step(shape, layout, gpu)
        except ValueError:
            continue
        blocks = math.ceil(shape.layers / (layout.pp * layout.virtual_stages)) * layout.virtual_stages
        options = [p] + ([predict_step(shape, replace(layout, recompute_layers=k), gpu) for k in range(blocks)]
                         if layout.recompute == "full" else [])
        for q in options:
            if q.memory_bytes <= gpu.memory_bytes and (best is None or q.step_s < best.step_s):
                best = q
    return best


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(2, 12), heads=st.sampled_from([4, 8, 12]), width=st.sampled_from([64, 128]),
       n_gpus=st.sampled_from([2, 4, 8, 16]), batch_per_gpu=st.sampled_from([1, 2, 4]),
       memory_gb=st.sampled_from([0.05, 0.2, 80]))
def test_the_search_finds_the_brute_forces_fastest_layout(layers, heads, width, n_gpus, batch_per_gpu, memory_gb):
    shape = TransformerShape(layers=layers, hidden=heads * width, heads=heads, ffn=4 * heads * width, vocab=512,
                             seq_len=256, kind="gpt")
    gpu = GpuCosts("A100", Topology(gpus_per_node=4, intra="nvlink3", inter="ib-hdr"), memory_bytes=memory_gb * 1e9)
    gb = n_gpus * batch_per_gpu
    brute = _brute_force(shape, n_gpus, gb, gpu)
    found = search_layouts(shape, n_gpus, global_batch=gb, gpu=gpu)
    if brute is None:
        assert not found.ranked
        with pytest.raises(ValueError, match="no layout .* fits in memory"):
            found.best
    else:
        assert found.best.step_s == pytest.approx(brute.step_s)
        assert found.best.memory_bytes <= gpu.memory_bytes


def test_the_search_keeps_the_faster_layouts_first_and_says_why_the_others_lose():
    found = search_layouts(TransformerShape.named("llama3-70b"), 64, global_batch=128, gpu=H100)
    speeds = [p.tokens_per_s_per_gpu for p in found.ranked]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 10
    assert all(p.memory_bytes <= H100.memory_bytes for p in found.ranked)
    assert found.why_slower(found.ranked[-1]) != "as fast"
    assert found.considered > found.over_memory > 0


# ----------------------------------------------------------------------------- inputs


def test_shapes_come_from_hugging_face_configs_and_names():
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 32}
    shape = TransformerShape.from_hf_config(cfg)
    assert (shape.layers, shape.kv_heads, shape.kind, shape.seq_len) == (2, 2, "llama", 32)
    with pytest.raises(ValueError, match="model_type='t5' is not a decoder-only"):
        TransformerShape.from_hf_config({"model_type": "t5"})
    with pytest.raises(ValueError, match="name='llama9' is not a known shape"):
        TransformerShape.named("llama9")


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 0}, "Layout tp"),
    ({"schedule": "ZBV"}, "Layout schedule"),
    ({"virtual_stages": 2}, "needs schedule='Interleaved1F1B'"),
    ({"dp": 4, "global_batch": 6}, "global_batch=6 must divide by dp x micro_batch"),
    ({"recompute": "some"}, "Layout recompute"),
])
def test_a_bad_layout_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


# ----------------------------------------------------------------------------- exports

from autopipe.layouts.exports import megatron_arguments, pipeline_options, torchtitan_fields  # noqa: E402


def test_torchtitans_fields_carry_every_degree_and_the_checkpointing():
    shape = TransformerShape.named("llama3-70b")
    layout = Layout(tp=8, pp=2, dp=4, micro_batch=2, global_batch=64, dp_mode="fsdp", recompute="full",
                    sequence_parallel=True, float8=True, async_tp=True, compiled=True)
    fields = torchtitan_fields(layout, shape)
    assert fields["parallelism"] == {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 4,
                                     "tensor_parallel_degree": 8, "enable_sequence_parallel": True,
                                     "pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B",
                                     "pipeline_parallel_microbatch_size": 2, "pipeline_parallel_layers_per_stage": 40}
    assert fields["activation_checkpoint"] == "full"
    assert fields["training"] == {"local_batch_size": 16, "global_batch_size": 64, "seq_len": 8192}
    assert fields["compile"] == {"enable": True, "enable_async_tensor_parallel": True}
    assert fields["model_converters"] == ["Float8LinearConverter"]
    with pytest.raises(ValueError, match="recompute_layers=3: torchtitan 0.3.0 checkpoints every block"):
        torchtitan_fields(replace(layout, recompute_layers=3), shape)
    with pytest.raises(ValueError, match="dp_mode='zero1' has no torchtitan equivalent"):
        torchtitan_fields(replace(layout, dp_mode="zero1"), shape)
    with pytest.raises(ValueError, match="sp_regather=True: torchtitan keeps the inputs"):
        torchtitan_fields(replace(layout, sp_regather=True), shape)


def test_megatrons_arguments_carry_every_degree_and_the_checkpointing():
    shape = TransformerShape.named("llama3-70b")
    layout = Layout(tp=4, pp=4, dp=2, micro_batch=1, global_batch=32, schedule="Interleaved1F1B", virtual_stages=5,
                    recompute="full", recompute_layers=2, sequence_parallel=True, dp_mode="zero1")
    args = " ".join(megatron_arguments(layout, shape))
    for expected in ("--tensor-model-parallel-size 4", "--pipeline-model-parallel-size 4",
                     "--virtual-pipeline-model-parallel-size 5", "--sequence-parallel",
                     "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
                     "--micro-batch-size 1", "--global-batch-size 32", "--use-distributed-optimizer"):
        assert expected in args
    with pytest.raises(ValueError, match="does not divide the 80 blocks"):
        megatron_arguments(replace(layout, virtual_stages=3), shape)


def test_a_pipelines_options_carry_every_degree_the_micro_batches_and_the_checkpointing():
    layout = Layout(tp=4, pp=4, dp=2, micro_batch=2, global_batch=64, schedule="Interleaved1F1B", virtual_stages=2,
                    recompute="selective", sequence_parallel=True, dp_mode="fsdp", compiled=True)
    options = pipeline_options(layout)
    assert (options["schedule"], options["n_microbatches"], options["stages_per_rank"]) == ("Interleaved1F1B", 16, 2)
    replicas = options["data_parallel"]
    assert (replicas.degree, replicas.mode, replicas.tensor_parallel) == (2, "fsdp", 4)
    assert replicas.loss_parallel and replicas.sequence_parallel  # the output layer charged vocabulary-sharded
    assert (options["planner"].recompute, options["planner"].compile) == ("selective", True)
    assert pipeline_options(replace(layout, recompute="none"))["planner"].recompute is False
    for change, named in (({"dp_mode": "zero1"}, "dp_mode='zero1'"), ({"float8": True}, "float8=True"),
                          ({"async_tp": True}, "async_tp=True"), ({"sp_regather": True}, "sp_regather=True"),
                          ({"recompute_layers": 3}, "recompute_layers=3")):
        with pytest.raises(ValueError, match=f"Layout {named}: autopipe.Pipeline does not run it"):
            pipeline_options(replace(layout, **change))


def test_a_predicted_step_exports_its_own_layout_and_shape():
    shape, gpu = TransformerShape.named("llama3-70b"), GpuCosts("H100", Topology(gpus_per_node=8))
    layout = Layout(tp=8, pp=2, dp=4, micro_batch=1, global_batch=64, dp_mode="fsdp", recompute="full")
    p = predict_step(shape, layout, gpu)
    assert p.to_torchtitan() == torchtitan_fields(layout, shape)
    assert p.to_megatron() == megatron_arguments(layout, shape)
    assert p.to_pipeline()["data_parallel"] == pipeline_options(layout)["data_parallel"]
    with pytest.raises(ValueError, match="zero1' has no torchtitan equivalent"):
        predict_step(shape, replace(layout, dp_mode="zero1"), gpu).to_torchtitan()


#: Megatron-LM's own training arguments, beside megatron-core's config fields.
MEGATRON_TRAINING_ARGUMENTS = {"--micro-batch-size", "--global-batch-size", "--seq-length", "--use-flash-attn",
                               "--use-torch-fsdp2", "--fp8-format"}


def test_megatron_core_knows_every_parallelism_and_recomputation_argument_exported():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for c in (TransformerConfig, DistributedDataParallelConfig, OptimizerConfig)
              for f in dataclasses.fields(c)}
    layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, global_batch=8, schedule="Interleaved1F1B", virtual_stages=2,
                    recompute="full", recompute_layers=2, sequence_parallel=True, dp_mode="zero1", float8=True)
    flags = [a for a in megatron_arguments(layout, TransformerShape.named("llama3-8b")) if a.startswith("--")]
    core = [f for f in flags if f not in MEGATRON_TRAINING_ARGUMENTS]
    assert len(core) >= 8
    assert {f[2:].replace("-", "_") for f in core} <= fields, {f for f in core if f[2:].replace("-", "_") not in fields}
    assert "fp8" in fields  # --fp8-format sets TransformerConfig.fp8


def test_torchtitan_knows_every_field_exported():
    pytest.importorskip("torchtitan.config.configs", reason="torchtitan 0.3.0 is not installed")
    activation_checkpoint = pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    import dataclasses
    import importlib.util
    from pathlib import Path

    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig

    layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, global_batch=8, recompute="selective", sequence_parallel=True,
                    dp_mode="fsdp", float8=True, compiled=True, async_tp=True)
    fields = torchtitan_fields(layout, TransformerShape.named("llama3-8b"))
    for section, config in (("parallelism", ParallelismConfig), ("training", TrainingConfig),
                            ("compile", CompileConfig)):
        names = {f.name for f in dataclasses.fields(config)}
        assert set(fields[section]) <= names, (section, set(fields[section]) - names)
    for policy, cls in (("selective", "SelectiveAC"), ("full", "FullAC")):
        assert hasattr(activation_checkpoint, cls), policy
    # Read, not imported: the float8 module needs triton, which CPU machines lack.
    float8 = Path(importlib.util.find_spec("torchtitan.components.quantization").submodule_search_locations[0])
    assert all(f"class {name}(" in (float8 / "float8.py").read_text() for name in fields["model_converters"])


# ----------------------------------------------------------------------------- calibration

from autopipe.layouts.calibrate import block_seconds, calibrate_on_block  # noqa: E402
from autopipe.layouts.gpu import Efficiency  # noqa: E402


def test_calibrating_on_a_block_recovers_the_shares_it_was_timed_at():
    # A "measurement" made at known shares: the calibration finds them again from the default ones.
    truth = H100.with_efficiency(Efficiency(gemm={"H100": 0.3}))  # the default ratios between kernels
    measured = block_seconds(LLAMA_8B, truth, tokens=4096)
    calibrated = calibrate_on_block(H100, LLAMA_8B, tokens=4096, measured_s=measured)
    assert calibrated.efficiency.gemm_share("H100") == pytest.approx(0.3, rel=1e-3)
    assert block_seconds(LLAMA_8B, calibrated, tokens=4096) == pytest.approx(measured, rel=1e-6)
    assert H100.efficiency.gemm_share("H100") == Efficiency().gemm_share("H100")  # the costs given are unchanged
    # Every layout is then charged at the calibrated speed.
    layout = Layout(dp=8, micro_batch=1, global_batch=8, dp_mode="fsdp")
    assert predict_step(LLAMA_8B, layout, calibrated).step_s > predict_step(LLAMA_8B, layout, H100).step_s


@pytest.mark.parametrize("measured, message", [(0.0, "must be seconds > 0"), (1e-9, "faster than H100's data sheet")])
def test_a_measurement_that_cannot_be_this_block_is_refused(measured, message):
    with pytest.raises(ValueError, match=message):
        calibrate_on_block(H100, LLAMA_8B, tokens=4096, measured_s=measured)
