"""profile_scaling(): costs as functions of the micro-batch size, fitted once, evaluated anywhere."""

from __future__ import annotations

import doctest
import importlib
import json

import numpy as np
import pytest
import sympy
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import autopipe.planning.scaling as scaling
from autopipe.planning.costgraph import build_cost_graph
from autopipe.models import seed_transformer
from autopipe.planning.profile import profile_segments
from autopipe.planning.affine_fit import B, fit_affine
from autopipe.planning.scaling import ScaledProfile, profile_scaling, resize_batch
from autopipe.planning.tracing import trace

FLOPS = 1e9  # a fixed device speed, so the "flops" source needs no measuring


@pytest.fixture(scope="module")
def tiny():
    """The seed Transformer with an example micro-batch of 2 samples."""
    return seed_transformer(vocab_size=200, d_model=16, num_heads=2, d_ff=32, num_layers=2, batch=2, seq_len=8)


@pytest.fixture(scope="module")
def scaled_flops(tiny) -> ScaledProfile:
    model, args = tiny
    return profile_scaling(model, args, cost="flops", device_flops=FLOPS, progress=False)


@pytest.fixture(scope="module")
def scaled_measured(tiny) -> ScaledProfile:
    model, args = tiny
    return profile_scaling(model, args, sizes=(1, 2, 4), warmup=0, repeats=1, progress=False)


# --------------------------------------------------------------------------- fit_affine


def test_fit_recovers_an_exact_line():
    fit = fit_affine([1, 2, 4], [3.5 + 2.0 * b for b in (1, 2, 4)])
    assert float(fit.expr.coeff(B)) == pytest.approx(2.0)
    assert float(fit.expr.subs(B, 0)) == pytest.approx(3.5)
    assert fit.rel_error == pytest.approx(0.0, abs=1e-12) and not fit.clamped


def test_count_fits_get_integer_coefficients_when_exact():
    fit = fit_affine([1, 3, 5], [100 + 64 * b for b in (1, 3, 5)], integer=True)
    assert fit.expr == 64 * B + 100
    assert fit.rel_error == 0.0


def test_fit_error_is_the_worst_relative_miss():
    # Least squares through (1, 1), (2, 3), (3, 2) is 1 + 0.5b: misses 0.5/1, 1/3, 0.5/2.
    fit = fit_affine([1, 2, 3], [1.0, 3.0, 2.0])
    assert fit.rel_error == pytest.approx(0.5)


def test_a_negative_slope_from_noise_is_clamped_to_a_constant():
    fit = fit_affine([1, 2, 4], [5.0, 4.0, 3.0])
    assert fit.clamped
    assert fit.expr.coeff(B) == 0
    assert float(fit.expr) == pytest.approx(4.0)


def test_a_fit_negative_at_size_one_is_clamped_to_zero_there():
    # Unconstrained: -30 + 30b, i.e. 0 at b=1 is fine, but steeper data goes below zero.
    fit = fit_affine([1, 2, 4], [0.0, 0.0, 90.0])
    assert fit.clamped
    assert float(fit.expr.subs(B, 1)) == pytest.approx(0.0, abs=1e-12)
    assert float(fit.expr.coeff(B)) > 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=3, max_size=3))
def test_every_fit_is_non_negative_and_non_decreasing(values):
    fit = fit_affine([1, 2, 4], values)
    slope = float(fit.expr.coeff(B))
    assert slope >= 0
    assert float(fit.expr.subs(B, 1)) >= -1e-9 * max(values + [1.0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=3, max_size=3))
def test_an_unclamped_fit_is_the_ordinary_least_squares_line(values):
    fit = fit_affine([1, 2, 4], values)
    if not fit.clamped:
        c, a = np.polyfit([1, 2, 4], values, 1)
        assert float(fit.expr.subs(B, 3)) == pytest.approx(a + 3 * c, abs=1e-6)


def test_fit_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match="sizes="):
        fit_affine([2, 2], [1.0, 1.0])


# --------------------------------------------------------------------------- resize_batch


def test_resize_repeats_samples_and_leaves_other_tensors_alone():
    x = torch.tensor([[1, 1], [2, 2]])
    table = torch.zeros(5, 3)  # not a batch: its first dimension is not 2
    args = (x, table, 7)
    out = resize_batch(args, batch_dim=0, from_size=2, to_size=3)
    assert out[0].tolist() == [[1, 1], [2, 2], [1, 1]]
    assert out[1] is table and out[2] == 7


# --------------------------------------------------------------------------- profile_scaling


def test_default_sizes_halve_and_double_the_example_micro_batch(scaled_flops):
    assert scaled_flops.sizes == [1, 2, 4]
    assert scaled_flops.base_size == 2


def test_byte_fits_are_exact_for_the_seed_transformer(scaled_flops):
    for quantity in ("act_bytes", "out_bytes", "flops", "cut_fwd_bytes", "cut_bwd_bytes"):
        assert max(scaled_flops.fit_error[quantity]) == 0.0, quantity


def test_activation_and_cut_bytes_at_a_held_out_size_match_a_fresh_profile(tiny, scaled_flops):
    model, (x,) = tiny
    x3 = resize_batch(x, batch_dim=0, from_size=2, to_size=3)
    traced = trace(model, (x3,))
    fresh = profile_segments(traced, cost="flops", device_flops=FLOPS, progress=False)
    predicted = scaled_flops.costs_at(3)
    assert [c.act_bytes for c in predicted] == [c.act_bytes for c in fresh]
    cost_graph = build_cost_graph(traced)
    assert scaled_flops.cut_bytes_at(3) == (cost_graph.cut_fwd_bytes, cost_graph.cut_bwd_bytes)


def test_flops_source_times_are_positive_and_grow_with_the_micro_batch(scaled_flops):
    totals = [sum(c.time_s for c in scaled_flops.costs_at(b)) for b in (1, 2, 3, 8, 32)]
    assert totals[0] > 0
    assert all(a < b for a, b in zip(totals, totals[1:]))


def test_measured_times_are_non_negative_and_non_decreasing(scaled_measured):
    per_size = [scaled_measured.costs_at(b) for b in range(1, 17)]
    for k in range(scaled_measured.num_segments):
        times = [costs[k].time_s for costs in per_size]
        assert min(times) >= 0
        assert all(a <= b + 1e-15 for a, b in zip(times, times[1:]))
    assert sum(c.time_s for c in per_size[0]) > 0


def test_parameter_bytes_do_not_depend_on_the_micro_batch(scaled_flops):
    assert [c.param_bytes for c in scaled_flops.costs_at(1)] == [c.param_bytes for c in scaled_flops.costs_at(64)]
    assert scaled_flops.param_bytes == [c.param_bytes for c in scaled_flops.measured[2]]


class _BranchOnBatch(nn.Module):
    """Calls ``middle`` only for batches of more than one sample: a different graph at b=1."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.middle = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if x.shape[0] > 1:
            x = self.middle(x)
        return self.last(x)


def test_segments_that_differ_between_sizes_raise():
    with pytest.raises(ValueError, match="segments differ between micro-batch sizes 1"):
        profile_scaling(_BranchOnBatch(), (torch.randn(2, 4),), sizes=(1, 2), cost="flops",
                        device_flops=FLOPS, progress=False)


@pytest.mark.parametrize("sizes", [(4,), (2, 2), (0, 2), (-1, 2), (1.5, 2), (True, 2), "12"])
def test_bad_sizes_raise_before_tracing(monkeypatch, sizes):
    def no_trace(*args, **kwargs):
        raise AssertionError("the model was traced for bad sizes")

    monkeypatch.setattr(scaling, "trace", no_trace)
    with pytest.raises(ValueError, match="sizes="):
        profile_scaling(nn.Linear(4, 4), (torch.randn(2, 4),), sizes=sizes, cost="flops", device_flops=FLOPS)


def test_a_given_trace_is_profiled_for_its_size_instead_of_exporting_again(tiny, scaled_flops, monkeypatch):
    model, args = tiny
    traced = trace(model, args)
    exported_sizes = []

    def counting_trace(model, args, kwargs):
        exported_sizes.append(args[0].shape[0])
        return trace(model, args, kwargs)

    monkeypatch.setattr(scaling, "trace", counting_trace)
    reused = profile_scaling(model, args, cost="flops", device_flops=FLOPS, progress=False, traced=traced)
    assert exported_sizes == [1, 4]  # the example size, 2, comes from the given trace
    assert reused.cut_fwd_bytes == scaled_flops.cut_fwd_bytes
    assert reused.costs_at(3) == scaled_flops.costs_at(3)


def test_a_trace_of_another_micro_batch_size_or_model_is_refused(tiny):
    model, (x,) = tiny
    with pytest.raises(ValueError, match="traced holds a micro-batch of 4 samples .* example inputs have 2"):
        profile_scaling(model, (x,), cost="flops", device_flops=FLOPS, progress=False,
                        traced=trace(model, (resize_batch(x, batch_dim=0, from_size=2, to_size=4),)))
    with pytest.raises(ValueError, match="traced is a trace of Linear"):
        profile_scaling(model, (x,), cost="flops", device_flops=FLOPS, progress=False,
                        traced=trace(nn.Linear(8, 8), (torch.randn(2, 8),)))
    with pytest.raises(TypeError, match="traced must be a TracedModel"):
        profile_scaling(model, (x,), cost="flops", device_flops=FLOPS, progress=False, traced="layers.0")


def test_a_flush_cache_that_is_not_a_bool_raises_before_tracing(monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("the model was traced for a bad flush_cache")

    monkeypatch.setattr(scaling, "trace", no_trace)
    with pytest.raises(ValueError, match="flush_cache=1 must be True or False"):
        profile_scaling(nn.Linear(4, 4), (torch.randn(2, 4),), flush_cache=1)
    with pytest.raises(ValueError, match="fit_to_whole=1 must be True, False or None"):
        profile_scaling(nn.Linear(4, 4), (torch.randn(2, 4),), fit_to_whole=1)


def test_a_batch_dim_no_input_has_raises():
    with pytest.raises(ValueError, match="batch_dim=3"):
        profile_scaling(nn.Linear(4, 4), (torch.randn(2, 4),), batch_dim=3, cost="flops", device_flops=FLOPS)


def test_evaluating_at_a_size_below_one_raises(scaled_flops):
    with pytest.raises(ValueError, match="b=0"):
        scaled_flops.costs_at(0)


def test_json_round_trip_keeps_every_prediction(scaled_measured):
    text = json.dumps(scaled_measured.to_dict())
    back = ScaledProfile.from_dict(json.loads(text))
    assert back.segment_names == scaled_measured.segment_names
    assert back.cut_bytes_at(5) == scaled_measured.cut_bytes_at(5)
    for got, want in zip(back.costs_at(5), scaled_measured.costs_at(5)):
        assert got.act_bytes == want.act_bytes
        assert got.fwd_s == pytest.approx(want.fwd_s, rel=1e-12)
        assert got.bwd_s == pytest.approx(want.bwd_s, rel=1e-12)
        assert got.accum_s == want.accum_s  # the gradients' size, whatever the micro-batch
    assert any(c.accum_s > 0 for c in scaled_measured.costs_at(5))
    assert back.fit_error == scaled_measured.fit_error
    assert back.measured[2] == scaled_measured.measured[2]


def test_expressions_are_read_back_in_the_positive_integer_symbol(scaled_flops):
    back = ScaledProfile.from_dict(json.loads(json.dumps(scaled_flops.to_dict())))
    k = back.segment_names.index("layers.1")
    assert back.cut_fwd_bytes[k] == scaled_flops.cut_fwd_bytes[k]
    assert back.cut_fwd_bytes[k].free_symbols == {B}
    assert sympy.ask(sympy.Q.positive(back.cut_fwd_bytes[k]))


def test_report_lists_the_worst_fit_error_of_each_quantity(scaled_flops):
    text = scaled_flops.report()
    assert "b = 1, 2, 4" in text
    assert "act_bytes" in text and "exact" in text
    assert "Whole model" in text



@pytest.mark.parametrize("module", ["autopipe.planning.scaling", "autopipe.planning.affine_fit"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
