"""Each baseline gives the cut points of the real tool it is named after, on the zoo at 2 and 4 stages.

The real packages (the ``peers`` extra: DeepSpeed 0.19.8, torchgpipe 0.0.7, torchpippy 0.2.0)
are fed the same per-layer numbers as the baselines; a test skips, saying why, where one does
not import. torchtitan cannot be installed beside this torch, so its rule is checked against
what torchtitan 0.3.0's ``_generate_llm_fqn_per_model_part`` gives, worked out by hand.
Costs are FLOP-counted, so nothing here depends on a timing.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import autopipe
from zoo import models as zoo
from autopipe.planning import peers
from autopipe.planning.baselines import (BASELINES, baseline_split, layer_units, pippy_node_params,
                                         unit_param_counts)
from autopipe.planning.profile import profile_segments
from autopipe.planning.tracing import trace

STAGES = (2, 4)
MODELS = sorted(zoo.ZOO)


@pytest.fixture(scope="module")
def zoo_models() -> dict:
    """Every zoo model with its trace, FLOP-counted costs and layer list."""
    out = {}
    for name in MODELS:
        try:
            model, args = zoo.build(name)
        except ImportError:
            continue
        traced = trace(model, args)
        costs = profile_segments(traced, cost="flops", device_flops=1e9, progress=False)
        out[name] = (model, args, traced, costs, layer_units(traced))
    return out


def _bounds_from_lengths(lengths: list[int]) -> list[int]:
    b = [0]
    for n in lengths:
        b.append(b[-1] + n)
    return b


def _expected(units, bounds: list[int]) -> list[int] | None:
    """Segment cuts of unit boundaries, or None where some stage would be empty."""
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        return None
    return units.segment_cuts(bounds)


@pytest.fixture(scope="module")
def deepspeed_utils():
    os.environ.setdefault("DS_BUILD_OPS", "0")  # import DeepSpeed without building its CUDA ops
    return pytest.importorskip("deepspeed.runtime.utils", reason="DeepSpeed 0.19.8 is not installed (pip install "
                               "'autopipe[peers]')")


# ---------------------------------------------------------------------------- layer lists


def test_layer_list_is_the_top_level_modules_with_the_block_lists_expanded(zoo_models):
    names = {k: v[4].names for k, v in zoo_models.items()}
    assert names["unet"] == ["down.0", "down.1", "down.2", "mid", "up.0", "up.1", "up.2", "head"]
    assert names["cnn"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "head"]
    if "gpt2_tied" in names:  # the embeddings as one layer, then h.0 .. h.N, ln_f, lm_head
        assert names["gpt2_tied"] == ["transformer.wte", *(f"transformer.h.{i}" for i in range(4)),
                                      "transformer.ln_f", "lm_head"]
    if "llama" in names:
        assert names["llama"] == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm",
                                  "lm_head"]


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x)) + x


class _ResNetLike(nn.Module):
    """ResNet's layout: a stem of four modules, four Sequentials of two blocks, pooling and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.relu, self.maxpool = nn.ReLU(), nn.MaxPool2d(2)
        for k in range(1, 5):
            setattr(self, f"layer{k}", nn.Sequential(_Block(4), _Block(4)))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_resnet_layers_are_the_stem_each_block_then_pool_and_head():
    units = layer_units(trace(_ResNetLike(), (torch.randn(2, 3, 18, 18),)))
    assert units.names == ["conv1", "bn1", "relu", "maxpool", *(f"layer{k}.{i}" for k in range(1, 5) for i in (0, 1)),
                           "avgpool", "fc"]
    assert [b[0] for b in units.block_lists] == ["layer1", "layer2", "layer3", "layer4"]


def test_a_list_of_sequentials_is_expanded_once_not_into_its_blocks_insides():
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(6, 6))
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(3))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.out = nn.Linear(6, 6), blocks, nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    units = layer_units(trace(Net(), (torch.randn(2, 6),)))
    assert units.names == ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]
    assert units.block_lists == [("blocks", 1, 3)]


# ---------------------------------------------------------------------------- DeepSpeed 0.19.8


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("name", MODELS)
def test_deepspeed_uniform_equals_deepspeeds_partition_uniform(deepspeed_utils, zoo_models, name, p):
    if name not in zoo_models:
        pytest.skip(f"{name} needs transformers")
    _, _, traced, costs, units = zoo_models[name]
    want = _expected(units, deepspeed_utils.partition_uniform(len(units.names), p))
    got = baseline_split("deepspeed_uniform", traced, costs, p, units)
    assert got.cuts == want, got.reason


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("name", MODELS)
def test_deepspeed_parameters_equals_deepspeeds_partition_balanced(deepspeed_utils, zoo_models, name, p):
    if name not in zoo_models:
        pytest.skip(f"{name} needs transformers")
    _, _, traced, costs, units = zoo_models[name]
    weights = unit_param_counts(traced, units)
    want = _expected(units, deepspeed_utils.partition_balanced([int(w) for w in weights], p))
    got = baseline_split("deepspeed_parameters", traced, costs, p, units)
    assert got.cuts == want, got.reason


def test_layer_parameter_counts_are_each_modules_trainable_parameters(zoo_models):
    model, _, traced, _, units = zoo_models["unet"]
    mods = dict(model.named_modules())
    want = [sum(q.numel() for q in mods[n].parameters() if q.requires_grad) for n in units.names]
    assert unit_param_counts(traced, units).tolist() == want


def test_deepspeed_rules_on_random_weights_match_the_package(deepspeed_utils):
    rng = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 15, (1,), generator=rng))
        m = int(torch.randint(1, 6, (1,), generator=rng))
        w = torch.randint(0, 5, (n,), generator=rng).tolist()
        assert peers.deepspeed_partition_balanced(w, m) == deepspeed_utils.partition_balanced(w, m), (w, m)
        assert peers.deepspeed_partition_uniform(n, m) == deepspeed_utils.partition_uniform(n, m), (n, m)


# ---------------------------------------------------------------------------- torchgpipe 0.0.7


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("name", MODELS)
def test_torchgpipe_time_equals_torchgpipes_block_partition(zoo_models, name, p):
    blockpartition = pytest.importorskip("torchgpipe.balance.blockpartition",
                                         reason="torchgpipe 0.0.7 is not installed (pip install 'autopipe[peers]')")
    if name not in zoo_models:
        pytest.skip(f"{name} needs transformers")
    _, _, traced, costs, units = zoo_models[name]
    times = units.unit_sums([c.fwd_s + c.bwd_s for c in costs]).tolist()
    got = baseline_split("torchgpipe_time", traced, costs, p, units)
    if len(times) < p:
        assert got.cuts is None
        return
    blocks = blockpartition.solve(times, p)
    assert got.cuts == _expected(units, _bounds_from_lengths([len(b) for b in blocks])), got.reason


def test_torchgpipe_rule_on_random_costs_matches_the_package():
    blockpartition = pytest.importorskip("torchgpipe.balance.blockpartition",
                                         reason="torchgpipe 0.0.7 is not installed (pip install 'autopipe[peers]')")
    rng = torch.Generator().manual_seed(1)
    for _ in range(300):
        m = int(torch.randint(1, 6, (1,), generator=rng))
        n = int(torch.randint(m, 15, (1,), generator=rng))
        w = torch.rand(n, generator=rng).mul(10).tolist()
        real = blockpartition.solve(w, m)
        ours = peers.torchgpipe_solve(w, m)
        # torchgpipe returns the slices between its boundaries; compare the slices
        assert [w[a:b] for a, b in zip(ours, ours[1:])] == real, (w, m)


# ---------------------------------------------------------------------------- torchpippy 0.2.0


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("name", MODELS)
def test_pippy_equal_size_cuts_where_torchpippy_inserts_its_splits(zoo_models, name, p):
    model_split = pytest.importorskip("pippy.ModelSplit", reason="torchpippy 0.2.0 is not installed "
                                      "(pip install --no-deps torchpippy==0.2.0)")
    if name not in zoo_models:
        pytest.skip(f"{name} needs transformers")
    model, args, traced, costs, _ = zoo_models[name]
    per_node, total, problem = pippy_node_params(traced)
    gm = torch.export.export(model, args).module()  # the graph torchpippy 0.2.0's pipeline() splits
    if problem:
        with pytest.raises(AssertionError):
            model_split.split_into_equal_size(p)(gm)
        assert baseline_split("pippy_equal_size", traced, costs, p).cuts is None
        return
    gm = model_split.split_into_equal_size(p)(gm)
    real = [n.next.name for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "pipe_split"]
    ours = [traced.nodes[i].name for i in peers.pippy_equal_size_cuts(per_node, total, p)]
    assert ours == real
    split = baseline_split("pippy_equal_size", traced, costs, p)
    if split.cuts is not None:
        assert [traced.nodes[traced.segments[c].start].name for c in split.cuts] == real
    else:
        assert "cannot split" in split.reason


# ---------------------------------------------------------------------------- torchtitan 0.3.0


@pytest.mark.parametrize("stages, layers, counts", [
    # worked out from torchtitan 0.3.0's _generate_llm_fqn_per_model_part (input/output weight 1)
    (2, 4, [2, 2]),  # 6 units: 3 + 3; the embedding and the head take one each
    (4, 4, [1, 2, 1, 0]),  # 6 units: 2, 2, 1, 1; the last stage is norm + output alone
    (4, 8, [2, 3, 2, 1]),  # 10 units: 3, 3, 2, 2
    (3, 32, [11, 11, 10]),  # 34 units: 12, 11, 11
    (1, 5, [5]),
])
def test_torchtitan_rule_gives_torchtitan_030s_blocks_per_stage(stages, layers, counts):
    assert peers.torchtitan_stage_layers(stages, layers) == counts


def test_torchtitan_rule_refuses_what_torchtitan_030_refuses():
    with pytest.raises(ValueError, match="at least one unit per stage"):
        peers.torchtitan_stage_layers(8, 4)
    with pytest.raises(ValueError, match="weight"):
        peers.torchtitan_stage_layers(4, 8, input_weight=4)


def test_torchtitan_default_on_the_zoo(zoo_models):
    traced, costs, units = zoo_models["seed_transformer"][2:]
    cuts = {p: baseline_split("torchtitan_default", traced, costs, p, units).cuts for p in STAGES}
    assert [units.names[units.starts.index(c)] for c in cuts[2]] == ["layers.2"]
    assert [units.names[units.starts.index(c)] for c in cuts[4]] == ["layers.1", "layers.3", "out_linear"]
    traced, costs, units = zoo_models["unet"][2:]
    split = baseline_split("torchtitan_default", traced, costs, 2, units)
    assert split.cuts is None and "2 lists of blocks (down, up)" in split.reason


# ---------------------------------------------------------------------------- flops_dp and the plan


def test_flops_dp_is_never_slower_in_its_simulated_1f1b_than_any_min_max_split():
    import itertools
    f = [1.0, 5.0, 1.0, 1.0, 1.0, 1.0, 6.0]

    def span(bounds) -> float:
        fw = [sum(f[a:b]) for a, b in zip(bounds, bounds[1:])]
        return peers.simulate_1f1b_s(fw, [3 * x for x in fw], 6)

    splits = [[0, *c, len(f)] for c in itertools.combinations(range(1, len(f)), 2)]
    best_max = min(max(sum(f[a:b]) for a, b in zip(s, s[1:])) for s in splits)
    min_max = [s for s in splits if max(sum(f[a:b]) for a, b in zip(s, s[1:])) == best_max]
    assert span(peers.flops_dp_partition(f, 3)) <= min(span(s) for s in min_max) + 1e-9


def test_1f1b_simulation_of_equal_stages_is_fill_plus_steady_state():
    # p stages of f + b each, m micro-batches: (m + p - 1) x (f + b)
    assert peers.simulate_1f1b_s([1.0] * 4, [2.0] * 4, 8) == pytest.approx((8 + 4 - 1) * 3.0)


def test_the_plan_names_every_peer_and_says_why_one_does_not_apply(zoo_models):
    model, args, traced, costs, _ = zoo_models["unet"]
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu", progress=False)))
    assert [b.name for b in plan.baselines] == list(BASELINES)
    titan = plan.baseline("torchtitan_default")
    assert titan.reason.startswith("not applicable: ") and titan.split_points == []
    assert "torchtitan 0.3.0" in titan.description
    report = plan.report()
    assert "not applicable: torchtitan 0.3.0's rule" in report
    assert plan.baseline("deepspeed_uniform").split_points == ["up.0"]


def test_a_saved_plan_keeps_its_baselines_as_given():
    from pathlib import Path

    plan = autopipe.Plan.load(Path(__file__).parent / "data" / "plan_auto_calibrated.json")
    assert [b.name for b in plan.baselines] == ["equal_layers", "balanced_params", "block_partition"]
    assert all(b.reason == "" and b.split_points for b in plan.baselines)


def test_every_report_says_not_applicable_with_the_reason(zoo_models):
    from autopipe.reporting.data import report_data
    from autopipe.reporting.markdown import plan_to_markdown

    model, args, traced, costs, _ = zoo_models["mlp_sequential"]
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device="cpu", progress=False)))
    reason = plan.baseline("torchtitan_default").reason
    assert "no list of repeated blocks" in reason
    data = report_data(plan)
    assert data["summary"]["best_baseline"] != "torchtitan_default"
    assert reason in plan_to_markdown(data) and reason in plan.report()
