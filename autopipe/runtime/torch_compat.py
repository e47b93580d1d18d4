"""Workarounds for torch defects that break the stage modules autopipe builds.

Everything autopipe patches around a torch release lives in this module. Each workaround
first checks whether torch already behaves, and then leaves torch's result untouched, so
a release that fixes the defect runs torch's own code.

For torch 2.11, 2.12 and 2.13 (checked on 2.13.0):

* :func:`safe_submodule_outlining` - pytorch/pytorch#184361 (open). ``pipeline()``
  rebuilds each stage's module tree from the stage's flat graph
  (``torch.distributed.pipelining._unflatten._outline_submodules``), one module per
  contiguous run of nodes. ``split_module`` places a stage's ``get_attr`` nodes at the
  top of its graph, so a module that calls a higher-order op - Hugging Face's rotary embedding
  runs its body under ``wrap_with_set_grad_enabled`` - appears in two runs. The second
  run replaces the module built from the first, and the parent calls it without the
  arguments its graph takes: ``Expected positional argument for parameter
  unsqueeze_default`` at the first forward (Llama, Qwen3, Gemma, Mistral, Mixtral,
  Qwen2-MoE).
* :func:`rename_nodes_shadowing_self` - ``torch.fx`` names a ``call_module`` node after
  its target and does not reserve ``self``, the first parameter of the generated
  ``forward``; a submodule attribute named ``self`` (Hugging Face ``BertAttention.self``:
  BERT, RoBERTa, ELECTRA, XLM-R) yields ``self = self.self(...)``, after which the next
  submodule call reads an attribute of a tensor. torch's ``InterpreterModule`` only
  runs that code under ``torch.compile``; autopipe always runs it
  (``pipeline._run_generated_code``).

Example:
    >>> from autopipe.runtime.torch_compat import safe_submodule_outlining
    >>> with safe_submodule_outlining():  # doctest: +SKIP
    ...     pipe = pipeline(model, (x,), split_spec=split_spec)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["outlining_problems", "rename_nodes_shadowing_self", "safe_submodule_outlining"]

logger = logging.getLogger(__name__)

#: The torch issue :func:`safe_submodule_outlining` works around.
OUTLINING_ISSUE = "pytorch/pytorch#184361"


# ---------------------------------------------------------------------- pytorch/pytorch#184361
@contextlib.contextmanager
def safe_submodule_outlining() -> Iterator[None]:
    """Within the block, ``pipeline()`` builds only stage modules whose calls match their callees.

    Wraps ``torch.distributed.pipelining._IR._outline_submodules``, which ``Pipe._from_traced``
    calls on each stage's flat graph (pytorch/pytorch#184361). Each rebuilt module tree is
    checked with :func:`outlining_problems`:

    1. no problem: torch's tree is used as it is (a torch that outlines correctly runs
       unchanged);
    2. otherwise the flat graph is outlined again with every ``get_attr`` node moved to
       just before its first user and given that user's module path, so each module's
       nodes are contiguous, and the attributes those nodes read (the bodies of
       higher-order ops) are copied into the modules that now read them. This keeps the
       module hierarchy, and tied parameters resolve as in torch's own path;
    3. if that tree still has problems, the stage becomes one flat ``fx.GraphModule`` of
       its graph. ``_from_traced`` then creates the nested containers itself
       (``move_param_to_callee`` / ``_assign_attr``), so parameters keep their original
       dotted names; ``_sink_params`` is steered to a name the flat module holds when a
       tensor has several (tied weights), since at the root any alias would match.

    torch's functions are restored on exit, also after an error. A torch without
    ``_IR._outline_submodules`` is left alone. Nested use patches once.

    Example:
        >>> import torch
        >>> from torch.distributed.pipelining import SplitPoint, pipeline
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> with safe_submodule_outlining():
        ...     pipe = pipeline(model, (torch.randn(3, 4),), split_spec={"2": SplitPoint.BEGINNING})
        >>> pipe.num_stages
        2
    """
    ir = _pipelining_ir()
    outline = getattr(ir, "_outline_submodules", None)
    if outline is None or getattr(outline, "_autopipe_checked", False):
        yield
        return
    sink = getattr(ir, "_sink_params", None)
    flat_stages: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def checked_outline(graph: fx.Graph) -> fx.GraphModule:
        return _outline_or_fall_back(outline, graph, flat_stages)

    def sink_resolvable(module: nn.Module, inputs_to_state: dict[str, list[str]], *args: Any,
                        **kwargs: Any) -> Any:
        if module in flat_stages:
            inputs_to_state = _resolvable_first(module, inputs_to_state)
        return sink(module, inputs_to_state, *args, **kwargs)

    checked_outline._autopipe_checked = True  # type: ignore[attr-defined]
    ir._outline_submodules = checked_outline
    if sink is not None:
        ir._sink_params = sink_resolvable
    try:
        yield
    finally:
        ir._outline_submodules = outline
        if sink is not None:
            ir._sink_params = sink


def outlining_problems(module: nn.Module) -> list[str]:
    """Why an outlined module tree would fail when run; empty when it is consistent.

    Checks every fx graph in ``module``'s tree: each ``call_module`` names an existing
    submodule, passes as many arguments as the callee's graph has placeholders, and no
    graph calls the same target twice (torch names a second call of a module ``name@1``;
    two calls of ``name`` mean one outlined module replaced another); each ``get_attr``
    names an attribute the module has.

    Example:
        >>> import torch.fx as fx, torch.nn as nn
        >>> inner = fx.Graph(); _ = inner.output(inner.placeholder("x"))
        >>> top = fx.Graph(); _ = top.output(top.call_module("child", ()))
        >>> root = fx.GraphModule(nn.ModuleDict({"child": fx.GraphModule(nn.Module(), inner)}), top)
        >>> outlining_problems(root)
        ["'' calls 'child' with 0 arguments, but its graph takes 1"]
    """
    problems: list[str] = []
    for path, sub in module.named_modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        called: set[str] = set()
        for node in graph.nodes:
            if node.op == "call_module":
                if node.target in called:
                    problems.append(f"{path!r} calls {node.target!r} twice")
                called.add(node.target)
                callee = _lookup(sub, node.target)
                if not isinstance(callee, nn.Module):
                    problems.append(f"{path!r} calls {node.target!r}, which it does not have")
                    continue
                callee_graph = getattr(callee, "graph", None)
                if isinstance(callee_graph, fx.Graph):
                    takes = sum(1 for n in callee_graph.nodes if n.op == "placeholder")
                    given = len(node.args) + len(node.kwargs)
                    if given != takes:
                        problems.append(f"{path!r} calls {node.target!r} with {given} arguments, "
                                        f"but its graph takes {takes}")
            elif node.op == "get_attr" and _lookup(sub, node.target) is None:
                problems.append(f"{path!r} reads {node.target!r}, which it does not have")
    return problems


def _pipelining_ir() -> Any:
    """``torch.distributed.pipelining._IR``, or None where torch has no pipelining."""
    try:
        from torch.distributed.pipelining import _IR
    except ImportError:
        return None
    return _IR


def _outline_or_fall_back(outline: Callable[[fx.Graph], fx.GraphModule], graph: fx.Graph,
                          flat_stages: weakref.WeakSet) -> fx.GraphModule:
    """torch's outlining of ``graph`` if consistent, else the repaired one, else ``graph`` flat."""
    outlined = outline(graph)
    problems = outlining_problems(outlined)
    if not problems:
        return outlined
    owner = graph.owning_module  # the stage from split_module: holds what get_attr nodes read
    try:
        repaired = outline(_attrs_next_to_users(graph))
        _copy_missing_attrs(repaired, owner)
        if not outlining_problems(repaired):
            logger.debug("%s: module tree rebuilt with get_attr nodes next to their users (%s)",
                         OUTLINING_ISSUE, "; ".join(problems))
            return repaired
    except Exception:  # noqa: BLE001 - the flat stage below is correct whatever failed here
        logger.debug("%s: rebuilding the module tree failed", OUTLINING_ISSUE, exc_info=True)
    logger.debug("%s: stage kept as one flat graph (%s)", OUTLINING_ISSUE, "; ".join(problems))
    flat = fx.GraphModule(owner if owner is not None else nn.Module(), copy.deepcopy(graph))
    flat_stages.add(flat)
    return flat


def _attrs_next_to_users(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with each ``get_attr`` node just before its first user, in that user's module.

    A ``get_attr`` reads and computes nothing, so moving it keeps the graph's meaning; taking
    its user's ``nn_module_stack`` keeps it from opening a run of another module there.
    """
    moved = copy.deepcopy(graph)  # node meta is copied per node: the original's stays as it was
    order = {node: i for i, node in enumerate(moved.nodes)}
    for node in list(moved.nodes):
        if node.op != "get_attr" or not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        first.prepend(node)
        if "nn_module_stack" in first.meta:
            node.meta["nn_module_stack"] = first.meta["nn_module_stack"]
    return moved


def _copy_missing_attrs(module: nn.Module, owner: nn.Module | None) -> None:
    """Give every module of the tree the attributes its ``get_attr`` nodes read, from ``owner``.

    torch's outlining copies the nodes but not what they read (``torch.export.unflatten``
    does, through ``_copy_graph_attrs``); ``InterpreterModule.finalize`` later builds its
    generated code from the module's attributes.
    """
    if owner is None:
        return
    for sub in list(module.modules()):
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            if node.op != "get_attr" or _lookup(sub, node.target) is not None:
                continue
            value = _lookup(owner, node.target)
            if value is None:
                continue
            *prefix, leaf = node.target.split(".")
            parent = sub
            for name in prefix:
                if not isinstance(getattr(parent, name, None), nn.Module):
                    setattr(parent, name, nn.Module())
                parent = getattr(parent, name)
            setattr(parent, leaf, value)


def _resolvable_first(module: nn.Module, inputs_to_state: dict[str, list[str]]) -> dict[str, list[str]]:
    """``inputs_to_state`` with, for each graph input, the names ``module`` holds listed first.

    ``_sink_params`` turns an input into a ``get_attr`` of the first name in its list that
    lies in the current scope; at the root of a flat stage every alias of a tied tensor
    does, and the list comes from a set, so its order varies from run to run.

    Example:
        >>> m = nn.Module(); m.emb = nn.Embedding(2, 2)
        >>> _resolvable_first(m, {"w": ["head.weight", "emb.weight"]})
        {'w': ['emb.weight', 'head.weight']}
    """
    def held(name: str) -> bool:
        return isinstance(_lookup(module, name), (torch.Tensor, torch.ScriptObject))

    return {key: sorted(names, key=lambda n: not held(n)) for key, names in inputs_to_state.items()}


def _lookup(module: nn.Module, dotted: str) -> Any:
    """``module``'s attribute at the dotted path ``dotted``, or None if some step is missing."""
    value: Any = module
    for name in dotted.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


# ---------------------------------------------------------------------- submodule named ``self``
# Kept here, not next to pipeline._run_generated_code (its caller): the gap is torch.fx's
# naming, which any code generated from these graphs inherits (torch's own InterpreterModule
# under torch.compile too); autopipe is merely the one that always runs that code.
#: The name of the generated ``forward``'s first parameter, the module itself.
_SELF = "self"


def rename_nodes_shadowing_self(module: nn.Module) -> int:
    """Rename the fx nodes of ``module``'s tree that the generated code would bind to ``self``.

    fx picks a node's name - the local variable in the generated ``forward`` - from its
    target, avoiding Python keywords and builtins but not ``self``, the parameter through
    which that code reaches every submodule. A node named ``self`` (the call of a
    submodule attribute named ``self``) is renamed ``self_1`` (or the next free name) and
    the code regenerated; a placeholder whose target is ``self`` gets the new name as its
    target too. Nothing changes where no node is named ``self``, as on a torch whose fx
    reserves the name. Call it after the last graph edit, before running the generated code.

    Returns:
        How many nodes were renamed.

    Example:
        >>> import torch.fx as fx, torch.nn as nn
        >>> root = nn.Module(); root.add_module("self", nn.ReLU()); root.add_module("out", nn.Identity())
        >>> graph = fx.Graph(); x = graph.placeholder("x")
        >>> _ = graph.output(graph.call_module("out", (graph.call_module("self", (x,)),)))
        >>> gm = fx.GraphModule(root, graph)
        >>> rename_nodes_shadowing_self(gm), [n.name for n in gm.graph.nodes]
        (1, ['x', 'self_1', 'out', 'output'])
    """
    renamed = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            if node.name != _SELF and not (node.op == "placeholder" and node.target == _SELF):
                continue
            node._rename(f"{_SELF}_1")
            if node.op == "placeholder":
                node.target = node.name
            changed = True
            renamed += 1
        if not changed:
            continue
        if hasattr(sub, "arg_names"):  # InterpreterModule: its placeholder targets, for keyword calls
            sub.arg_names = [n.target for n in graph.nodes if n.op == "placeholder"]
        generated = sub.__dict__.get("graph_module")  # InterpreterModule: where its code lives
        if isinstance(generated, fx.GraphModule):
            generated.recompile()
        elif isinstance(sub, fx.GraphModule):
            sub.recompile()
    return renamed
