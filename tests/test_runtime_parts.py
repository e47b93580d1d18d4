"""Specification of the runtime's single-process parts: relays, names, checkpointing."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import SplitPoint, pipeline

import _runtime_workers as workers
from autopipe.runtime.checkpointing import checkpoint_stage, resolve_recompute
from autopipe.runtime.params import model_state_names, shared_parameters, stage_state
from autopipe.runtime.relay import boundary_values, relay_skip_connections


def _pipe(split_points):
    model = workers.tutorial_model()
    return model, pipeline(model, workers.example_args(), split_spec={p: SplitPoint.BEGINNING for p in split_points})


def _sources(pipe) -> dict[int, set[int]]:
    """For each stage, the stages whose outputs it reads."""
    stages = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    index = {n: k for k, n in enumerate(stages)}
    found = {}
    for k, node in enumerate(stages):
        srcs = set()
        for a in node.all_input_nodes:
            a = a.args[0] if a.target is operator.getitem else a
            if a in index:
                srcs.add(index[a])
        found[k] = srcs
    return found


# ---------------------------------------------------------------------- relays
def test_a_skip_connection_is_relayed_through_the_stage_between():
    _, pipe = _pipe(workers.SPLITS[4])
    assert 3 in _sources(pipe) and _sources(pipe)[3] == {1, 2}  # the residual skips stage 2
    assert relay_skip_connections(pipe) == 1
    assert _sources(pipe) == {0: set(), 1: {0}, 2: {1}, 3: {2}}


def test_relayed_pipe_computes_the_models_output():
    model, pipe = _pipe(workers.SPLITS[4])
    relay_skip_connections(pipe)
    x = workers.example_args()[0]
    torch.testing.assert_close(torch.fx.Interpreter(pipe.split_gm).run(x)[0], model(x), rtol=0, atol=1e-6)


def test_each_stage_receives_what_the_previous_stage_sends_in_order():
    _, pipe = _pipe(workers.SPLITS[4])
    relay_skip_connections(pipe)
    live, _ = boundary_values(pipe.split_gm.graph)
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k in range(1, len(calls)):
        assert list(calls[k].args) == live[k - 1]


def test_a_split_without_skips_needs_no_relay():
    _, pipe = _pipe(workers.SPLITS[2])
    assert relay_skip_connections(pipe) == 0


# ---------------------------------------------------------------------- names
def test_tied_parameter_aliases_map_to_the_first_name():
    names = model_state_names(workers.tutorial_model(tied=True))
    assert names.canonical["out_linear.weight"] == "embedding.weight"
    assert names.aliases["embedding.weight"] == ["embedding.weight", "out_linear.weight"]


def test_stage_state_uses_original_names_and_skips_unread_tensors():
    model = workers.tutorial_model(tied=True)
    names = model_state_names(model)
    pipe = pipeline(model, workers.example_args(), split_spec={"layers.1": SplitPoint.BEGINNING})
    first, last = stage_state(pipe.get_stage_module(0), names), stage_state(pipe.get_stage_module(1), names)
    assert "embedding.weight" in first and "embedding.weight" in last  # the tie, in both stages
    assert last["embedding.weight"][0] == "out_linear.weight"  # under the name stage 1's code uses
    assert not any(n.startswith("layers.1") for n in first)


def test_shared_parameters_lists_only_parameters_on_several_ranks():
    groups = shared_parameters([["wte", "a"], ["b"], ["c"], ["wte", "d"]], [0, 1, 1, 0])
    assert groups == []  # V placement: both uses of wte on rank 0
    assert shared_parameters([["wte"], ["wte"]], [0, 1]) == [((0, 1), ["wte"])]


# ---------------------------------------------------------------------- checkpointing
def test_checkpointed_module_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ckpt = checkpoint_stage(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_checkpoint_stages_accepts_all_none_or_indices():
    assert resolve_recompute(True, 3) == [0, 1, 2]
    assert resolve_recompute(False, 3) == []
    assert resolve_recompute([2, 0, 2], 3) == [0, 2]


def test_checkpoint_stage_index_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="stages 0..2"):
        resolve_recompute([3], 3)


def test_stage_modules_run_generated_code_not_the_fx_interpreter():
    from torch.distributed.pipelining import SplitPoint

    from autopipe.models import seed_transformer
    from autopipe.runtime.stages import split_model

    model, args = seed_transformer(vocab_size=50, d_model=16, num_heads=2, d_ff=32, num_layers=2, batch=2, seq_len=4)
    pipe = split_model(model, {"layers.1": SplitPoint.BEGINNING}, (args, {}), training=True, expected=2)
    # Modules with a graph to run; containers such as a ModuleList have none and never run.
    inner = [m for s in range(2) for m in pipe.get_stage_module(s).modules()
             if hasattr(m, "_run_with_interpreter") and getattr(m, "graph_module", None) is not None]
    assert inner, "torch built no InterpreterModules: nothing to check"
    assert not any(m._run_with_interpreter for m in inner)
    out = pipe(*args)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(*args))


def test_splitting_leaves_no_export_graph_pinned_by_torch():
    # torch fills a module-level map with the traced graph's nodes on every export and keeps
    # it until the next one (autopipe.planning.tracing.release_last_export).
    from torch.fx.experimental import proxy_tensor

    from autopipe.models import seed_transformer
    from autopipe.runtime.stages import split_model

    if not hasattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT"):
        pytest.skip("this torch keeps no map of the last export's graph")
    model, args = seed_transformer(vocab_size=50, d_model=16, num_heads=2, d_ff=32, num_layers=2, batch=2, seq_len=4)
    split_model(model, {"layers.1": SplitPoint.BEGINNING}, (args, {}), training=True, expected=2)
    assert proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT == {}


@pytest.mark.parametrize("name", ["params", "model_io", "model_state", "plan_setup", "stages", "inference", "distributed"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    module = importlib.import_module(f"autopipe.runtime.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
