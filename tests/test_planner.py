"""autopipe.partition(): plans torch can build, better than the usual splits, clear errors."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import pipeline

import autopipe
from autopipe.errors import InfeasibleMemoryError, MissingExampleInputsError, ModelExportError
from autopipe.models import seed_transformer
from autopipe.planning.profile import profile_segments
from autopipe.planning.schedules import training_merges_outputs
from autopipe.planning.tracing import trace
from _planning import partition_with

QUICK = autopipe.ProfileOptions(progress=False, warmup=0, repeats=1)  # for partition
QUICK_CPU = autopipe.ProfileOptions(device="cpu", progress=False, warmup=0, repeats=1)
QUIET = autopipe.ProfileOptions(progress=False)
QUIET_CPU = autopipe.ProfileOptions(device="cpu", progress=False)  # the CPU's default links


def counted_costs(model: nn.Module, args: tuple) -> list:
    """Segment costs from counted FLOPs at a fixed 1 GFLOP/s: the same plan on every machine,
    however busy, where a test asserts on where the plan splits."""
    return profile_segments(trace(model, args), cost="flops", device_flops=1e9, progress=False)


def assert_plan_builds_and_matches(model: nn.Module, args: tuple, plan: autopipe.Plan) -> None:
    """torch's pipeline() builds exactly plan.num_stages stages, which reproduce the model."""
    pipe = pipeline(copy.deepcopy(model), args, split_spec=plan.split_spec)
    assert pipe.num_stages == plan.num_stages
    out = pipe(*args)
    out = out[0] if isinstance(out, tuple) else out
    with torch.no_grad():
        expected = model(*args)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_gpus", [2, 4])
def test_seed_transformer_plan_builds_in_torch_and_reproduces_output(small_transformer, n_gpus):
    model, args = small_transformer
    plan = autopipe.partition(model, n_gpus, example_args=args, planner=autopipe.PlannerOptions(profiling=QUICK))
    assert plan.num_stages == n_gpus == len(plan.stages)
    assert len(plan.split_spec) == n_gpus - 1
    assert_plan_builds_and_matches(model, args, plan)


@pytest.mark.slow  # torch builds a pipeline for each of the split points, seconds in all
def test_every_split_point_the_tracer_offers_builds_in_torch(small_transformer, small_traced):
    model, args = small_transformer
    for name in small_traced.split_point_names:
        plan_like = type("P", (), {"split_spec": {name: autopipe.planning.plan.SplitPoint.BEGINNING}, "num_stages": 2})
        assert_plan_builds_and_matches(model, args, plan_like)


def test_heavy_last_layer_is_not_split_by_equal_layers_as_torchtitan_splits():
    # A vocabulary of 8000 makes the output projection outweigh all four layers together.
    model, args = seed_transformer(vocab_size=8000, d_model=64, num_heads=4, d_ff=128, num_layers=4, batch=2, seq_len=32)
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=counted_costs(model, args), profiling=QUIET_CPU))
    equal = plan.baseline("torchtitan_default")
    assert plan.split_points != equal.split_points
    assert plan.bottleneck_s < equal.bottleneck_s
    assert_plan_builds_and_matches(model, args, plan)


def test_plan_stage_records_are_complete(small_transformer, small_costs):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=small_costs, profiling=QUIET_CPU))
    first, last = plan.stages
    assert "embedding" in first.fqns and "out_linear" in last.fqns
    assert first.send_bytes == last.recv_bytes > 0
    assert all(s.peak_bytes >= s.param_bytes > 0 for s in plan.stages)
    assert plan.lower_bound_s <= plan.bottleneck_s
    assert [b.name for b in plan.baselines] == list(autopipe.planning.baselines.BASELINES)
    assert "split_spec" in plan.report() and "deepspeed_uniform" in plan.report()
    assert plan.input_shapes == [list(args[0].shape)] and plan.sequence_length == 8  # what it was made for


def test_partition_leaves_the_model_exactly_as_it_was(small_transformer):
    model, args = small_transformer
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {name: m.forward for name, m in model.named_modules()}
    autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(profiling=QUICK))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all("forward" not in vars(m) for m in model.modules())  # not wrapped like pipeline() does
    assert {name: m.forward for name, m in model.named_modules()} == forwards
    # and torch can still pipeline it afterwards
    pipeline(copy.deepcopy(model), args, split_spec={"layers.1": autopipe.planning.plan.SplitPoint.BEGINNING})


def test_same_profile_gives_the_same_plan(small_transformer, small_costs):
    model, args = small_transformer
    a = autopipe.partition(model, 4, example_args=args, planner=autopipe.PlannerOptions(cost=small_costs))
    b = autopipe.partition(model, 4, example_args=args, planner=autopipe.PlannerOptions(cost=small_costs))
    assert a.split_points == b.split_points
    assert a.to_dict()["stages"] == b.to_dict()["stages"]


def test_plan_survives_save_and_load(small_transformer, small_costs, tmp_path):
    model, args = small_transformer
    plan = autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(cost=small_costs))
    plan.save(tmp_path / "plan.json")
    assert autopipe.Plan.load(tmp_path / "plan.json").split_spec == plan.split_spec


def test_memory_limit_is_respected(small_transformer, small_costs):
    model, args = small_transformer
    costs = small_costs
    free = autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(cost=costs))
    limit = int(max(s.peak_bytes for s in free.stages) * 0.999)
    try:
        tight = autopipe.partition(model, 2, example_args=args,
                                   planner=autopipe.PlannerOptions(cost=costs, memory=limit))
    except InfeasibleMemoryError:
        return  # the free plan was already the smallest: nothing else to check
    assert all(s.peak_bytes <= limit for s in tight.stages)
    assert tight.memory_limit_bytes == [limit, limit]


def test_impossible_memory_names_memory_that_fits(small_transformer, small_costs):
    model, args = small_transformer
    with pytest.raises(InfeasibleMemoryError, match=r"per device fits \(with 2 stages, this schedule and optimizer, "
                                                    r"recomputing where it helps\): the least of the splits") as info:
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(memory="1KiB", cost=small_costs))
    assert info.value.min_memory_bytes > 1024


@pytest.mark.parametrize("recompute", ["auto", False])
def test_the_memory_an_error_names_is_enough_to_plan(small_transformer, small_costs, recompute):
    # The figure counts what each rank holds (the tensors it sent too), not each stage alone:
    # a user who gives it back as the limit gets a plan that fits.
    model, args = small_transformer
    with pytest.raises(InfeasibleMemoryError) as info:
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(memory="1KiB", cost=small_costs, recompute=recompute))
    need = info.value.min_memory_bytes
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(memory=need, cost=small_costs, recompute=recompute))
    assert max(plan.rank_peak_bytes) <= need


def test_flops_and_params_cost_sources_plan_too(small_transformer):
    model, args = small_transformer
    for cost in ("flops", "params"):
        plan = autopipe.partition(model, 2, example_args=args,
                                  planner=autopipe.PlannerOptions(cost=cost, profiling=QUIET))
        assert plan.cost_source == cost and plan.num_stages == 2


# ---- bad input: clear errors before any work


@pytest.mark.parametrize("n_gpus", [0, -1, 1.5, "2", True])
def test_bad_n_gpus(small_transformer, n_gpus):
    model, args = small_transformer
    with pytest.raises(ValueError, match=r"n_gpus=.* must be an integer >= 1"):
        autopipe.partition(model, n_gpus, example_args=args, planner=autopipe.PlannerOptions(profiling=QUICK))


def test_more_stages_than_split_points(small_traced, small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match=rf"only {len(small_traced.candidates)} legal split points"):
        autopipe.partition(model, 100, example_args=args, n_microbatches=100,
                           planner=autopipe.PlannerOptions(profiling=QUICK))


def test_unknown_cost_source(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="cost='magic' is not a cost source"):
        autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(cost="magic"))


def test_unknown_optimizer(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match="optimizer='adamax2' is not known; use one of"):
        autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(optimizer="adamax2"))


def test_unknown_schedule_lists_the_known_ones(small_transformer):
    model, args = small_transformer
    with pytest.raises(ValueError, match=r"valid schedules.*or 'auto' to compare them all"):
        autopipe.partition(model, 2, example_args=args, schedule="zigzag")


@pytest.mark.parametrize("memory", ["lots", -5, "0GiB"])
def test_bad_memory(small_transformer, memory):
    model, args = small_transformer
    with pytest.raises(ValueError, match="memory="):
        autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(memory=memory))


def test_missing_example_inputs():
    with pytest.raises(MissingExampleInputsError):
        autopipe.partition(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2)


def test_model_that_does_not_export():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    with pytest.raises(ModelExportError, match="What to try"):
        autopipe.partition(Branchy(), 2, example_args=(torch.randn(1, 2),))


def test_bad_arguments_fail_before_tracing(small_transformer, monkeypatch):
    model, args = small_transformer

    def must_not_trace(*a, **k):
        raise AssertionError("traced before validating")

    monkeypatch.setattr(autopipe.planning.planner, "trace", must_not_trace)
    with pytest.raises(ValueError, match="optimizer="):
        autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(optimizer="nope"))


def test_tied_weights_count_in_every_stage_that_holds_a_copy():
    from zoo.hf import gpt2_from_config

    model, args = gpt2_from_config(n_layer=2, n_embd=32, n_head=4, vocab_size=2000, seq_len=8)
    # These costs put the embedding and the head in different stages.
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(cost=counted_costs(model, args), profiling=QUIET_CPU))
    wte = model.transformer.wte.weight
    wte_bytes = wte.numel() * wte.element_size()

    def holding(fqn: str):  # a stage lists the outermost modules it holds whole
        return next(s for s in plan.stages if any(fqn == f or fqn.startswith(f + ".") for f in s.fqns))

    head_stage, emb_stage = holding("lm_head"), holding("transformer.wte")
    assert head_stage is not emb_stage
    assert head_stage.param_bytes >= wte_bytes and emb_stage.param_bytes >= wte_bytes


def test_seed_transformer_factory_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    seed_transformer(vocab_size=50, num_layers=1, seq_len=4)
    assert torch.equal(state, torch.get_rng_state())


def _example_models():
    from zoo.hf import gpt2_from_config, llama_from_config

    yield "gpt2", lambda: gpt2_from_config(n_layer=4, n_embd=32, n_head=4, vocab_size=1000, seq_len=8)
    yield "llama", lambda: llama_from_config(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                             vocab_size=1000, seq_len=8)


@pytest.mark.parametrize("n_gpus", [2, pytest.param(4, marks=pytest.mark.slow)])  # 2 stages cover the unit lane
@pytest.mark.parametrize("name, factory", list(_example_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_hugging_face_plans_build_in_torch_and_reproduce_output(name, factory, n_gpus):
    model, args = factory()
    model.eval()  # no dropout: outputs must match exactly
    plan = autopipe.partition(model, n_gpus, example_args=args,
                              planner=autopipe.PlannerOptions(cost="flops", profiling=QUIET))
    assert plan.num_stages == n_gpus
    assert_plan_builds_and_matches(model, args, plan)


@pytest.mark.skipif(training_merges_outputs(), reason="this torch's schedules keep every output in training")
def test_1f1b_last_stage_peak_does_not_grow_with_the_micro_batch_count():
    # A heavy-head LM: the logits of one micro-batch outweigh the blocks' activations. Under 1F1B
    # the last stage holds one micro-batch in flight, and a training step keeps no outputs, so its
    # planned peak stays where it is as the micro-batches go from 4 to 16.
    model, args = seed_transformer(vocab_size=4000, d_model=32, num_heads=2, d_ff=64, num_layers=4, batch=2,
                                   seq_len=16)
    costs = counted_costs(model, args)
    peaks = {}
    for m in (4, 16):
        plan = autopipe.partition(model, 2, args, schedule="1F1B", n_microbatches=m, loss_fn=False,
                                  planner=autopipe.PlannerOptions(cost=costs, profiling=QUIET_CPU))
        peaks[m] = (plan.split_points, plan.rank_peak_bytes[-1])
        assert plan.step_tail.merge_outputs_s == 0.0
    assert peaks[16][0] == peaks[4][0]
    assert peaks[16][1] == pytest.approx(peaks[4][1], rel=0.10)


def test_the_step_tail_charges_the_merge_the_loss_broadcast_and_tied_gradients_across_ranks():
    from autopipe.machine.device import default_copy_bandwidth
    from zoo.hf import gpt2_from_config
    from autopipe.planning.costmodel import step_tail
    from autopipe.planning.problem import tied_gradient_bytes
    from autopipe.planning.schedules import stage_ranks

    model, args = gpt2_from_config(n_layer=2, n_embd=32, n_head=4, vocab_size=2000, seq_len=8)
    traced = trace(model, args)
    wte_bytes = model.transformer.wte.weight.numel() * 4
    m = 4
    # On the CPU, whose copy bandwidth the expected figures use, also where a GPU is present.
    kw = dict(example_args=args, n_microbatches=m, cost=counted_costs(model, args), profiling=QUIET_CPU)
    split = partition_with(model, 2, schedule="1F1B", **kw)
    link = split.machine.links[0]
    tail = split.step_tail
    logits_bytes = split.segments[-1].out_bytes
    # Training steps ask torch for no outputs, so the last stage merges none (older torch: it merges all).
    merged = logits_bytes if training_merges_outputs() else 0.0
    assert tail.merge_outputs_s == pytest.approx(m * merged / default_copy_bandwidth("cpu"))
    assert tail.loss_broadcast_s == pytest.approx(link.latency_s)
    # These costs put the embedding and the tied head on different ranks: their gradients are summed.
    assert tail.shared_grads_s > wte_bytes / link.bandwidth
    assert split.predicted_step_s == pytest.approx(split.simulated_step_s())

    def expected_tail(plan: autopipe.Plan):
        cuts = [st.first_segment for st in plan.stages[1:]]
        return step_tail(n_microbatches=m, out_bytes=merged, n_ranks=2, bandwidth=link.bandwidth,
                         latency_s=link.latency_s, copy_bandwidth=default_copy_bandwidth("cpu"),
                         shared_bytes=tied_gradient_bytes(traced, cuts, plan.stage_ranks))

    v_plan = partition_with(model, 2, schedule="ZBVZeroBubble", **kw)
    for plan in (split, v_plan):  # whichever split the costs gave
        want = expected_tail(plan)
        assert (plan.step_tail.merge_outputs_s, plan.step_tail.loss_broadcast_s, plan.step_tail.shared_grads_s) == \
            pytest.approx((want.merge_outputs_s, want.loss_broadcast_s, want.shared_grads_s))
        assert plan.step_tail_s() == pytest.approx(want.total_s)
    # ZBV puts the first and the last stage on rank 0: with the embedding in stage 0 the tied
    # weight never leaves rank 0 and no gradient is summed; cut before it, it is.
    zbv = stage_ranks("ZBVZeroBubble", 2, 2)
    names = traced.split_point_names
    in_stage_0 = [names.index(p) + 1 for p in ("transformer.h.0", "transformer.h.1", "transformer.ln_f")]
    in_stage_1 = [names.index(p) + 1 for p in ("transformer.wte", "transformer.h.1", "transformer.ln_f")]
    assert tied_gradient_bytes(traced, in_stage_0, zbv) == []
    assert tied_gradient_bytes(traced, in_stage_1, zbv) == [(wte_bytes, 2)]


def test_the_last_ranks_peak_counts_kept_outputs_only_where_torch_keeps_them():
    # A training step asks torch for no outputs (torch 2.10 and later): under 1F1B with many
    # micro-batches the last rank holds its parameters, gradients and optimizer state and what
    # it has in flight, nothing per micro-batch beyond. On an older torch the last stage keeps
    # every output and concatenates them at the end, after every activation is freed: two
    # copies of every micro-batch's output (docs/design.md, finding 14).
    from zoo.hf import gpt2_from_config

    model, args = gpt2_from_config(n_layer=2, n_embd=32, n_head=4, vocab_size=2000, seq_len=8)
    m = 64
    plan = autopipe.partition(model, 2, example_args=args, schedule="1F1B", n_microbatches=m,
                              planner=autopipe.PlannerOptions(cost=counted_costs(model, args), profiling=QUIET_CPU))
    out_bytes = plan.segments[-1].out_bytes
    last = plan.stages[-1]
    static = last.peak_bytes - last.inflight_microbatches * last.act_bytes  # parameters, grads, Adam
    peak = plan.rank_peak_bytes[plan.stage_ranks[-1]]
    if training_merges_outputs():
        assert peak == pytest.approx(static + 2 * m * out_bytes)
    else:
        assert static < peak < static + m * out_bytes


def test_split_backward_schedules_charge_the_copy_of_each_stage_output(monkeypatch):
    # Under ZBV autopipe's runtime sends a copy of every stage output (torch detaches the
    # original in place), kept until the micro-batch's input-grad: one more tensor per
    # micro-batch in flight on every stage that has a successor.
    from autopipe.planning import schedules
    from zoo.hf import gpt2_from_config

    model, args = gpt2_from_config(n_layer=2, n_embd=32, n_head=4, vocab_size=2000, seq_len=8)
    kw = dict(example_args=args, cost=counted_costs(model, args), schedule="ZBVZeroBubble", n_microbatches=4,
              profiling=QUIET_CPU)
    with_copies = partition_with(model, 2, **kw)
    spec = schedules.SCHEDULE_SPECS["ZBVZeroBubble"]
    monkeypatch.setitem(schedules.SCHEDULE_SPECS, "ZBVZeroBubble", replace(spec, split_backward=False))
    without = partition_with(model, 2, **kw)
    assert with_copies.split_points == without.split_points
    smallest_cut = min(st.send_bytes for st in with_copies.stages[:-1])
    extra = [a - b for a, b in zip(with_copies.rank_peak_bytes, without.rank_peak_bytes)]
    # Rank 0 (stages 0 and 3) peaks when torch merges the outputs, after the copies are gone;
    # rank 1 (stages 1 and 2) holds copies of both its stages' outputs at its peak.
    assert extra[0] >= 0 and extra[1] >= 2 * smallest_cut > 0


def test_a_tied_weight_on_one_rank_is_counted_once_in_its_memory():
    # ZBV puts stage 0 (the embedding) and stage 3 (the tied head) on rank 0: the runtime keeps
    # one tensor there, so the weight, its gradient and its Adam state count once on that rank.
    from zoo.hf import gpt2_from_config
    from autopipe.planning.problem import rank_overcount_bytes
    from autopipe.planning.schedules import stage_ranks

    model, args = gpt2_from_config(n_layer=2, n_embd=32, n_head=4, vocab_size=2000, seq_len=8)
    wte_bytes = model.transformer.wte.weight.numel() * 4
    traced = trace(model, args)

    def cuts(*split_points: str) -> list[int]:  # fixed splits: a measured plan may cut anywhere
        return [traced.split_point_names.index(p) + 1 for p in split_points]

    adam = 2.0  # two state tensors per parameter
    zbv = stage_ranks("ZBVZeroBubble", 2, 2)
    assert rank_overcount_bytes(traced, cuts("transformer.h.0", "transformer.h.1", "transformer.ln_f"), zbv,
                                adam) == [wte_bytes * (2 + adam), 0.0]
    # Cut before the embedding, stage 1 (rank 1) holds it and stage 3 (rank 0) the head: one each.
    assert rank_overcount_bytes(traced, cuts("transformer.wte", "transformer.h.1", "transformer.ln_f"), zbv,
                                adam) == [0.0, 0.0]
    # 1F1B on 2 ranks: embedding and head on different ranks, each holds its own copy.
    assert rank_overcount_bytes(traced, cuts("transformer.h.1"), [0, 1], adam) == [0.0, 0.0]


def test_flush_cache_reaches_the_profile_and_is_checked_first(flushers_built):
    from autopipe.models import seed_transformer

    built = flushers_built
    model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    with pytest.raises(ValueError, match=r"flush_cache='no' must be True or False"):
        autopipe.ProfileOptions(flush_cache="no")
    assert built == []  # refused before any profiling
    autopipe.partition(model, 2, example_args=args,
                       planner=autopipe.PlannerOptions(profiling=replace(QUICK_CPU, flush_cache=False)))
    assert built == []
    autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(profiling=QUICK_CPU))
    assert built == [1]


def test_fit_to_whole_reaches_the_profile_is_checked_first_and_is_reported(rounds_seen):
    from autopipe.models import seed_transformer

    model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    with pytest.raises(ValueError, match=r"fit_to_whole='on' must be True, False or None"):
        autopipe.ProfileOptions(fit_to_whole="on")
    assert rounds_seen == []  # refused before any profiling
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(profiling=replace(QUICK_CPU, fit_to_whole=True)))
    assert rounds_seen == [(True, True)] and plan.whole_pass.fitted
    assert "segments scaled x" in plan.report()
    plan = autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(profiling=QUICK_CPU))
    assert rounds_seen[-1] == (True, False) and "segments not scaled to it" in plan.report()


@pytest.mark.parametrize("memory", [[1024, 2 ** 40], [2 ** 40, 1024]])
def test_with_unequal_devices_the_memory_named_is_what_the_smaller_device_needs(small_transformer, small_costs,
                                                                                memory):
    # Each device given max(its memory, the figure) fits; scaling both devices by one factor
    # named hundreds of TiB for a 1 KiB device beside a 1 TiB one.
    model, args = small_transformer
    with pytest.raises(InfeasibleMemoryError, match=r"per device fits \(a device that "
                                                    r"has more keeps its own") as info:
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(memory=memory, cost=small_costs))
    need = info.value.min_memory_bytes
    with pytest.raises(InfeasibleMemoryError) as equal:
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(memory="1KiB", cost=small_costs))
    assert need <= equal.value.min_memory_bytes
    plan = autopipe.partition(model, 2, example_args=args,
                              planner=autopipe.PlannerOptions(memory=[max(m, need) for m in memory], cost=small_costs))
    assert all(peak <= max(m, need) for peak, m in zip(plan.rank_peak_bytes, memory))


@pytest.mark.slow  # many plans: the unit lane keeps to quick checks
def test_the_memory_an_error_names_is_close_to_the_least_that_plans(small_transformer):
    # The planner is asked at memories on a 0.25% ladder below the figure: none of them below
    # 99% of the figure may plan (the figure would then be more than needed).
    model, args = small_transformer
    # A profile with its trace: the 38 plans below reuse it instead of tracing the model each time.
    costs = profile_segments(trace(model, args), cost="flops", device_flops=1e9, progress=False)
    with pytest.raises(InfeasibleMemoryError) as info:
        autopipe.partition(model, 2, example_args=args,
                           planner=autopipe.PlannerOptions(memory="1KiB", cost=costs, recompute="auto"))
    need = info.value.min_memory_bytes

    def plans(memory: int) -> bool:
        try:
            autopipe.partition(model, 2, example_args=args,
                               planner=autopipe.PlannerOptions(memory=memory, cost=costs, recompute="auto"))
        except InfeasibleMemoryError:
            return False
        return True

    below = [int(need * (0.9 + 0.0025 * k)) for k in range(36)]  # 90% to 98.75% of the figure
    assert not [m for m in below if plans(m)], "the planner fits memory well below the figure the error names"
    assert plans(need)


def test_a_profile_plans_again_from_its_own_trace_until_the_model_changes(monkeypatch):
    from autopipe.planning import tracing

    model, args = seed_transformer(vocab_size=200, num_layers=2, seq_len=8)
    costs = profile_segments(trace(model, args), cost="flops", device_flops=1e9, progress=False)
    exports = []
    real = tracing._trace
    monkeypatch.setattr(tracing, "_trace", lambda *a, **k: exports.append(1) or real(*a, **k))
    options = autopipe.PlannerOptions(cost=costs, profiling=QUIET)
    first = autopipe.partition(model, 2, args, planner=options)
    again = autopipe.partition(model, 2, args, planner=options)
    assert exports == [] and first.split_points == again.split_points
    model.layers[0].eval()  # another mode traces another graph (dropout): exported again
    autopipe.partition(model, 2, args, planner=options)
    autopipe.partition(model, 2, (torch.cat([args[0]] * 2),), planner=options)  # other shapes: again
    assert exports == [1, 1]


def test_a_profile_is_planned_in_place_of_its_model(monkeypatch):
    from autopipe.planning import tracing

    model, args = seed_transformer(vocab_size=200, num_layers=4, seq_len=8)
    profile = profile_segments(trace(model, args), cost="flops", device_flops=1e9, progress=False)
    monkeypatch.setattr(tracing, "_trace", lambda *a, **k: pytest.fail("traced again"))
    from_profile = [autopipe.partition(profile, n, planner=autopipe.PlannerOptions(profiling=QUIET)) for n in (2, 4)]
    from_model = [autopipe.partition(model, n, args, planner=autopipe.PlannerOptions(cost=profile, profiling=QUIET))
                  for n in (2, 4)]
    assert [p.split_points for p in from_profile] == [p.split_points for p in from_model]
    # Schedules, micro-batch counts and pp x dp layouts are searched over the same profile, measured once.
    from autopipe.planning import planner

    monkeypatch.setattr(planner, "profile_segments", lambda *a, **k: pytest.fail("profiled again"))
    searched = autopipe.partition(profile, 4, schedule="auto",
                                  data_parallel=autopipe.DataParallelOptions(degree="auto", mode="replicate"),
                                  planner=autopipe.PlannerOptions(profiling=QUIET, global_batch=32))
    assert searched.dp_degree * searched.pp_degree == 4 and len(searched.data_parallel.factorizations) >= 2
    with pytest.raises(ValueError, match="a profile brings the inputs it was traced with"):
        autopipe.partition(profile, 2, args)
    with pytest.raises(ValueError, match="a profile brings its costs"):
        autopipe.partition(profile, 2, planner=autopipe.PlannerOptions(cost="flops"))
    with pytest.raises(ValueError, match="holds no trace of a live model"):
        autopipe.partition(type(profile)(profile), 2)
