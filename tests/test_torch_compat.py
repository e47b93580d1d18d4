"""autopipe.runtime.compat: stage modules torch builds wrongly, built right.

* pytorch/pytorch#184361: ``pipeline()`` on a model with rotary embeddings (Hugging Face
  Llama) builds stages whose parent calls the rotary module without its arguments.
* A submodule named ``self`` (Hugging Face ``BertAttention.self``) made the generated code
  of its parent rebind ``self``.

The stage modules of autopipe's ``split_model`` run in one process, in order, each taking what
the previous one returned (``relay_skip_connections`` makes stage ``k`` take exactly what
stage ``k - 1`` sends), and must give the unsplit model's logits.
"""

from __future__ import annotations

import copy
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, _IR
from torch.export.unflatten import InterpreterModule

import autopipe
from autopipe.runtime import compat
from autopipe.runtime.compat import outlining_problems, rename_nodes_shadowing_self, safe_submodule_outlining
from autopipe.runtime.stages import split_model

import _compat_workers as workers
from _dist_utils import run_world

try:
    import transformers  # noqa: F401

    HF_AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means the HF models cannot be built
    HF_AVAILABLE = False

needs_transformers = pytest.mark.skipif(not HF_AVAILABLE, reason="transformers cannot be imported")

TOL = 1e-5


def run_stages_in_order(model: nn.Module, split_points: list[str], x: torch.Tensor):
    """Split ``model`` as autopipe does, then call stage 0 on ``x`` and each next stage on what the previous returned."""
    pipe = split_model(model, {p: SplitPoint.BEGINNING for p in split_points}, ((x,), {}), training=False,
                       expected=len(split_points) + 1)
    values: tuple = (x,)
    for s in range(pipe.num_stages):
        out = pipe.get_stage_module(s)(*values)
        values = out if isinstance(out, tuple) else (out,)
    return pipe, values


def assert_original_names(pipe, model: nn.Module) -> None:
    """Every stage names its parameters as the model does (params.py maps them by these names)."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    held = set()
    for s in range(pipe.num_stages):
        stage_names = {n for n, _ in pipe.get_stage_module(s).named_parameters(remove_duplicate=False)}
        assert stage_names <= names, sorted(stage_names - names)
        held |= stage_names
    assert {id(model.get_parameter(n)) for n in held} == {id(p) for p in model.parameters()}  # every tensor held


# ---------------------------------------------------------------------- pytorch/pytorch#184361
@needs_transformers
@pytest.mark.parametrize("split_points, tie", [
    (["model.layers.1"], False),
    (["model.layers.0", "model.layers.1.mlp"], True),  # a stage of embedding and rotary alone; a cut in a layer
])
def test_llama_stages_chain_to_unsplit_logits(split_points, tie):
    model = workers.tiny_llama(tie=tie)
    x = workers.token_batch(2)
    pipe, out = run_stages_in_order(model, split_points, x)
    torch.testing.assert_close(workers.logits_of(out), model(x).logits, atol=TOL, rtol=0)
    for s in range(pipe.num_stages):
        assert outlining_problems(pipe.get_stage_module(s)) == []
    assert_original_names(pipe, model)


@needs_transformers
def test_llama_flat_fallback_chains_to_unsplit_logits(monkeypatch):
    """When even the rebuilt module tree is rejected, each stage runs as one flat graph, with the original names."""
    monkeypatch.setattr(compat, "outlining_problems", lambda module: ["rejected by the test"])
    model = workers.tiny_llama(tie=True)
    x = workers.token_batch(2)
    pipe, out = run_stages_in_order(model, ["model.layers.1"], x)
    torch.testing.assert_close(workers.logits_of(out), model(x).logits, atol=TOL, rtol=0)
    for s in range(pipe.num_stages):
        stage = pipe.get_stage_module(s)
        assert not [n for n in stage.graph.nodes if n.op == "call_module"]  # flat: no submodule calls
    assert_original_names(pipe, model)


def test_flat_stage_reads_a_tied_tensor_by_a_name_it_holds():
    """At the root of a flat stage every alias of a tied tensor is in scope; the one it holds must come first."""
    module = nn.Module()
    module.emb = nn.Embedding(2, 2)
    for names in (["head.weight", "emb.weight"], ["emb.weight", "head.weight"]):
        assert compat._resolvable_first(module, {"w": names})["w"][0] == "emb.weight"


def test_torch_functions_restored_after_the_block():
    outline, sink = _IR._outline_submodules, _IR._sink_params
    with safe_submodule_outlining():
        assert _IR._outline_submodules is not outline and _IR._sink_params is not sink
        patched = _IR._outline_submodules
        with safe_submodule_outlining():  # nested: patched once, still patched after the inner block
            assert _IR._outline_submodules is patched
        assert _IR._outline_submodules is patched
    assert _IR._outline_submodules is outline and _IR._sink_params is sink
    with pytest.raises(RuntimeError, match="inside"):
        with safe_submodule_outlining():
            raise RuntimeError("inside")
    assert _IR._outline_submodules is outline and _IR._sink_params is sink


def test_torch_without_outlining_is_left_alone(monkeypatch):
    """A torch whose pipelining has no ``_outline_submodules`` gets nothing patched."""
    monkeypatch.delattr(_IR, "_outline_submodules")
    sink = _IR._sink_params
    with safe_submodule_outlining():
        assert not hasattr(_IR, "_outline_submodules") and _IR._sink_params is sink
    assert not hasattr(_IR, "_outline_submodules") and _IR._sink_params is sink


def test_sequential_split_is_unchanged_under_the_block():
    """A model torch outlines correctly keeps torch's module tree (InterpreterModules), and runs."""
    from torch.distributed.pipelining import pipeline

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with safe_submodule_outlining():
        pipe = pipeline(model, (x,), split_spec={"2": SplitPoint.BEGINNING})
    assert isinstance(pipe.get_stage_module(1).get_submodule("2"), InterpreterModule)
    torch.testing.assert_close(pipe(x)[0], model(x))


def _graph_module(children: dict[str, nn.Module], build) -> fx.GraphModule:
    graph = fx.Graph()
    build(graph)
    return fx.GraphModule(nn.ModuleDict(children), graph)


def _identity_graph_module() -> fx.GraphModule:
    return _graph_module({}, lambda g: g.output(g.placeholder("x")))


def test_outlining_problems_names_each_inconsistency():
    def calls(g):
        x = g.placeholder("x")
        g.output((g.call_module("a", ()), g.call_module("a", (x,))))

    root = _graph_module({"a": _identity_graph_module()}, calls)
    output = next(n for n in root.graph.nodes if n.op == "output")
    with root.graph.inserting_before(output), pytest.warns(UserWarning):  # fx warns: nothing to read
        root.graph.get_attr("missing")
    problems = outlining_problems(root)
    assert problems == ["'' calls 'a' with 0 arguments, but its graph takes 1", "'' calls 'a' twice",
                        "'' reads 'missing', which it does not have"]


def test_outlining_problems_empty_for_a_consistent_tree():
    def calls(g):
        x = g.placeholder("x")
        g.output(g.call_module("b", (g.call_module("a", (x,)),)))

    root = _graph_module({"a": _identity_graph_module(), "b": _identity_graph_module()}, calls)
    assert outlining_problems(root) == []


# ---------------------------------------------------------------------- a submodule named ``self``
@needs_transformers
@pytest.mark.parametrize("split_points", [["bert.encoder.layer.1"], ["bert.encoder.layer.0.attention.output"]])
def test_bert_stages_chain_to_unsplit_logits(split_points):
    model = workers.tiny_bert()
    x = workers.token_batch(2)
    pipe, out = run_stages_in_order(model, split_points, x)
    torch.testing.assert_close(workers.logits_of(out), model(x).logits, atol=TOL, rtol=0)
    assert_original_names(pipe, model)


def test_generated_code_calls_a_submodule_named_self():
    root = nn.Module()
    root.add_module("self", nn.Linear(3, 3))
    root.add_module("out", nn.Linear(3, 2))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("out", (graph.call_module("self", (x,)),)))
    gm = fx.GraphModule(root, graph)
    assert rename_nodes_shadowing_self(gm) == 1
    assert "self" not in {n.name for n in gm.graph.nodes}
    x = torch.randn(4, 3)
    torch.testing.assert_close(gm(x), root.out(getattr(root, "self")(x)))
    assert rename_nodes_shadowing_self(gm) == 0  # nothing left to rename


def test_placeholder_named_self_becomes_an_argument_of_another_name():
    graph = fx.Graph()
    graph.output(graph.placeholder("self"))
    module = InterpreterModule(graph)
    assert rename_nodes_shadowing_self(module) == 1
    module.finalize()  # generates the code from the renamed graph
    module._run_with_interpreter = False
    x = torch.randn(2)
    assert module(x) is x
    assert module.arg_names == [n.target for n in graph.nodes if n.op == "placeholder"] != ["self"]


# ---------------------------------------------------------------------- stages out of order
def _stage_params(pipe, s: int) -> set[str]:
    return {n for n, _ in pipe.get_stage_module(s).named_parameters()}


def test_a_stage_that_needs_nothing_from_the_one_before_keeps_its_place():
    """Stage 1 (the decoder's embedding) takes nothing stage 0 (the encoder) computes.

    torch's own ``pipeline()`` calls it first; the split autopipe builds calls the stages in
    the split's order, holds the encoder on stage 0, and with dropout draws the unsplit
    model's masks in the unsplit model's order.
    """
    model = workers.EncoderDecoder(dropout=0.5).train()
    args = (torch.randn(2, 8), torch.randn(2, 8))
    spec = {p: SplitPoint.BEGINNING for p in workers.EncoderDecoder.SPLIT}
    # torch's pipeline() wraps the split modules' forwards in place: it gets a copy.
    torch_pipe = _IR.pipeline(copy.deepcopy(model), args, split_spec=spec)
    assert compat.stage_call_order(torch_pipe.split_gm) == [1, 0, 2]  # the torch behaviour worked around

    pipe = split_model(model, spec, (args, {}), training=True, expected=3)
    assert compat.stage_call_order(pipe.split_gm) == [0, 1, 2]
    assert _stage_params(pipe, 0) == {n for n, _ in model.enc.named_parameters(prefix="enc")}
    assert _stage_params(pipe, 1) == {n for n, _ in model.dec_embed.named_parameters(prefix="dec_embed")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = model(*args)
        torch.manual_seed(0)
        output, = pipe(*args)
    assert (output - reference).abs().max().item() <= TOL


def test_the_cost_graph_predicts_torchs_stage_order_and_the_plan_says_so():
    from autopipe.planning.costgraph import SegmentCost, build_cost_graph
    from autopipe.planning.tracing import trace

    model = workers.EncoderDecoder()
    args = (torch.randn(2, 8), torch.randn(2, 8))
    cg = build_cost_graph(trace(model, args))
    assert cg.torch_stage_order(workers.EncoderDecoder.SPLIT) == [1, 0, 2]
    assert cg.torch_stage_order(["dec.0", "dec.1"]) == [0, 1, 2]

    # Costs that make the out-of-order split the only balanced one: encoder, embedding, the rest.
    share = {"<input>": 0.01, "enc.1": 0.01, "enc.2": 1.0, "dec_embed": 0.7, "dec_embed.1": 0.3,
             "dec.0": 1.0, "dec.1": 0.01, "head": 0.01}
    assert list(share) == cg.segment_names
    costs = [SegmentCost(fwd_s=share[name], bwd_s=2 * share[name], param_bytes=288, act_bytes=64,
                         out_bytes=64) for name in cg.segment_names]
    plan = autopipe.partition(model, 3, args, loss_fn=False, n_microbatches=3, schedule="GPipe",
                              planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(
                                  progress=False)))
    assert plan.split_points == workers.EncoderDecoder.SPLIT
    assert [n for n in plan.notes if "[1, 0, 2]" in n and "autopipe.runtime.split_model" in n]


# ---------------------------------------------------------------------- two ranks
def assert_step_equals_unsplit(worker) -> None:
    """Two ranks run ``worker``: every parameter held, the loss and every gradient the unsplit model's."""
    results = run_world(worker, 2, timeout_s=300)
    assert set().union(*(r["grad_diff"] for r in results)) == set(results[0]["all_param_names"])
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) < TOL
        assert max(r["grad_diff"].values()) < TOL, r["grad_diff"]


@needs_transformers
@pytest.mark.distributed
def test_llama_1f1b_on_two_ranks_matches_unsplit():
    assert_step_equals_unsplit(workers.llama_1f1b_run)


@pytest.mark.distributed
def test_a_stage_that_needs_nothing_from_the_one_before_trains_exactly_on_two_ranks():
    assert_step_equals_unsplit(workers.encoder_decoder_run)


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(compat, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
