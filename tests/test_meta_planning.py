"""Planning a model built on the meta device: shapes only, costs counted, the same plan as the real model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import autopipe
from autopipe.models import seed_transformer
from autopipe.planning import profile as profile_module
from autopipe.planning.attention_count import attention_flops
from autopipe.planning.profile import profile_segments
from autopipe.planning.segment_graphs import copy_to_device, on_meta_device, stand_in
from autopipe.planning.tracing import trace
from _planning import partition_with

QUIET = autopipe.ProfileOptions(progress=False)


def _both(**sizes):
    with torch.device("meta"):
        meta = seed_transformer(**sizes)
    return meta, seed_transformer(**sizes)


def test_counted_costs_on_the_meta_device_equal_those_of_the_materialized_model():
    (meta, meta_args), (real, real_args) = _both(vocab_size=1000, num_layers=4, seq_len=16)
    assert on_meta_device(meta) and not on_meta_device(real)
    # One fixed FLOP rate, so the counted seconds compare exactly.
    on_meta = profile_segments(trace(meta, meta_args), cost="flops", device="meta", device_flops=1e9, progress=False)
    on_cpu = profile_segments(trace(real, real_args), cost="flops", device="cpu", device_flops=1e9, progress=False)
    assert list(on_meta) == list(on_cpu)
    assert sum(c.act_bytes for c in on_meta) > 0 and sum(c.flops for c in on_meta) > 0


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_a_meta_model_plans_exactly_as_the_materialized_one(schedule):
    (meta, meta_args), (real, real_args) = _both(vocab_size=1000, num_layers=4, seq_len=16)
    costs = profile_segments(trace(real, real_args), cost="flops", device_flops=1e9, progress=False)
    kw = dict(cost=costs, schedule=schedule, n_microbatches=4, profiling=QUIET)
    planned = partition_with(meta, 2, meta_args, **kw)
    reference = partition_with(real, 2, real_args, **kw)
    assert planned.split_points == reference.split_points
    assert planned.rank_peak_bytes == reference.rank_peak_bytes
    assert planned.loss.act_bytes == reference.loss.act_bytes > 0, "the assumed loss is charged on meta too"
    assert all(t.is_meta for t in meta.parameters()), "the user's model is left on the meta device"


def test_a_meta_model_plans_from_counted_flops_with_its_loss(tmp_path):
    (meta, args), _ = _both(vocab_size=1000, num_layers=4, seq_len=16)
    plan = autopipe.partition(meta, 2, args, n_microbatches=4,
                              planner=autopipe.PlannerOptions(cost="flops", profiling=QUIET))
    # The planning process's peak host memory is in the plan, its report and its file.
    assert plan.planning_peak_rss_bytes > 0 and "peak host memory" in plan.report()
    plan.save(tmp_path / "plan.json")
    assert autopipe.Plan.load(tmp_path / "plan.json").planning_peak_rss_bytes == plan.planning_peak_rss_bytes
    assert len(plan.split_points) == 1 and plan.cost_source == "flops"
    assert plan.loss is not None and plan.loss.act_bytes >= 4 * 16 * 1000 * 4  # the log-softmax of the logits
    assert plan.predicted_step_s > 0


@pytest.mark.slow  # many plans: the unit lane keeps to quick checks
def test_measured_costs_of_a_meta_model_time_one_materialized_segment_at_a_time(monkeypatch):
    (meta, meta_args), (real, real_args) = _both(vocab_size=1000, num_layers=3, seq_len=16)
    live: list = []
    most_alive = 0

    def copy_and_count(module, device):
        nonlocal most_alive
        copied = copy_to_device(module, device)
        live.append(weakref.ref(copied))
        gc.collect()
        most_alive = max(most_alive, sum(r() is not None for r in live))
        return copied

    monkeypatch.setattr(profile_module, "copy_to_device", copy_and_count)
    on_meta = profile_segments(trace(meta, meta_args), device="cpu", warmup=0, repeats=1, progress=False)
    on_cpu = profile_segments(trace(real, real_args), cost="flops", device="cpu", device_flops=1e9, progress=False)
    assert len(live) == len(on_meta) and most_alive == 1, "one segment's copy alive at a time"
    assert [(c.param_bytes, c.act_bytes, c.out_bytes, c.flops) for c in on_meta] == \
        [(c.param_bytes, c.act_bytes, c.out_bytes, c.flops) for c in on_cpu]
    assert all(c.fwd_s > 0 and c.bwd_s > 0 for c in on_meta if c.flops > 0)
    assert all(t.is_meta for t in meta.parameters()), "the user's model is left on the meta device"


def test_a_meta_model_plans_from_measured_costs_with_its_loss_timed():
    (meta, args), _ = _both(vocab_size=1000, num_layers=4, seq_len=16)
    plan = autopipe.partition(meta, 2, args, n_microbatches=4,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(progress=False, warmup=0, repeats=1)))
    assert plan.cost_source == "measured" and len(plan.split_points) == 1
    assert plan.loss is not None and plan.loss.fwd_s > 0 and plan.loss.act_bytes >= 4 * 16 * 1000 * 4


def test_stand_in_values_are_finite_repeatable_and_valid_indices():
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    w = torch.empty(64, 64, device="meta")
    a, b = stand_in(w, "cpu", g1), stand_in(w, "cpu", g2)
    assert torch.equal(a, b) and torch.isfinite(a).all() and 0 < a.std().item() < 0.1
    assert stand_in(torch.empty(3, dtype=torch.bool, device="meta"), "cpu").all()
    real = torch.arange(4)
    assert torch.equal(stand_in(real, "cpu"), real), "a tensor with values keeps them"


def test_a_meta_model_refuses_automatic_micro_batches():
    (meta, args), _ = _both(vocab_size=100, num_layers=2, seq_len=8)
    with pytest.raises(ValueError, match="n_microbatches='auto'"):
        autopipe.partition(meta, 2, args, n_microbatches="auto",
                           planner=autopipe.PlannerOptions(cost="flops", global_batch=8, profiling=QUIET))


def test_a_meta_language_model_from_hugging_face_plans_without_running_its_eager_code():
    # Llama's eager mask code reads tensor values, which the meta device has none of: the
    # planner takes the output's shapes from the trace instead of running the model.
    hf = pytest.importorskip("zoo.hf")
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model, args = hf.llama_from_config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                           vocab_size=500, batch=1, seq_len=16)
    plan = autopipe.partition(model, 4, args, n_microbatches=8,
                              planner=autopipe.PlannerOptions(cost="flops", profiling=QUIET))
    assert len(plan.split_points) == 3 and plan.loss is not None and plan.loss.act_bytes > 0


def test_counted_attention_is_the_same_on_the_meta_device_and_the_cpu(monkeypatch):
    # Counted on the meta device torch would run attention as its unfused math (saving the
    # attention probabilities); on the CPU as a fused kernel its FLOP counter has no formula
    # for. Both count it as a GPU's fused kernel instead (planning/attention_count.py).
    hf = pytest.importorskip("zoo.hf")
    pytest.importorskip("transformers")
    kw = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500, batch=1, seq_len=64)
    with torch.device("meta"):
        meta, meta_args = hf.llama_from_config(**kw)
    real, real_args = hf.llama_from_config(**kw)
    on_meta = profile_segments(trace(meta, meta_args), cost="flops", device_flops=1e9, progress=False)
    on_cpu = profile_segments(trace(real, real_args), cost="flops", device_flops=1e9, progress=False)
    assert [c.flops for c in on_meta] == [c.flops for c in on_cpu]
    assert [c.act_bytes for c in on_meta] == [c.act_bytes for c in on_cpu]
    # Every layer's attention is in the FLOPs: one call per layer, forward and backward.
    per_layer = attention_flops((1, 4, 64, 16), (1, 4, 64, 16), (1, 4, 64, 16))
    per_layer += attention_flops((1, 4, 64, 16), (1, 4, 64, 16), (1, 4, 64, 16), backward=True)
    monkeypatch.setattr(profile_module, "ATTENTION_FLOPS", {})  # the counter's own formulas only
    without = profile_segments(trace(meta, meta_args), cost="flops", device_flops=1e9, progress=False)
    assert sum(c.flops for c in on_meta) - sum(c.flops for c in without) == 2 * per_layer
    plan = autopipe.partition(meta, 2, meta_args, n_microbatches=2,
                              planner=autopipe.PlannerOptions(cost="flops", profiling=QUIET))
    assert not any("attention" in n for n in plan.notes)
