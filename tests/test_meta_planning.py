"""Planning a model built on the meta device: shapes only, costs counted, the same plan as the real model."""

from __future__ import annotations

import pytest
import torch

import autopipe
from autopipe.models import seed_transformer
from autopipe.planning.planner import on_meta_device
from autopipe.planning.profile import profile_segments
from autopipe.planning.trace import trace

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
    planned = autopipe.partition(meta, 2, meta_args, **kw)
    reference = autopipe.partition(real, 2, real_args, **kw)
    assert planned.split_points == reference.split_points
    assert planned.rank_peak_bytes == reference.rank_peak_bytes
    assert planned.loss.act_bytes == reference.loss.act_bytes > 0, "the assumed loss is charged on meta too"
    assert all(t.is_meta for t in meta.parameters()), "the user's model is left on the meta device"


def test_a_meta_model_plans_from_counted_flops_with_its_loss():
    (meta, args), _ = _both(vocab_size=1000, num_layers=4, seq_len=16)
    plan = autopipe.partition(meta, 2, args, cost="flops", n_microbatches=4, profiling=QUIET)
    assert len(plan.split_points) == 1 and plan.cost_source == "flops"
    assert plan.loss is not None and plan.loss.act_bytes >= 4 * 16 * 1000 * 4  # the log-softmax of the logits
    assert plan.predicted_step_s > 0


def test_a_meta_model_refuses_measured_costs_before_any_work():
    (meta, args), _ = _both(vocab_size=100, num_layers=2, seq_len=8)
    with pytest.raises(ValueError, match=r"meta device.*cost='flops'"):
        autopipe.partition(meta, 2, args, profiling=QUIET)


def test_a_meta_model_refuses_automatic_micro_batches():
    (meta, args), _ = _both(vocab_size=100, num_layers=2, seq_len=8)
    with pytest.raises(ValueError, match="n_microbatches='auto'"):
        autopipe.partition(meta, 2, args, cost="flops", n_microbatches="auto", global_batch=8, profiling=QUIET)


def test_a_meta_language_model_from_hugging_face_plans_without_running_its_eager_code():
    # Llama's eager mask code reads tensor values, which the meta device has none of: the
    # planner takes the output's shapes from the trace instead of running the model.
    hf = pytest.importorskip("autopipe.models.hf")
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model, args = hf.llama_from_config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                           vocab_size=500, batch=1, seq_len=16)
    plan = autopipe.partition(model, 4, args, cost="flops", n_microbatches=8, profiling=QUIET)
    assert len(plan.split_points) == 3 and plan.loss is not None and plan.loss.act_bytes > 0
