"""In-place writes into what a segment or stage receives (autopipe.planning.inplace, the profiler, the runtime).

A stage's inputs, and the profiler's segment inputs, are leaves that require grad; a cut
before ``nn.ReLU(inplace=True)`` or ``out += identity`` would make autograd refuse the
write without a private copy. The model is tests/_inplace_workers.SmallResNet, written like torchvision's ResNet.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

import autopipe
from autopipe.planning.inplace import clone_inputs_written_in_place, inputs_written_in_place
from autopipe.planning.profile import profile_segments
from autopipe.planning.segment_graphs import segment_modules
from autopipe.planning.tracing import trace

import _inplace_workers as workers
from _dist_utils import run_world

TOL = 1e-5
aten = torch.ops.aten


class Writes(nn.Module):
    """Writes into a, b, d, e and g (directly, or through views); reads c and f (f through views)."""

    def forward(self, a, b, c, d, e, f, g):
        a.relu_()
        b += c
        d[:, 0].add_(1.0)
        e.view(-1).mul_(2.0)
        g.narrow(0, 0, 1).t().sigmoid_()
        return a + b + d + e + f.t().t() + g


def _inputs(n: int = 7) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(2, 3) for _ in range(n))


def _exported(module: nn.Module, args: tuple) -> torch.fx.GraphModule:
    return torch.export.export(module, args).module()


def _calls(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


# ---------------------------------------------------------------------- the graph function


def test_export_keeps_in_place_ops_and_functionalizing_removes_them():
    """The two forms the finder handles: training IR (relu_, add_) and a functional graph."""
    ep = torch.export.export(workers.BasicBlock(4, 4), (torch.randn(2, 4, 8, 8),))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {aten.relu_.default, aten.add_.Tensor} <= targets
    functional = ep.run_decompositions({})
    assert not any(n.target._schema.is_mutable for n in functional.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))


def test_finds_exactly_the_inputs_written_directly_or_through_a_view():
    gm = _exported(Writes(), _inputs())
    assert [p.name for p in inputs_written_in_place(gm.graph)] == ["a", "b", "d", "e", "g"]


def test_finds_a_write_into_one_of_several_views():
    """``split`` returns a list of views (its schema's wildcard alias set); writing one writes x."""
    class WritesChunk(nn.Module):
        def forward(self, x, y):
            with torch.no_grad():  # autograd refuses such a write otherwise; export keeps it
                x.split(1)[0].zero_()
            return x + y.split(1)[0]

    gm = _exported(WritesChunk(), _inputs(2))
    assert [p.name for p in inputs_written_in_place(gm.graph)] == ["x"]


def test_finds_an_input_that_a_functional_graph_writes_back():
    """After functionalization the mutation of a model input is a ``copy_`` into it at the end."""
    class WritesInput(nn.Module):
        def forward(self, x, y):
            x[:, 0].add_(1.0)
            return x * y

    ep = torch.export.export(WritesInput(), _inputs(2)).run_decompositions({})
    gm = ep.module()
    assert _calls(gm, aten.copy_.default) and not _calls(gm, aten.add_.Tensor)
    assert [p.name for p in inputs_written_in_place(gm.graph)] == ["x"]


def test_leaves_a_graph_that_writes_only_its_own_values_unchanged():
    """SmallResNet writes in place into intermediates and buffers only, never its input."""
    model, example = workers.small_resnet()
    gm = _exported(model, example)
    code = gm.code
    assert _calls(gm, aten.relu_.default)
    assert clone_inputs_written_in_place(gm.graph) == []
    assert gm.code == code
    plain = _exported(nn.Linear(3, 2), (torch.randn(2, 3),))
    code = plain.code
    assert clone_inputs_written_in_place(plain.graph) == [] and plain.code == code


def test_clone_gives_leaves_a_copy_and_keeps_results_and_gradients():
    gm = _exported(Writes(), _inputs())
    assert clone_inputs_written_in_place(gm.graph) == ["a", "b", "d", "e", "g"]
    clones = _calls(gm, aten.clone.default)
    assert sorted(c.args[0].name for c in clones) == ["a", "b", "d", "e", "g"]
    assert all(len(c.args[0].users) == 1 for c in clones)  # every other use reads the copy

    values = _inputs()
    leaves = [v.clone().requires_grad_(True) for v in values]
    out = gm(*leaves)  # without the copies: "a leaf Variable that requires grad ..."
    out.sum().backward()
    assert all(torch.equal(leaf, v) for leaf, v in zip(leaves, values))  # received tensors untouched

    ref_leaves = [v.clone().requires_grad_(True) for v in values]
    ref = Writes()(*[r * 1.0 for r in ref_leaves])  # the unsplit case: intermediates, writable
    ref.sum().backward()
    assert torch.allclose(out, ref, atol=TOL)
    for leaf, r in zip(leaves, ref_leaves):
        assert torch.allclose(leaf.grad, r.grad, atol=TOL)


def test_stage_input_written_inside_a_called_submodule_is_copied_at_the_stage():
    """torch's pipeline() nests the in-place ReLU in a child module whose input is the stage input."""
    model, example = workers.small_resnet()
    pipe = pipeline(model, example, split_spec={"relu": SplitPoint.BEGINNING})
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    top_ops = {n.target for n in second.graph.nodes if n.op == "call_function"}
    assert aten.relu_.default not in top_ops  # the write is in a child graph, not the stage's own
    (name,) = [p.name for p in second.graph.nodes if p.op == "placeholder"]

    # Stage 0's children write a buffer (batch norm's counter), not its input.
    assert clone_inputs_written_in_place(first.graph) == []
    assert clone_inputs_written_in_place(second.graph) == [name]
    received = torch.randn(2, 4, 8, 8, requires_grad=True)
    second(received).sum().backward()
    assert received.grad is not None


# ---------------------------------------------------------------------- the profiler and planner


def test_segments_copy_exactly_the_inputs_they_write():
    traced = trace(*workers.small_resnet())
    copied = {}
    for seg, sm in zip(traced.segments, segment_modules(traced)):
        clones = [n.args[0].name for n in sm.module.graph.nodes if n.target is aten.clone.default]
        if clones:
            copied[seg.name] = clones
    # The in-place ReLU, += into bn2's output (after the downsample's batch norm), the write
    # through a view, and += first: each reads a value an earlier segment made.
    assert set(copied) == {"relu", "layer2.downsample.1", "branch.gate", "branch.merge"}
    assert all(len(names) == 1 for names in copied.values())


def test_profile_runs_every_segment_with_in_place_cuts():
    traced = trace(*workers.small_resnet())
    costs = profile_segments(traced, device="cpu", warmup=0, repeats=1, progress=False)
    assert len(costs) == traced.num_segments
    relu = traced.split_point_names.index("relu") + 1
    assert costs[relu].fwd_s > 0 and costs[relu].act_bytes > 0


@pytest.mark.parametrize("n_gpus", [2, 4])
def test_partition_with_measured_costs(n_gpus):
    model, example = workers.small_resnet()
    plan = autopipe.partition(model, n_gpus, example_args=example,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(device="cpu", warmup=0, repeats=1, progress=False)))
    assert plan.num_stages == n_gpus


# ---------------------------------------------------------------------- the runtime


@functools.lru_cache(maxsize=None)
def runtime_results() -> list[list[dict]]:
    return run_world(workers.step_against_unsplit, 2, list(workers.CASES), timeout_s=400)


@pytest.mark.distributed
@pytest.mark.parametrize("case", workers.CASES, ids=lambda c: f"{c[0]}-{'+'.join(c[2])}")
def test_pipeline_step_split_at_in_place_ops_matches_unsplit(case):
    i = workers.CASES.index(case)
    results = [rank_results[i] for rank_results in runtime_results()]
    assert set().union(*(r["grad_diff"] for r in results)) == set(results[0]["all_param_names"])
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL
        assert max(r["grad_diff"].values()) <= TOL, r["grad_diff"]


def test_a_write_into_what_a_dropout_of_zero_returned_writes_the_input():
    # aten.dropout returns its input itself when p = 0 or train = False, though its schema
    # declares no alias (Wav2Vec2: a feature dropout of 0.0, then SpecAugment's masked write).
    class MaskAfterDropout(nn.Module):
        def forward(self, x):
            h = nn.functional.dropout(x, 0.0, True)
            h[:, 0] = 0.0
            return h * 2

    gm = torch.export.export(MaskAfterDropout().train(), (torch.randn(2, 3),)).module()
    assert clone_inputs_written_in_place(gm.graph) == ["x"]
    x = torch.randn(2, 3, requires_grad=True)
    gm(x).sum().backward()  # without the copy: "a leaf Variable that requires grad ... in-place"
    assert torch.equal(x.grad[:, 0], torch.zeros(2)) and torch.equal(x.grad[:, 1:], torch.full((2, 2), 2.0))
