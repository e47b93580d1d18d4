"""profile_segments(): measured costs per segment, and the model left exactly as it was."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn as nn

from autopipe.machine.passes import accumulate, measure_backward_start_s, time_in_rounds
from autopipe.machine.speed import measure_device_flops
from autopipe.machine.timing import (CacheFlusher, fastest_paired, last_level_cache_bytes, paired_ratio,
                                     paired_ratio_interval, per_run_s, resolve_device)
from autopipe.planning.profile import fit_to_whole_default, profile_segments, room_for_whole
from autopipe.planning.segment_graphs import copy_to_device, segment_modules
from autopipe.planning.tracing import trace


def test_every_segment_gets_positive_measured_times(small_traced):
    # Fitted to the whole graph, so no segment's backward has the cost of starting one taken
    # off (the embedding's backward is about that cost, so after it one run can come to 0).
    costs = profile_segments(small_traced, warmup=0, repeats=1, progress=False, fit_to_whole=True)
    assert len(costs) == small_traced.num_segments
    assert all(c.fwd_s > 0 for c in costs)
    # Segments with parameters have a backward; it is measured, not a multiple of forward.
    with_params = [c for c in costs if c.trainable_param_bytes > 0]
    assert with_params and all(c.bwd_s > 0 for c in with_params)
    assert len({round(c.bwd_s / c.fwd_s, 6) for c in with_params}) > 1


def test_parameter_bytes_add_up_to_the_model(small_transformer, small_traced):
    model, _ = small_transformer
    costs = profile_segments(small_traced, cost="flops", progress=False, device_flops=1e9)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    assert sum(c.param_bytes for c in costs) == total


def test_activation_bytes_count_tensors_saved_for_backward_not_parameters():
    lin = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(4, 16)
    costs = profile_segments(trace(lin, (x,)), cost="flops", progress=False, device_flops=1e9)
    # The second linear saves its 4x16 float input for the weight gradient; no 16x16 weight.
    assert costs[1].act_bytes == 4 * 16 * 4


def test_model_state_gradients_and_rng_are_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(6, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    profile_segments(trace(model, (x,)), warmup=1, repeats=2, progress=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats restored
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_flops_source_estimates_time_from_counted_flops(small_traced):
    costs = profile_segments(small_traced, cost="flops", device_flops=1e9, progress=False)
    head = costs[-1]
    assert head.flops > 0
    assert head.fwd_s + head.bwd_s == pytest.approx(head.flops / 1e9)


def test_params_source_shares_time_by_parameter_bytes(small_traced):
    costs = profile_segments(small_traced, cost="params", device_flops=1e9, progress=False)
    a, b = costs[-1], max(costs[:-1], key=lambda c: c.param_bytes)
    assert (a.fwd_s + a.bwd_s) / (b.fwd_s + b.bwd_s) == pytest.approx(a.param_bytes / b.param_bytes)


def test_unknown_cost_source_is_rejected_before_any_work(small_traced):
    with pytest.raises(ValueError, match=r"cost='guess' is not a cost source; use one of \['measured', 'flops', 'params'\]"):
        profile_segments(small_traced, cost="guess")


@pytest.mark.parametrize("kw", [{"repeats": 0}, {"warmup": -1}])
def test_bad_repeat_counts_are_rejected(small_traced, kw):
    with pytest.raises(ValueError, match=list(kw)[0]):
        profile_segments(small_traced, **kw)


def test_device_flops_is_measured():
    assert measure_device_flops("cpu", size=128, repeats=1) > 1e6


def test_a_model_on_the_profiling_device_is_timed_in_rounds_over_all_segments(small_traced, flushers_built):
    # Rounds (every forward in order, then every backward in reverse) instead of one segment
    # repeated back to back, whose warm cache made it look up to 1.5x faster than in training.
    costs = profile_segments(small_traced, device="cpu", warmup=1, repeats=2, progress=False)
    assert len(costs) == small_traced.num_segments and all(c.fwd_s > 0 for c in costs)
    # Timed beside the whole graph; not scaled to it on the CPU by default.
    assert costs.whole is not None and not costs.whole.fitted
    assert sum(c.fwd_s for c in costs) == pytest.approx(costs.whole.segments_fwd_s)
    assert flushers_built == [1]  # the default empties the caches between the passes
    profile_segments(small_traced, device="cpu", warmup=0, repeats=1, progress=False, flush_cache=False)
    assert flushers_built == [1]


class _EventLog:
    """A timer and a cache flush that write what happened, in order, into one list."""

    def __init__(self):
        self.events, self.device = [], torch.device("cpu")

    def time(self, fn):
        self.events.append("timed")
        return 1.0, fn()

    def flush(self):
        self.events.append("flush")


def test_each_pass_of_a_round_starts_with_the_caches_emptied():
    # A pipeline action starts with its stage's weights out of the cache and then runs the
    # stage's segments back to back: one flush before the forwards, one before the backwards.
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    segments = [(torch.fx.symbolic_trace(m), lambda: [torch.randn(2, 4)], list(m.parameters())) for m in layers]
    log = _EventLog()
    time_in_rounds(segments, log, warmup=1, repeats=1, flush=log.flush, backward_start_s=0.0)
    # Two forwards; then each backward, followed by the accumulation of its weight gradients.
    one_round = ["flush", "timed", "timed", "flush", "timed", "timed", "timed", "timed"]
    assert log.events == one_round * 2
    log.events.clear()
    time_in_rounds(segments, log, warmup=0, repeats=1, backward_start_s=0.0)  # no flush given: none run
    assert log.events == ["timed"] * 6
    # The whole graph, when given, is timed after the segments in each round, with flushes of its own.
    log.events.clear()
    whole = (torch.fx.symbolic_trace(nn.Sequential(*layers)), lambda: [torch.randn(2, 4)],
             [p for m in layers for p in m.parameters()])
    time_in_rounds(segments, log, warmup=0, repeats=1, flush=log.flush, whole=whole, backward_start_s=0.0)
    assert log.events == one_round + ["flush", "timed", "flush", "timed", "timed"]


def test_an_accumulation_is_timed_only_after_a_backward_that_produced_weight_gradients():
    # A segment without weights (ReLU) has a backward, for its input's gradient, but nothing
    # to add into a .grad; a stage's AccumulateGrad runs for parameters only.
    layer = nn.Linear(4, 4)
    segments = [(torch.fx.symbolic_trace(layer), lambda: [torch.randn(2, 4)], list(layer.parameters())),
                (torch.fx.symbolic_trace(nn.ReLU()), lambda: [torch.randn(2, 4, requires_grad=True)], [])]
    log = _EventLog()
    [linear, relu], _ = time_in_rounds(segments, log, warmup=0, repeats=1, backward_start_s=0.0)
    # Two forwards, the ReLU's backward, then the linear's backward and its accumulation.
    assert log.events == ["timed"] * 5
    assert linear == (1.0, 1.0, 1.0) and relu == (1.0, 1.0, 0.0)


def test_the_cache_flusher_writes_a_buffer_twice_the_last_level_cache(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("AUTOPIPE_LLC_BYTES", raising=False)  # the size the host reports
    llc = last_level_cache_bytes(cpu)
    assert llc >= 1 << 20  # every CPU this runs on has at least 1 MiB of last-level cache
    flush = CacheFlusher(cpu)
    assert flush.nbytes == 2 * llc
    flush()
    first = int(flush.buffer[-1])
    flush()
    assert int(flush.buffer[0]) == int(flush.buffer[-1]) != first  # every byte rewritten, new value
    assert CacheFlusher(cpu, nbytes=4096).nbytes == 4096


def test_the_cache_size_the_environment_gives_replaces_the_hosts(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("AUTOPIPE_LLC_BYTES", "3MiB")
    assert last_level_cache_bytes(cpu) == 3 << 20 and CacheFlusher(cpu).nbytes == 6 << 20
    monkeypatch.setenv("AUTOPIPE_LLC_BYTES", "lots")
    with pytest.raises(ValueError, match="AUTOPIPE_LLC_BYTES='lots' is not a memory size"):
        CacheFlusher(cpu)


def test_flush_cache_must_be_a_bool(small_traced):
    with pytest.raises(ValueError, match="flush_cache='yes' must be True or False"):
        profile_segments(small_traced, device="cpu", progress=False, flush_cache="yes")


def test_the_fixed_cost_of_starting_a_backward_is_not_charged_to_every_segment():
    # A stage starts one backward for all its segments: the profile charges a segment its
    # backward minus the cost of starting one (never below zero).
    segments, _ = _two_linear_segments_and_whole()
    # One round: the two forwards, then each backward and its accumulation, the last segment first.
    one_round = [1.0, 1.0, 3.0, 0.5, 2.0, 0.5]
    as_timed, _ = time_in_rounds(segments, _ScriptedTimer(one_round), warmup=0, repeats=1, backward_start_s=0.0)
    charged, _ = time_in_rounds(segments, _ScriptedTimer(one_round), warmup=0, repeats=1, backward_start_s=1.5)
    longer, _ = time_in_rounds(segments, _ScriptedTimer(one_round), warmup=0, repeats=1, backward_start_s=1e3)
    assert [b for _, b, _ in as_timed] == [2.0, 3.0]
    assert [b for _, b, _ in charged] == [0.5, 1.5]
    assert [b for _, b, _ in longer] == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"backward_start_s=-1.0 must be a finite number of seconds >= 0"):
        time_in_rounds(segments, _ScriptedTimer(one_round), warmup=0, repeats=1, backward_start_s=-1.0)


def test_the_cost_of_starting_a_backward_is_the_median_of_tiny_backwards():
    assert measure_backward_start_s(_ScriptedTimer([3.0, 1.0, 2.0]), repeats=3) == 2.0


def test_a_segment_is_charged_the_mean_of_its_timed_runs_not_the_median():
    # A step adds every micro-batch's forward and backward up, so the run that is now and then
    # slow counts: the profile keeps the mean (per_run_s), which a median would hide.
    layer = nn.Linear(4, 4)
    segment = (torch.fx.symbolic_trace(layer), lambda: [torch.randn(2, 4)], list(layer.parameters()))
    # Three rounds of (forward, backward, accumulation): the third round is four times as slow.
    timer = _ScriptedTimer([1.0, 2.0, 0.5, 1.0, 2.0, 0.5, 4.0, 8.0, 2.0])
    [(fwd_s, bwd_s, accum_s)], _ = time_in_rounds([segment], timer, warmup=0, repeats=3, backward_start_s=0.0)
    assert (fwd_s, bwd_s, accum_s) == (2.0, 4.0, 1.0)  # the medians would be 1.0, 2.0 and 0.5


def test_the_profile_times_adding_each_backward_s_weight_gradients_into_accumulated_ones():
    # torch's pipeline stages accumulate every micro-batch's weight gradients into .grad (an
    # in-place add per parameter for all but the first micro-batch); autograd.grad does not.
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    costs = profile_segments(trace(model, (torch.randn(3, 8),)), device="cpu", warmup=0, repeats=2,
                             progress=False, flush_cache=False)
    with_weights = [c for c in costs if c.trainable_param_bytes]
    assert with_weights and all(c.accum_s > 0 for c in with_weights)
    assert all(c.accum_s == 0.0 for c in costs if not c.trainable_param_bytes)
    assert costs.whole.accum_s > 0  # the whole graph timed beside them accumulates too
    assert all(p.grad is None for p in model.parameters())  # into buffers of the profile's own
    # The accumulation itself: an in-place add, leaving None gradients (unused parameters) alone.
    acc = [torch.zeros(2), torch.ones(2)]
    accumulate(acc, [torch.full((2,), 3.0), None])
    assert acc[0].tolist() == [3.0, 3.0] and acc[1].tolist() == [1.0, 1.0]


def test_per_run_s_is_the_mean_and_refuses_no_samples():
    assert per_run_s([0.001, 0.001, 0.004]) == pytest.approx(0.002)
    assert per_run_s([0.5]) == 0.5
    with pytest.raises(ValueError, match=r"samples=\[\] is empty"):
        per_run_s([])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_segment_copied_to_another_device_names_only_that_device(family):
    """GPT-2 builds its position ids with arange(device=cpu) and Llama's export checks its
    rotary table's device: a copy for the GPU must name the GPU there, or the first profile
    on a GPU of a model living on the CPU fails. Checked here with the meta device."""
    from zoo import hf

    make = hf.gpt2_from_config if family == "gpt2" else hf.llama_from_config
    model, args = make(n_layer=1, n_embd=32, n_head=4, vocab_size=64, seq_len=8) if family == "gpt2" \
        else make(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_len=8)
    traced = trace(model, args)
    graph = traced.graph_module
    named_cpu = [n for n in graph.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]
    assert named_cpu, "the traced graph names no device: this test checks nothing"
    moved = copy_to_device(graph, "meta")
    devices = {str(n.kwargs["device"]) for n in moved.graph.nodes if "device" in n.kwargs}
    assert devices == {"meta"}
    assert {t.device.type for t in (*moved.parameters(), *moved.buffers())} == {"meta"}
    # The user's model and its graph are untouched.
    assert {str(n.kwargs["device"]) for n in named_cpu} == {"cpu"}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # Each segment runs on the new device from inputs there.
    out = moved(*[a.to("meta") for a in args])
    assert all(t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    for sm in segment_modules(traced):
        seg = copy_to_device(sm.module, "meta")
        assert all(str(n.kwargs["device"]) == "meta" for n in seg.graph.nodes if "device" in n.kwargs)


def test_the_whole_graph_is_timed_beside_the_segments_and_recorded(small_traced):
    # Every profile in rounds also times the whole graph as one (a stage runs its segments
    # that way); on the CPU it is recorded, and the segments keep their own times.
    costs = profile_segments(small_traced, device="cpu", warmup=0, repeats=2, progress=False)
    whole = costs.whole
    assert whole is not None and not whole.fitted
    assert whole.fwd_s > 0 and whole.bwd_s > 0 and whole.accum_s > 0
    assert whole.segments_fwd_s == pytest.approx(sum(c.fwd_s for c in costs))
    # The segments' backwards as timed, each with its own start, which the costs leave out.
    assert whole.segments_bwd_s > sum(c.bwd_s for c in costs) > 0
    # Estimated sources and copied segments time no rounds: nothing to record.
    assert profile_segments(small_traced, cost="flops", device_flops=1e9, progress=False).whole is None


class _ScriptedTimer:
    """Runs the work, reports the scripted seconds in order."""

    def __init__(self, seconds):
        self.seconds, self.device = iter(seconds), torch.device("cpu")

    def time(self, fn):
        return next(self.seconds), fn()


def _two_linear_segments_and_whole():
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    segments = [(torch.fx.symbolic_trace(m), lambda: [torch.randn(2, 4)], list(m.parameters())) for m in layers]
    whole = (torch.fx.symbolic_trace(nn.Sequential(*layers)), lambda: [torch.randn(2, 4)],
             [p for m in layers for p in m.parameters()])
    return segments, whole


# Per round: the two segments' forwards, their backward + accumulation each (last segment
# first), then the whole graph's forward, backward and accumulation.
_ROUND = [1.0, 3.0, 2.0, 0.5, 4.0, 0.5]


def test_fit_scales_each_pass_so_the_segments_add_up_to_the_whole():
    segments, whole = _two_linear_segments_and_whole()
    timer = _ScriptedTimer((_ROUND + [2.0, 9.0, 4.0]) * 2)
    fitted, wp = time_in_rounds(segments, timer, warmup=0, repeats=2, whole=whole, fit=True, backward_start_s=0.25)
    assert wp.fitted and wp.scales == pytest.approx((0.5, 1.5, 4.0))
    assert (wp.segments_fwd_s, wp.segments_bwd_s, wp.segments_accum_s) == pytest.approx((4.0, 6.0, 1.0))
    # Shares kept, totals those of the whole graph; no backward start taken off (the whole pays one).
    assert fitted == [pytest.approx((0.5, 6.0, 2.0)), pytest.approx((1.5, 3.0, 2.0))]
    # Not fitted: the segments' own means, each backward less the start it paid on its own.
    timer = _ScriptedTimer((_ROUND + [2.0, 9.0, 4.0]) * 2)
    plain, wp = time_in_rounds(segments, timer, warmup=0, repeats=2, whole=whole, backward_start_s=0.25)
    assert not wp.fitted and plain == [pytest.approx((1.0, 3.75, 0.5)), pytest.approx((3.0, 1.75, 0.5))]


def test_the_scales_are_the_median_over_rounds_of_whole_over_segments():
    # One round in which only the whole graph was slowed down (a disturbance on the host)
    # must not drag the segments' times with it.
    segments, whole = _two_linear_segments_and_whole()
    rounds = [_ROUND + [2.0, 6.0, 1.0], _ROUND + [20.0, 6.0, 1.0], _ROUND + [2.0, 6.0, 1.0]]
    _, wp = time_in_rounds(segments, _ScriptedTimer([x for r in rounds for x in r]), warmup=0, repeats=3,
                           whole=whole, backward_start_s=0.0)
    assert wp.scales == pytest.approx((0.5, 1.0, 1.0))
    assert wp.fwd_s == pytest.approx(8.0) and wp.segments_fwd_s == pytest.approx(4.0)  # the means


def test_profile_segments_hands_the_whole_graph_and_the_fit_to_the_rounds(small_traced):
    fitted = profile_segments(small_traced, device="cpu", warmup=0, repeats=1, progress=False, fit_to_whole=True)
    plain = profile_segments(small_traced, device="cpu", warmup=0, repeats=1, progress=False)
    assert fitted.whole.fitted and not plain.whole.fitted  # the CPU's default: not fitted
    assert sum(c.fwd_s for c in fitted) == pytest.approx(fitted.whole.segments_fwd_s * fitted.whole.scales[0])


def test_fit_to_whole_defaults_to_cuda_only_and_rejects_other_values(small_traced):
    assert fit_to_whole_default(torch.device("cuda", 0)) and not fit_to_whole_default(torch.device("cpu"))
    with pytest.raises(ValueError, match="fit_to_whole='yes' must be True, False or None"):
        profile_segments(small_traced, device="cpu", progress=False, fit_to_whole="yes")


def test_the_whole_graph_gets_keyword_inputs_as_the_model_does():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x, *, shift):
            return self.b(torch.relu(self.a(x) + shift))

    traced = trace(Scaled(), (torch.randn(3, 4),), {"shift": torch.randn(3, 4)})
    costs = profile_segments(traced, device="cpu", warmup=0, repeats=1, progress=False, flush_cache=False)
    assert costs.whole.fwd_s > 0 and costs.whole.bwd_s > 0


def test_a_cuda_device_without_an_index_resolves_to_the_current_one(monkeypatch):
    # tensor.device always carries an index, and torch.device("cuda") != torch.device("cuda:0"):
    # unresolved, a model already on the GPU looked elsewhere and was profiled as copies.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_model_living_elsewhere_is_profiled_as_a_whole_copy_when_it_fits(small_traced):
    # As on a GPU for a model kept on the CPU (the meta device stands in for the GPU here): a
    # copy of the whole model goes to the device and is timed in rounds beside its whole
    # graph; the user's model is not touched.
    user_graph = small_traced.graph_module
    before = {n: p.detach().clone() for n, p in user_graph.named_parameters()}
    costs = profile_segments(small_traced, device="meta", warmup=0, repeats=1, progress=False)
    assert len(costs) == small_traced.num_segments
    assert costs.whole is not None  # rounds, which only a whole copy on the device is timed in
    assert all(p.device.type == "cpu" for p in user_graph.parameters())
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in user_graph.named_parameters())


def test_a_model_too_big_for_the_device_is_profiled_one_segment_at_a_time(small_traced, monkeypatch):
    # The device runs out of memory for the whole copy (simulated: a real out-of-memory cannot
    # be had safely here): each segment is copied there and timed on its own instead.
    import autopipe.planning.profile as profile

    user_graph = small_traced.graph_module
    copied = []

    def copy_or_oom(module, device):
        if module is user_graph:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        copied.append(module)
        return copy_to_device(module, device)

    monkeypatch.setattr(profile, "copy_to_device", copy_or_oom)
    costs = profile_segments(small_traced, device="meta", warmup=0, repeats=1, progress=False)
    assert costs.whole is None and len(costs) == len(copied) == small_traced.num_segments


def test_no_room_on_the_device_skips_the_whole_copy(small_traced, monkeypatch):
    import autopipe.planning.profile as profile

    monkeypatch.setattr(profile, "room_for_whole", lambda module, dev: False)  # a device nearly full
    costs = profile_segments(small_traced, device="meta", warmup=0, repeats=1, progress=False)
    assert costs.whole is None and len(costs) == small_traced.num_segments  # timed one segment at a time


def test_only_cuda_s_free_memory_limits_the_whole_copy():
    assert room_for_whole(nn.Linear(4096, 4096), torch.device("cpu"))
    assert room_for_whole(nn.Linear(4096, 4096), torch.device("meta"))


def test_steps_are_compared_round_by_round_and_the_search_settles_on_one_nothing_beats():
    # "b" steps a tenth slower than "a" in four rounds of five; in the third the host sped up
    # between a's step and b's. That one round pulls b's median below a's: pooled medians say "b".
    a, b = [1.0, 1.0, 2.0, 2.0, 2.0], [1.1, 1.1, 1.1, 2.2, 2.2]
    assert statistics.median(b) < statistics.median(a)
    assert fastest_paired({"a": a, "b": b}) == ("a", {"a": 1.0, "b": pytest.approx(1.1)})
    # Medians of ratios are not transitive: x beats y, y beats z, z beats x. Nothing is
    # unbeaten, so the start stays, whichever it is, with the ratios over it.
    steps = {"x": [1.0, 2.0, 3.0], "y": [2.0, 3.0, 1.0], "z": [3.0, 1.0, 2.0]}
    assert paired_ratio(steps["x"], steps["y"]) < 1 and paired_ratio(steps["y"], steps["z"]) < 1
    assert paired_ratio(steps["z"], steps["x"]) < 1
    for start in steps:
        kept, ratios = fastest_paired(steps, start=start)
        assert kept == start and ratios == {k: paired_ratio(v, steps[start]) for k, v in steps.items()}
    # The same circle beside a variant that beats all three: that one is chosen from any start,
    # though the circle's members beat each other on the way.
    steps["w"] = [0.9, 0.9, 0.9]
    assert {fastest_paired(steps, start=s)[0] for s in steps} == {"w"}
    # A start that nothing beats is kept even where another has the lower median.
    assert fastest_paired({"own": [1.0, 1.0, 1.0], "other": [1.0, 0.5, 1.0]}, start="own")[0] == "own"
    with pytest.raises(ValueError, match="positive reference"):
        paired_ratio([1.0], [0.0])


def test_the_interval_of_a_paired_ratio_holds_it_and_narrows_with_agreeing_rounds():
    reference = [1.0, 2.0, 1.5, 1.2, 1.8, 1.1, 1.4]
    noisy = [a * f for a, f in zip(reference, [0.9, 1.2, 1.0, 0.85, 1.1, 1.05, 0.95])]
    low, high = paired_ratio_interval(noisy, reference)
    assert low <= paired_ratio(noisy, reference) <= high and low < 1.0 < high
    assert paired_ratio_interval(noisy, reference) == (low, high)  # seeded: every rank computes the same
    assert paired_ratio_interval([1.1 * a for a in reference], reference) == pytest.approx((1.1, 1.1))
    narrow = paired_ratio_interval(noisy, reference, level=0.5)
    assert low <= narrow[0] <= narrow[1] <= high
    with pytest.raises(ValueError, match="positive reference"):
        paired_ratio_interval([1.0], [0.0])
