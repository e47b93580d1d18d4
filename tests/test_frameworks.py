"""Plans for a framework's stages: cut only where it can, and the split in its own config words."""

from __future__ import annotations

import pytest
import torch

import autopipe
from autopipe import PlannerOptions, ProfileOptions
from autopipe.models import seed_transformer
from autopipe.planning import SegmentCost, profile_segments, trace
from autopipe.planning.frameworks import restrict_to_target, target_units, toml
from autopipe.planning.tracing import traces_reused

QUIET = ProfileOptions(progress=False)
TITAN = PlannerOptions(target="torchtitan", cost="flops", profiling=QUIET)


@pytest.fixture(scope="module", autouse=True)
def _one_trace_per_model():
    """Every plan of one model here is made from its first trace (no test changes a model's modules or
    modes): what these tests compare is where each framework may cut."""
    with traces_reused():
        yield


@pytest.fixture(scope="module")
def model_and_args():
    # Three equal blocks and a light head: torch's own split points balance 2 stages inside the middle block.
    return seed_transformer(vocab_size=100, d_model=64, num_heads=4, d_ff=128, num_layers=3, batch=2, seq_len=16)


def test_torchtitans_units_are_the_models_children_and_its_layer_entries(model_and_args):
    model, _ = model_and_args
    units = target_units(model)
    assert {"embedding", "layers.0", "layers.2", "out_linear"} <= units
    assert "layers" not in units and not any(u.startswith("layers.0.") for u in units)


def test_a_torchtitan_plan_cuts_only_before_a_unit_and_exports_each_stages_modules(model_and_args):
    model, args = model_and_args
    free = autopipe.partition(model, 2, args, planner=PlannerOptions(cost="flops", profiling=QUIET))
    assert any(p not in target_units(model) for p in free.split_points)  # the premise: torch would cut inside
    plan = autopipe.partition(model, 2, args, n_microbatches=4,
                              planner=PlannerOptions(target="torchtitan", cost="flops", global_batch=8, profiling=QUIET))
    assert plan.target == "torchtitan" and set(plan.split_points) <= target_units(model)
    config = plan.to_torchtitan()
    parts = config["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == 2 and parts[0][0] == "embedding" and parts[-1][-1] == "out_linear"
    assert parts[1][0] == plan.split_points[0]  # the second stage starts where the plan cuts
    assert sorted(n for part in parts for n in part if n.startswith("layers.")) == [f"layers.{k}" for k in range(3)]
    assert config["parallelism"]["pipeline_parallel_degree"] == 2
    assert config["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert config["parallelism"]["pipeline_parallel_microbatch_size"] == args[0].shape[0]
    assert sum(config["autopipe"]["layers_per_stage"]) == 3
    default = plan.baseline("torchtitan_default")
    gain = default.predicted_step_s / plan.predicted_step_s - 1
    assert gain >= -1e-9 and f"versus torchtitan's default split {default.split_points}: predicted {gain:.0%} faster" \
        in plan.report()
    assert "versus torchtitan" not in free.report()


def test_a_looped_schedule_exports_every_stage_in_order(model_and_args):
    model, args = model_and_args
    plan = autopipe.partition(model, 2, args, schedule="Interleaved1F1B", n_microbatches=4, planner=TITAN)
    parts = plan.to_torchtitan()["parallelism"]["module_fqns_per_model_part"]
    assert len(parts) == 4 == plan.num_stages
    # No global batch given: the micro-batch is the traced example.
    assert plan.to_torchtitan()["parallelism"]["pipeline_parallel_microbatch_size"] == args[0].shape[0]
    assert [n for part in parts for n in part] == [n for stage in plan.stages for n in stage.fqns]


def test_the_target_is_kept_in_the_plan_file(model_and_args, tmp_path):
    model, args = model_and_args
    plan = autopipe.partition(model, 2, args, planner=TITAN)
    plan.save(tmp_path / "plan.json")
    assert autopipe.Plan.load(tmp_path / "plan.json").to_torchtitan() == plan.to_torchtitan()


def test_what_a_torchtitan_plan_cannot_be_made_from_is_refused(model_and_args):
    model, args = model_and_args
    free = autopipe.partition(model, 2, args, planner=PlannerOptions(cost="flops", profiling=QUIET))
    with pytest.raises(ValueError, match="plan with PlannerOptions\\(target='torchtitan'\\)"):
        free.to_torchtitan()
    three = [SegmentCost(fwd_s=1e-3, bwd_s=2e-3, param_bytes=0, act_bytes=0, out_bytes=0)] * 3
    with pytest.raises(ValueError, match="plans 6 segments \\(or .* at torch's split points\\), but the profile "
                                         "given as cost= has 3"):
        autopipe.partition(model, 2, args, planner=PlannerOptions(target="torchtitan", cost=three, profiling=QUIET))
    with pytest.raises(ValueError, match="PlannerOptions target='accelerate' is not known; use one of \\['torchtitan', "):
        PlannerOptions(target="accelerate")


def test_a_profile_at_torchs_split_points_is_summed_into_the_frameworks_units(model_and_args):
    from autopipe.planning.profile import coarsened

    model, args = model_and_args
    traced = trace(model, args)
    profile = profile_segments(traced, cost="flops", device_flops=1e9, progress=False)
    titan = restrict_to_target(traced, model, "torchtitan")
    merged = coarsened(profile, traced, titan)
    assert len(merged) == titan.num_segments < len(profile)
    for field in ("fwd_s", "bwd_s", "flops", "param_bytes", "act_bytes"):
        assert sum(getattr(c, field) for c in merged) == pytest.approx(sum(getattr(c, field) for c in profile))
    assert merged[-1].out_bytes == profile[-1].out_bytes
    # Planning from the fine profile gives the plan the framework's own profile gives.
    for n, schedule in ((2, "1F1B"), (2, "Interleaved1F1B"), (4, "1F1B")):
        from_fine = autopipe.partition(profile, n, schedule=schedule, n_microbatches=4,
                                       planner=PlannerOptions(target="torchtitan"))
        direct = autopipe.partition(model, n, args, schedule=schedule, n_microbatches=4,
                                    planner=PlannerOptions(target="torchtitan", cost=merged, profiling=QUIET))
        assert from_fine.split_points == direct.split_points
        assert from_fine.predicted_step_s == pytest.approx(direct.predicted_step_s)


def test_the_micro_batch_count_is_chosen_at_the_frameworks_granularity(model_and_args):
    model, args = model_and_args
    titan = target_units(model)
    plan = autopipe.partition(model, 2, args, n_microbatches="auto",
                              planner=PlannerOptions(target="torchtitan", cost="flops", global_batch=8,
                                                     profiling=QUIET))
    assert plan.n_microbatches in (1, 2, 4, 8) and all(p in titan for p in plan.split_points)
    assert plan.to_torchtitan()["parallelism"]["pipeline_parallel_microbatch_size"] == 8 // plan.n_microbatches
    # The same count asked for directly, with one micro-batch of the size it implies, splits alike.
    micro_batch = torch.cat([args[0]] * 4)[: 8 // plan.n_microbatches]
    fixed = autopipe.partition(model, 2, (micro_batch,), n_microbatches=plan.n_microbatches,
                               planner=PlannerOptions(target="torchtitan", cost="flops", profiling=QUIET))
    assert fixed.split_points == plan.split_points


def test_restricting_merges_the_segments_between_the_cuts_kept(model_and_args):
    model, args = model_and_args
    traced = trace(model, args)
    titan = restrict_to_target(traced, model, "torchtitan")
    assert titan.num_segments < traced.num_segments
    assert [s.start for s in titan.segments][0] == 0 and titan.segments[-1].end == traced.segments[-1].end
    assert all(a.end == b.start for a, b in zip(titan.segments, titan.segments[1:]))


def test_toml_writes_sections_of_values_and_lists():
    text = toml({"parallelism": {"pipeline_parallel_schedule": "1F1B", "module_fqns_per_model_part": [["a"], ["b"]]}})
    assert text == '[parallelism]\npipeline_parallel_schedule = "1F1B"\nmodule_fqns_per_model_part = [["a"], ["b"]]'


def test_the_toml_text_reads_back_as_the_config_fields(model_and_args):
    import tomllib

    model, args = model_and_args
    plan = autopipe.partition(model, 2, args, n_microbatches=4, planner=TITAN)
    text = plan.to_torchtitan(as_toml=True)
    assert tomllib.loads(text) == {"parallelism": plan.to_torchtitan()["parallelism"]}
    assert "# layers_per_stage: " in text and "# versus torchtitan's default split" in text


def test_the_command_line_prints_the_config_to_paste(capsys):
    from autopipe.cli.main import main

    assert main(["plan", "autopipe.models:seed_transformer", "--set", "vocab_size=500", "--set", "num_layers=2",
                 "--set", "seq_len=8", "--gpus", "2", "--cost", "flops", "--target", "torchtitan", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[parallelism]" in out and "module_fqns_per_model_part = [[" in out and "# layers_per_stage:" in out
    assert "# versus torchtitan's default split" in out


class TitanStyle(torch.nn.Module):
    """A decoder written as torchtitan writes its models: a forward that skips the children a stage lacks."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleDict({str(k): torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                                                        torch.nn.Linear(2 * dim, dim))
                                           for k in range(layers)})
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = h + layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def test_torchtitans_own_splitter_builds_the_exported_stages_and_they_chain_to_the_whole_model():
    pipeline_parallel = pytest.importorskip(
        "torchtitan.distributed.pipeline_parallel",
        reason="torchtitan is not importable here (pip install torchtitan==0.3.0 triton next to torch)")
    torch.manual_seed(0)
    model, tokens = TitanStyle(), torch.randint(0, 64, (2, 8))
    plan = autopipe.partition(model, 2, (tokens,), schedule="Interleaved1F1B", n_microbatches=4, planner=TITAN)
    parts = plan.to_torchtitan()["parallelism"]["module_fqns_per_model_part"]
    chunks = [pipeline_parallel._split_module(model, names) for names in parts]
    h = tokens
    for chunk in chunks:
        h = chunk(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    held = [{n for n, _ in chunk.named_parameters()} for chunk in chunks]
    assert set().union(*held) == {n for n, _ in model.named_parameters()} and sum(map(len, held)) == len(
        list(model.parameters()))  # every parameter on exactly one stage


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_torchtitans_own_llama3_and_qwen3_split_by_the_export_train_like_the_unsplit_model(family, schedule):
    pytest.importorskip("torchtitan.distributed.pipeline_parallel",
                        reason="torchtitan is not importable here (pip install torchtitan==0.3.0 triton next to torch)")
    from _dist_utils import run_world
    from _frameworks_workers import torchtitan_step

    results = run_world(torchtitan_step, 2, family, schedule, timeout_s=300)
    assert results[0]["parts"] == results[1]["parts"] and len(results[0]["parts"]) == (
        4 if schedule == "Interleaved1F1B" else 2)
    held = [set(r["grad_diff"]) for r in results]
    assert not held[0] & held[1] and held[0] | held[1] == set(results[0]["all"])  # every parameter on one rank
    assert abs(results[1]["loss"] - results[1]["ref_loss"]) <= 1e-5
    for r in results:
        assert max(r["grad_diff"].values()) <= 1e-5, r["grad_diff"]


# --------------------------------------------------------------------------- Megatron-Core

MEGATRON = PlannerOptions(target="megatron", cost="flops", profiling=QUIET)


@pytest.fixture(scope="module")
def six_layers():
    return seed_transformer(vocab_size=100, d_model=64, num_heads=4, d_ff=128, num_layers=6, batch=2, seq_len=16)


@pytest.mark.parametrize("schedule, n_ranks", [("1F1B", 2), ("Interleaved1F1B", 2), ("1F1B", 3)])
def test_a_megatron_plan_cuts_between_whole_layers_and_names_them_in_a_layout(six_layers, schedule, n_ranks):
    model, args = six_layers
    plan = autopipe.partition(model, n_ranks, args, schedule=schedule, n_microbatches=6, planner=MEGATRON)
    assert plan.target == "megatron" and set(plan.split_points) <= {f"layers.{k}" for k in range(6)} | {"out_linear"}
    config = plan.to_megatron()
    stages = config["pipeline_model_parallel_layout"].split("|")
    assert len(stages) == plan.num_stages and stages[0].startswith("E") and stages[-1].endswith("L")
    assert [s.count("t") for s in stages] == [sum(n.startswith("layers.") for n in st.fqns) for st in plan.stages]
    assert config["num_layers"] == 6 and config["pipeline_model_parallel_size"] == n_ranks
    assert config.get("virtual_pipeline_model_parallel_size", 1) == plan.stages_per_rank


def test_megatron_cores_own_parser_reads_the_layout(six_layers):
    layout_module = pytest.importorskip(
        "megatron.core.transformer.pipeline_parallel_layer_layout",
        reason="megatron-core is not importable here (pip install --no-deps megatron-core)")
    model, args = six_layers
    plan = autopipe.partition(model, 2, args, schedule="Interleaved1F1B", n_microbatches=4, planner=MEGATRON)
    config = plan.to_megatron()
    layout = layout_module.PipelineParallelLayerLayout(config["pipeline_model_parallel_layout"],
                                                       config["pipeline_model_parallel_size"])
    layout.validate_layer_layout(config["num_layers"], None)
    assert layout.virtual_pipeline_model_parallel_size == plan.stages_per_rank
    # Megatron's rank r, virtual stage v is the plan's stage v * pp + r, as the plan places it.
    for r, rank_stages in enumerate(layout.layout):
        for v, layers in enumerate(rank_stages):
            stage = plan.stages[v * config["pipeline_model_parallel_size"] + r]
            assert plan.stage_ranks[stage.index] == r
            assert sum(str(t).endswith("decoder") for t in layers) == sum(n.startswith("layers.") for n in stage.fqns)


def test_what_a_megatron_layout_cannot_say_is_refused(six_layers):
    model, args = six_layers
    v_plan = autopipe.partition(model, 2, args, schedule="ZBVZeroBubble", n_microbatches=4, planner=MEGATRON)
    with pytest.raises(ValueError, match="places stages in a V"):
        v_plan.to_megatron()
    with pytest.raises(ValueError, match="plan with PlannerOptions\\(target='megatron'\\)"):
        autopipe.partition(model, 2, args, planner=TITAN).to_megatron()
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no layer container"):
        autopipe.partition(flat, 2, (torch.randn(2, 4),), planner=MEGATRON)


class _EncoderDecoder(torch.nn.Module):
    """Two stacks of layers, as T5 or BART have: an encoder's and a decoder's."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.decoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in [*self.encoder, *self.decoder]:
            x = torch.relu(layer(x))
        return self.head(x)


def test_a_megatron_plan_of_an_encoder_decoder_is_refused_naming_both_stacks(six_layers):
    with pytest.raises(ValueError, match=r"has several: encoder \(3 layers\), decoder \(3 layers\)\. "
                                         r"Megatron-Core's layout cannot express"):
        autopipe.partition(_EncoderDecoder(), 2, (torch.randn(2, 8),), planner=MEGATRON)
    plan = autopipe.partition(six_layers[0], 2, six_layers[1], planner=MEGATRON)
    data = plan.to_dict()
    data["stages"][0]["fqns"] = [*data["stages"][0]["fqns"], "extra.0"]  # a plan file naming a second stack
    with pytest.raises(ValueError, match=r"several containers \(extra, layers\)"):
        autopipe.Plan.from_dict(data).to_megatron()


def test_the_megatron_export_is_the_same_under_every_hash_seed():
    import subprocess
    import sys

    code = ("import autopipe; from autopipe.models import seed_transformer; m, a = seed_transformer(vocab_size=50, "
            "d_model=16, num_heads=2, d_ff=32, num_layers=4, batch=2, seq_len=8); print(autopipe.partition(m, 2, a, "
            "planner=autopipe.PlannerOptions(target='megatron', cost='flops', profiling=autopipe.ProfileOptions("
            "progress=False))).to_megatron())")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**__import__("os").environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1 and "pipeline_model_parallel_layout" in outputs.pop()


def test_the_command_line_prints_megatrons_arguments(capsys):
    from autopipe.cli.main import main

    assert main(["plan", "autopipe.models:seed_transformer", "--set", "vocab_size=500", "--set", "num_layers=4",
                 "--set", "seq_len=8", "--gpus", "2", "--cost", "flops", "--target", "megatron", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "--pipeline-model-parallel-layout 'E" in out and "L' --pipeline-model-parallel-size 2 --num-layers 4" in out


# --------------------------------------------------------------------------- DeepSpeed


def test_a_deepspeed_plan_cuts_between_the_layers_of_the_list_and_gives_the_boundaries():
    from _frameworks_workers import uneven_layers

    layers = uneven_layers()
    plan = autopipe.partition(torch.nn.Sequential(*layers), 2, (torch.randn(4, 16),),
                              planner=PlannerOptions(target="deepspeed", cost="flops", profiling=QUIET))
    parts = plan.to_deepspeed(num_layers=len(layers))["parts"]
    assert parts[0] == 0 and parts[-1] == len(layers) and parts[1] == int(plan.split_points[0])
    assert [str(k) for k in range(parts[1], parts[2])] == plan.stages[1].fqns
    assert parts != [0, 4, 8]  # not the equal count of layers: the wide layers weigh more
    with pytest.raises(ValueError, match="pass it as nn.Sequential"):
        autopipe.partition(TitanStyle(), 2, (torch.randint(0, 64, (2, 8)),),
                           planner=PlannerOptions(target="deepspeed", cost="flops", profiling=QUIET))
    looped = autopipe.partition(torch.nn.Sequential(*layers), 2, (torch.randn(4, 16),), schedule="Interleaved1F1B",
                                n_microbatches=4, planner=PlannerOptions(target="deepspeed", cost="flops",
                                                                          profiling=QUIET))
    with pytest.raises(ValueError, match="one stage per rank"):
        looped.to_deepspeed()


def test_a_deepspeed_plan_of_a_named_sequential_is_refused_with_the_remedy():
    from collections import OrderedDict

    from _frameworks_workers import uneven_layers

    named = torch.nn.Sequential(OrderedDict((f"layer{k}", m) for k, m in enumerate(uneven_layers())))
    with pytest.raises(ValueError, match=r"names its entries \(layer0, layer1, layer2, layer3\): build it as "
                                         r"nn.Sequential\(\*layers\)"):
        autopipe.partition(named, 2, (torch.randn(4, 16),),
                           planner=PlannerOptions(target="deepspeed", cost="flops", profiling=QUIET))
    free = autopipe.partition(named, 2, (torch.randn(4, 16),), planner=PlannerOptions(cost="flops", profiling=QUIET))
    data = free.to_dict()
    data["target"] = "deepspeed"  # a plan file claiming DeepSpeed's granularity
    with pytest.raises(ValueError, match="names its entries"):
        autopipe.Plan.from_dict(data).to_deepspeed()


class _SharedRope(torch.nn.Module):
    """A torchtitan-style model whose one child (``scale``, with a parameter) every layer calls."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + self.scale(layer(x))
        return self.norm(x)


def test_a_torchtitan_plan_never_cuts_between_two_calls_of_one_module():
    plan = autopipe.partition(_SharedRope(), 2, (torch.randn(2, 8),), planner=TITAN)
    assert plan.split_points == ["norm"] and "scale" in plan.to_torchtitan()["parallelism"][
        "module_fqns_per_model_part"][0]
    with pytest.raises(ValueError, match=r"more are not offered: layers\.1 \(scale runs on both sides, and "
                                         r"torchtitan places a module on one stage\)"):
        autopipe.partition(_SharedRope(), 4, (torch.randn(2, 8),), planner=TITAN)


@pytest.mark.distributed
def test_deepspeeds_pipeline_module_holds_on_each_rank_the_layers_the_plan_gave_it():
    pytest.importorskip("deepspeed.pipe", reason="DeepSpeed is not importable here (DS_BUILD_OPS=0 pip install "
                                                 "deepspeed==0.19.8)")
    from _dist_utils import run_world
    from _frameworks_workers import deepspeed_stages

    results = run_world(deepspeed_stages, 2, timeout_s=240)
    parts = results[0]["parts"]
    for rank, r in enumerate(results):
        assert r["parts"] == parts and r["local"] == list(range(parts[rank], parts[rank + 1]))
        assert [str(k) for k in r["local"]] == r["stage_fqns"][rank]


def test_the_command_line_prints_deepspeeds_boundaries(tmp_path, capsys):
    from autopipe.cli.main import main

    (tmp_path / "layers.py").write_text("import torch\ndef make():\n    return torch.nn.Sequential(*[torch.nn.Linear(8, 8)"
                                        " for _ in range(4)]), (torch.randn(2, 8),)\n")
    assert main(["plan", f"{tmp_path / 'layers.py'}:make", "--gpus", "2", "--cost", "flops", "--target", "deepspeed",
                 "--no-progress"]) == 0
    assert "DeepSpeed PipelineModule boundaries: parts = [0, 2, 4]" in capsys.readouterr().out
