"""What torch.export changes in a model is kept or refused, never trained silently.

Custom autograd Functions keep their own backward (autopipe.planning.autograd_functions); the
traced program's gradients are compared with eager autograd's (autopipe.planning.export_check);
data-dependent sizes are counted and the cuts they would cross are not offered.
"""

from __future__ import annotations

import pytest
import torch

import autopipe
from autopipe.errors import ModelExportError
from autopipe.planning import autograd_functions
from autopipe.planning.costgraph import build_cost_graph
from autopipe.planning.export_check import compare_with_eager
from autopipe.planning.tracing import trace
from autopipe.runtime.materialize import meta_twin

from _dist_utils import run_world
from zoo.export_cases import build
import _export_workers as workers

FLOPS = autopipe.PlannerOptions(cost="flops", profiling=autopipe.ProfileOptions(progress=False))


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    params = list(module.parameters())
    grads = torch.autograd.grad(module(x).square().sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@pytest.mark.parametrize("kind", ["ste", "grl", "fused"])
def test_a_traced_custom_function_keeps_its_own_backward(kind):
    model, (x,), _ = build(kind)
    traced = trace(model, (x,))
    for got, want in zip(_grads(traced.graph_module, x), _grads(model, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert any("custom autograd Functions kept whole" in n and "zoo.export_cases." in n for n in traced.notes)


def test_without_the_kept_backward_the_gradient_check_refuses_naming_the_parameters(monkeypatch):
    # As torch.export alone captures it, the straight-through estimator passes no gradient.
    monkeypatch.setattr(autograd_functions, "_kept", lambda function: False)
    model, (x,), _ = build("ste")
    with pytest.raises(ModelExportError, match=r"blocks\.1\.linear\.weight: differs by up to") as caught:
        trace(model, (x,))
    assert caught.value.kind == "gradient-mismatch"


def test_a_hook_registered_in_forward_is_refused_with_the_remedy():
    model, (x,), _ = build("hooked")
    with pytest.raises(ModelExportError) as caught:
        trace(model, (x,))
    text = str(caught.value)
    assert caught.value.kind == "gradient-mismatch"
    assert "first.weight" in text and "first.bias" in text and "second.weight" not in text
    assert "Tensor.register_hook" in text and "AUTOPIPE_GRADIENT_CHECK=0" in text


def test_the_check_can_be_switched_off_and_leaves_the_model_as_it_was(monkeypatch):
    model, (x,), _ = build("hooked")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv("AUTOPIPE_GRADIENT_CHECK", "0")
    traced = trace(model, (x,))
    assert traced.candidates and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_check_restores_batch_norm_statistics_and_matches_dropout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5),
                                torch.nn.Linear(4, 2))
    x = torch.randn(8, 4)
    stats = model[1].running_mean.clone()
    result = compare_with_eager(model, torch.export.export(model, (x,)).module(), (x,))
    assert result.ran and result.differing == {}
    assert torch.equal(model[1].running_mean, stats)


class _ReturnsCount(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 3

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2


class _Scales(torch.nn.Module):
    def forward(self, x):
        return _ReturnsCount.apply(x)[0]


def test_a_function_the_capture_cannot_keep_is_refused_by_name():
    with pytest.raises(ModelExportError, match=r"_ReturnsCount\.forward returns int") as caught:
        trace(torch.nn.Sequential(torch.nn.Linear(2, 2), _Scales()), (torch.randn(1, 2),))
    assert caught.value.kind == "autograd-function"


@pytest.mark.parametrize("n_gpus", [2, 4])
def test_a_top2_moe_plans_with_its_routed_sizes_measured(n_gpus):
    model, (x,), _ = build("moe")
    plan = autopipe.partition(model, n_gpus=n_gpus, example_args=(x,), planner=FLOPS)
    assert plan.num_stages == n_gpus
    assert any("data-dependent sizes counted as: 16 sizes (u0 to u15) from " in n and "(on the example micro-batch)" in n
               for n in plan.notes)


def test_a_moe_on_the_meta_device_counts_routed_rows_at_their_bound():
    model, (x,), _ = build("moe")
    traced = trace(meta_twin(model), (x.to("meta"),))
    routed = x.shape[0] * x.shape[1] * 2  # tokens x top-k: nonzero over the (tokens, k) routing table
    assert traced.unbacked_sizes and set(traced.unbacked_sizes.values()) == {routed}
    assert any("(their upper bound)" in n for n in traced.notes)
    cg = build_cost_graph(traced)
    assert all(b >= 0 for b in cg.cut_fwd_bytes)


def test_cuts_a_data_dependent_tensor_would_cross_are_not_offered():
    model, (x,), _ = build("masked")
    traced = trace(model, (x,))
    assert traced.split_point_names == ["head"]
    assert set(traced.excluded_cuts) == {"mix"}
    with pytest.raises(ValueError, match=r"more are not offered: "
                                         r"mix .*pad or pool"):
        autopipe.partition(build("masked_unpooled")[0], n_gpus=2, example_args=(x,), planner=FLOPS)


# ---------------------------------------------------------------- trained on 2 ranks

RUNS = [("ste", "1F1B"), ("ste", "ZBVZeroBubble"), ("grl", "1F1B"), ("grl", "Interleaved1F1B"),
        ("fused", "1F1B"), ("fused", "ZBVZeroBubble"), ("moe", "1F1B"), ("moe", "Interleaved1F1B"),
        ("masked", "GPipe")]


@pytest.fixture(scope="module")
def trained() -> dict[tuple[str, str], list[dict]]:
    per_rank = run_world(workers.train_cases, 2, RUNS, timeout_s=400)
    return {run: [rank[i] for rank in per_rank] for i, run in enumerate(RUNS)}


@pytest.mark.parametrize("kind,schedule", RUNS)
def test_pipeline_trains_them_equal_to_the_unsplit_model(trained, kind, schedule):
    for result in trained[(kind, schedule)]:
        assert abs(result["loss"] - result["reference_loss"]) <= 1e-5
        assert result["grads"] > 0 and result["max_grad_error"] <= 1e-5, result


def test_a_pipeline_with_a_dropped_hook_is_refused_on_every_rank_before_any_step():
    results = run_world(workers.hooked_pipeline, 2, timeout_s=120, allow_errors=True)
    assert [status for status, _ in results] == ["error", "error"]
    assert all("ModelExportError" in text and "first.weight: differs by up to" in text for _, text in results)


def test_a_split_given_across_a_data_dependent_tensor_is_refused_on_every_rank_naming_it():
    results = run_world(workers.split_across_a_masked_tensor, 2, timeout_s=120, allow_errors=True)
    for status, text in results:
        assert status == "error" and "split point 'mix': index crosses it with a size that depends on the data" \
            in text and "Give other split_points=" in text, text
