"""Every workaround autopipe applies around a torch release's pipelining, in one module.

Example:
    >>> from autopipe.runtime.compat import safe_submodule_outlining
    >>> with safe_submodule_outlining():  # doctest: +SKIP
    ...     pipe = pipeline(model, (x,), split_spec=split_spec)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import linecache
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

logger = logging.getLogger(__name__)

#: The torch issue :func:`safe_submodule_outlining` works around.
OUTLINING_ISSUE = "pytorch/pytorch#184361"


# ---------------------------------------------------------------------- pytorch/pytorch#184361
@contextlib.contextmanager
def safe_submodule_outlining() -> Iterator[None]:
    """Within the block, ``pipeline()`` builds only stage modules whose calls match their callees.

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
        _hold_state_in_repeated_calls(module, inputs_to_state)
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
    """A copy of ``graph`` with each ``get_attr`` node just before its first user, in that user's module."""
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
    """Give every module of the tree the attributes its ``get_attr`` nodes read, from ``owner``."""
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

    Example:
        >>> m = nn.Module(); m.emb = nn.Embedding(2, 2)
        >>> _resolvable_first(m, {"w": ["head.weight", "emb.weight"]})
        {'w': ['emb.weight', 'head.weight']}
    """
    def held(name: str) -> bool:
        return isinstance(_lookup(module, name), (torch.Tensor, torch.ScriptObject))

    return {key: sorted(names, key=lambda n: not held(n)) for key, names in inputs_to_state.items()}


def _hold_state_in_repeated_calls(module: nn.Module, inputs_to_state: dict[str, list[str]]) -> None:
    """Give each further call of a module (``emb@1``) the tensors its first call holds."""
    for path, sub in list(module.named_modules(remove_duplicate=False)):
        plain = ".".join(part.split("@")[0] for part in path.split("."))
        for aliases in inputs_to_state.values() if "@" in path else ():
            held = next((t for t in map(lambda n: _lookup(module, n), aliases) if isinstance(t, torch.Tensor)), None)
            for rest in (n[len(plain) + 1:] for n in aliases if n.startswith(plain + ".")):
                parent_path, _, leaf = rest.rpartition(".")
                parent = _lookup(sub, parent_path) if parent_path else sub
                if held is not None and isinstance(parent, nn.Module) and _lookup(sub, rest) is None:
                    if isinstance(held, nn.Parameter):
                        parent.register_parameter(leaf, held)
                    else:
                        parent.register_buffer(leaf, held)


def _lookup(module: nn.Module, dotted: str) -> Any:
    """``module``'s attribute at the dotted path ``dotted``, or None if some step is missing."""
    value: Any = module
    for name in dotted.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


# ---------------------------------------------------------------------- stages out of order
@contextlib.contextmanager
def stages_in_split_order() -> Iterator[None]:
    """Within the block, ``pipeline()`` numbers its stages in the order of the split points.

    ``torch.fx.passes.split_module`` orders partitions by a topological sort that takes the
    last ready partition first. A stage that needs nothing from the one before it (a
    decoder's embedding, cut off from the encoder that runs before it) is then called
    before that stage, while torch's stages still treat stage ``k - 1`` as stage ``k``'s
    sender: the pipeline computes a different function and no error is raised. The
    partitions' own order (the split points' order, which the graph's order makes a valid
    one) is what ``keep_original_order`` keeps.

    Example:
        >>> import torch
        >>> from torch.distributed.pipelining import SplitPoint, pipeline
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> with stages_in_split_order():
        ...     pipe = pipeline(model, (torch.randn(3, 4),), split_spec={"1": SplitPoint.BEGINNING})
        >>> stage_call_order(pipe.split_gm)
        [0, 1]
    """
    ir = _pipelining_ir()
    split = getattr(ir, "split_module", None)
    if split is None or isinstance(split, functools.partial):
        yield
        return
    ir.split_module = functools.partial(split, keep_original_order=True)
    try:
        yield
    finally:
        ir.split_module = split


def stage_call_order(split_gm: fx.GraphModule) -> list[int]:
    """The stage indices in the order the split graph calls its stage modules."""
    prefix = "submod_pp_"
    return [int(node.target[len(prefix):]) for node in split_gm.graph.nodes
            if node.op == "call_module" and str(node.target).startswith(prefix)]


# ---------------------------------------------------------------------- submodule named ``self``
# The gap is torch.fx's naming, which any code generated from these graphs inherits (torch's
# own InterpreterModule under torch.compile too); autopipe is merely the one that always runs
# that code (stages.run_generated_code).
#: The name of the generated ``forward``'s first parameter, the module itself.
_SELF = "self"


def rename_nodes_shadowing_self(module: nn.Module) -> int:
    """Rename the fx nodes of ``module``'s tree that the generated code would bind to ``self``.

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


# ---------------------------------------------------------------------- stage boundaries
#: The dtype integer and boolean tensors travel in between stages (exact for |x| < 2**53).
WIRE_DTYPE = torch.float64


def _travels_as_float(val: torch.Tensor) -> bool:
    """An integer or boolean boundary tensor: it crosses a cut as :data:`WIRE_DTYPE`."""
    return not (val.is_floating_point() or val.is_complex())


def make_boundary_tensors_sendable(stage_module: nn.Module, *, first: bool, last: bool) -> None:
    """Describe every tensor a stage sends or receives as one torch can send, in its graph."""
    graph = stage_module.graph
    wire: dict[str, dict[int, torch.dtype]] = {"inputs": {}, "outputs": {}, "traced": {}}
    changed = False
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if not val.is_contiguous():
            node.meta["val"] = val = val.clone(memory_format=torch.contiguous_format)
        if not first and _travels_as_float(val):
            wire["inputs"][i] = val.dtype
            node.meta["val"] = val.to(WIRE_DTYPE)
    output = next(n for n in graph.nodes if n.op == "output")

    def contiguous(arg):
        nonlocal changed
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.is_contiguous():
            return arg
        with graph.inserting_before(output):
            copy = graph.call_function(torch.ops.aten.clone.default, (arg,),
                                       {"memory_format": torch.contiguous_format})
        copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
        changed = True
        return copy

    output.args = torch.fx.node.map_arg(output.args, contiguous)
    if changed:
        stage_module.recompile()
    if not last:
        values, _ = tree_flatten(output.args[0])
        for j, node in enumerate(values):
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                wire["traced"][j] = val.dtype
            if isinstance(val, torch.Tensor) and _travels_as_float(val):
                wire["outputs"][j] = val.dtype
                node.meta["val"] = val.to(WIRE_DTYPE)  # what torch checks the sent value against
    stage_module._autopipe_wire = wire


def _in_traced_dtype(value: Any, traced: torch.dtype, index: int) -> Any:
    """A floating output in the dtype the receiving stage's buffer was traced with."""
    if not isinstance(value, torch.Tensor) or value.dtype == traced:
        return value
    if value.is_floating_point() and torch.finfo(value.dtype).bits < torch.finfo(traced).bits:
        return value.to(traced)
    raise TypeError(f"stage output {index} is {value.dtype} but was traced as {traced}, and the receiving "
                    f"stage reads it as {traced}: run the step in the precision the pipeline was built in "
                    f"(an autocast region may only narrow what the stages send)")


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it is made contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


class _Attached(torch.autograd.Function):
    """``value`` unchanged but part of ``anchor``'s autograd graph, contributing no gradient."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return None, None


class _TieZeroGrad(torch.autograd.Function):
    """``out`` unchanged; in backward, ``out``'s gradient and a zero gradient for each tied input."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *tied: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.tied_meta = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.tied_meta))


def guard_stage_boundaries(stage_module: nn.Module, *, fresh_outputs: bool = False) -> None:
    """Make what crosses a stage boundary sendable, in both directions, at run time.

    Example:
        >>> stage = nn.Linear(2, 2)
        >>> guard_stage_boundaries(stage)  # no wire description: only views and strides guarded
        >>> stage(torch.ones(1, 2)).is_contiguous()
        True
    """
    inner = stage_module.forward
    wire = getattr(stage_module, "_autopipe_wire", {"inputs": {}, "outputs": {}, "traced": {}})

    def sendable(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if fresh_outputs or t._is_view():
            return t.clone(memory_format=torch.contiguous_format)
        return t.contiguous()

    def guarded(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            return _ContiguousGrad.apply(t)
        return t

    def forward(*args, **kwargs):
        args = list(args)
        encoded = []  # received integers, as floats: decoded here, tied to an output below
        for i, dtype in wire["inputs"].items():
            if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].dtype != dtype:
                encoded.append(args[i])
                args[i] = args[i].detach().to(dtype)
        out = inner(*tree_map(guarded, tuple(args)), **tree_map(guarded, kwargs))
        flat, spec = tree_flatten(out)
        # A float output in the autograd graph: sent integers and received ones hang off it.
        anchor = next((j for j, v in enumerate(flat) if isinstance(v, torch.Tensor) and v.requires_grad
                       and j not in wire["outputs"]), None) if torch.is_grad_enabled() else None
        for j, dtype in wire["traced"].items():
            flat[j] = _in_traced_dtype(flat[j], dtype, j)
        for j, value in enumerate(flat):
            if j in wire["outputs"] and isinstance(value, torch.Tensor):
                flat[j] = value.to(WIRE_DTYPE)
                if anchor is not None:  # torch's backward wants every sent tensor in the graph
                    flat[j] = _Attached.apply(flat[j], flat[anchor])
        tied = [t for t in encoded if t.requires_grad]
        if tied and anchor is not None:
            flat[anchor] = _TieZeroGrad.apply(flat[anchor], *tied)
        return tree_map(sendable, tree_unflatten(flat, spec))

    stage_module.forward = forward


def to_stage_device(value: Any, device: torch.device) -> Any:
    """A tensor of the batch on the stage's ``device``, contiguous; anything else as it is.

    Example:
        >>> to_stage_device(torch.ones(3, 4)[:, :2], torch.device("cpu")).is_contiguous()
        True
    """
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True).contiguous()
    return value


# ---------------------------------------------------------------------- manual stages (V placement)
class VStage(PipelineStage):
    """A manual stage whose first step never sends to its own rank."""

    def _get_init_p2p_neighbors_ops(self) -> list:
        ops = super()._get_init_p2p_neighbors_ops()
        me_in_group, me = dist.get_rank(self.group), dist.get_rank()

        def peer_is_me(op) -> bool:
            group_peer = getattr(op, "group_peer", None)
            return group_peer == me_in_group if group_peer is not None else getattr(op, "peer", None) == me

        return [op for op in ops if not peer_is_me(op)]


def static_stage_meta(stage_module: nn.Module, first_stage_args: tuple | None
                      ) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """What a stage receives and sends, as meta tensors from its traced graph (one micro-batch).

    Example:
        >>> gm = fx.symbolic_trace(nn.Linear(2, 3))
        >>> for node in gm.graph.nodes:
        ...     node.meta["val"] = torch.empty(4, 2 if node.op == "placeholder" else 3)
        >>> inputs, outputs = static_stage_meta(gm, None)
        >>> inputs[0].shape, outputs[0].shape, inputs[0].device.type
        (torch.Size([4, 2]), torch.Size([4, 3]), 'meta')
    """
    def meta(val: Any, requires_grad: bool) -> torch.Tensor | None:
        if not isinstance(val, torch.Tensor):
            return None
        t = torch.empty(val.shape, dtype=val.dtype, device="meta")
        return t.requires_grad_(requires_grad and t.is_floating_point())

    graph = stage_module.graph
    if first_stage_args is not None:
        inputs = [meta(a, a.requires_grad) if isinstance(a, torch.Tensor) else None for a in first_stage_args]
    else:
        inputs = [meta(p.meta.get("val"), True) for p in graph.nodes if p.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    values, _ = tree_flatten(output.args[0])
    outputs = [meta(v.meta.get("val") if isinstance(v, torch.fx.Node) else v, True) for v in values]
    if any(t is None for t in inputs) or not outputs or any(t is None for t in outputs):
        return None, None
    return tuple(inputs), tuple(outputs)


def meta_devices_to(stage_module: nn.Module, device: torch.device) -> int:
    """Point every ``device=meta`` a meta trace baked into the stage's graphs at ``device``; the count.

    torch's ``build_stage`` rewrites ``device=`` keywords only; a positional device, as
    ``x.to(inv_freq.device)`` in rotary embeddings traces, stays on meta.

    Example:
        >>> g = fx.Graph(); x = g.placeholder("x")
        >>> _ = g.output(g.call_function(torch.ops.aten.to.device, (x, torch.device("meta"), torch.float32)))
        >>> gm = fx.GraphModule(nn.Module(), g)
        >>> meta_devices_to(gm, torch.device("cpu")), gm(torch.ones(1)).device.type
        (1, 'cpu')
    """
    def moved(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    changed = 0
    for module in stage_module.modules():
        graph_module = module if isinstance(module, fx.GraphModule) else getattr(module, "graph_module", None)
        if not isinstance(graph_module, fx.GraphModule):
            continue
        count = 0
        for node in graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = tree_map(moved, node.args), tree_map(moved, dict(node.kwargs))
            if args != node.args or kwargs != dict(node.kwargs):
                node.args, node.kwargs = args, kwargs
                count += 1
        if count:
            graph_module.recompile()
            changed += count
    return changed


# ---------------------------------------------------------------------- torch.fx keeps generated source
def _fx_loader() -> Any:
    """torch.fx's store of generated source (``torch.fx.graph_module._loader``), or None where it has none."""
    from torch.fx import graph_module

    loader = getattr(graph_module, "_loader", None)
    return loader if isinstance(getattr(loader, "eval_cache", None), dict) else None


@contextlib.contextmanager
def generated_source_recorded() -> Iterator[list[str]]:
    """The keys under which torch.fx files the source of every module generated within the block.

    torch.fx keeps each generated module's source in its loader, and an entry holding a copy
    of the module's globals in ``linecache``, for tracebacks, and never drops either: a pipeline
    that traces its stages again for every new input shape would grow by a quarter of a MB a
    trace. :func:`forget_generated_source` drops them when the stages that need them go.

    Returns:
        (as the ``with`` target) the keys, filled in when the block ends.

    Example:
        >>> with generated_source_recorded() as keys:
        ...     _ = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> len(keys) >= 1
        True
        >>> forget_generated_source(keys)
    """
    loader = _fx_loader()
    before = set(loader.eval_cache) if loader is not None else set()
    keys: list[str] = []
    try:
        yield keys
    finally:
        if loader is not None:
            keys.extend(k for k in loader.eval_cache if k not in before)


def forget_generated_source(keys: list[str]) -> None:
    """Drop the source torch.fx kept under ``keys`` (:func:`generated_source_recorded`); the modules still run."""
    loader = _fx_loader()
    for key in keys:
        if loader is not None:
            loader.eval_cache.pop(key, None)
        linecache.cache.pop(key, None)
    keys.clear()



def forget_cached_sharding() -> None:
    """Drop DTensor's cached sharding decisions before a new mesh is used. A ``DeviceMesh`` equals any
    other of the same ranks and names whatever process groups it holds, so a decision cached for a
    mesh whose groups were destroyed (a closed pipeline's world) would send the new mesh's tensors
    through those groups: "Could not resolve the process group" (torch 2.11 to 2.13)."""
    from torch.distributed.tensor import DTensor

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if native is not None:
        native()
    cached = getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
