"""Find the graph inputs a graph writes in place, and give each a private copy.

Example:
    >>> import torch
    >>> class Block(torch.nn.Module):
    ...     def forward(self, out, identity):
    ...         out += identity
    ...         return out.relu_()
    >>> gm = torch.export.export(Block(), (torch.randn(2, 3), torch.randn(2, 3))).module()
    >>> clone_inputs_written_in_place(gm.graph)
    ['out']
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> gm(x, torch.randn(2, 3)).sum().backward()  # without the copy: "a leaf Variable ..."
    >>> x.grad.shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

def _nodes_in(value: Any) -> Iterator[fx.Node]:
    """The graph nodes inside an argument value (a node, or lists, tuples and dicts of them)."""
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _nodes_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _nodes_in(item)


def _bound_arguments(node: fx.Node, schema: torch.FunctionSchema) -> Iterator[tuple[Any, Any]]:
    """``(schema argument, value passed)`` for each argument the node passes, by position then name."""
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args) and not argument.kwarg_only:
            yield argument, node.args[i]
        elif argument.name in node.kwargs:
            yield argument, node.kwargs[argument.name]


def _result_may_alias(argument: Any, schema: torch.FunctionSchema) -> bool:
    """Whether the operator's result may share memory with ``argument`` (its schema says so)."""
    info = argument.alias_info
    if info is None:
        return False
    for result in schema.returns:
        ret = result.alias_info
        if ret is None:
            continue
        if "*" in info.after_set or not (ret.before_set | ret.after_set):
            # Into the wildcard set, or a returned list with no set of its own: the alias
            # is on its elements, which torch does not expose on the list's alias_info.
            return True
        if (info.before_set | info.after_set) & (ret.before_set | ret.after_set):
            return True
    return False


def _submodule(owner: torch.nn.Module | None, target: str) -> torch.nn.Module | None:
    """``owner``'s submodule at the dotted path ``target`` (a ``call_module`` or ``get_attr`` target), else None."""
    if owner is None:
        return None
    try:
        return owner.get_submodule(target)
    except AttributeError:
        return None


def _subgraphs(node: fx.Node, owner: torch.nn.Module | None) -> list[tuple[fx.Graph, torch.nn.Module]]:
    """The graphs a higher-order operator call runs (``get_attr`` arguments naming graph modules)."""
    found = []
    for arg in _nodes_in((node.args, node.kwargs)):
        if arg.op == "get_attr":
            module = _submodule(owner, arg.target)
            if isinstance(getattr(module, "graph", None), fx.Graph):
                found.append((module.graph, module))
    return found


#: Operators whose schema declares no alias but which return their input itself in some
#: cases: dropout with p = 0 or train = False (Wav2Vec2's feature projection dropout of 0.0,
#: then SpecAugment's in-place masking of its result).
_MAY_RETURN_INPUT = {torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
                     torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default}


def _analyse(graph: fx.Graph, owner: torch.nn.Module | None) -> tuple[list[fx.Node], set[int], set[int]]:
    """The graph's placeholders, the indices of those it writes, and of those its output may alias."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {p: i for i, p in enumerate(placeholders)}
    # Which placeholders (by index) each value may share memory with.
    shares: dict[fx.Node, set[int]] = {p: {i} for p, i in index.items()}
    written: set[int] = set()
    returned: set[int] = set()

    def roots(value: Any) -> set[int]:
        found: set[int] = set()
        for n in _nodes_in(value):
            found |= shares.get(n, set())
        return found

    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            schema = node.target._schema
            result: set[int] = set()
            for argument, value in _bound_arguments(node, schema):
                if argument.alias_info is None:
                    continue
                reached = roots(value)
                if argument.alias_info.is_write:
                    written |= reached
                if _result_may_alias(argument, schema):
                    result |= reached
            if node.target in _MAY_RETURN_INPUT and node.args:
                result |= roots(node.args[0])
            if result:
                shares[node] = result
        elif node.op == "call_function" and node.target is operator.getitem:
            # An element of a multi-result op (or of a called submodule's tuple) shares
            # what the whole result shares.
            if node.args[0] in shares:
                shares[node] = shares[node.args[0]]
        elif node.op == "call_module":
            child = _submodule(owner, node.target)
            child_graph = getattr(child, "graph", None)
            if isinstance(child_graph, fx.Graph):
                child_inputs, child_written, child_returned = _analyse(child_graph, child)
                passed = list(node.args) + [node.kwargs.get(p.target) for p in child_inputs[len(node.args):]]
                for k in child_written:
                    if k < len(passed):
                        written |= roots(passed[k])
                result = set().union(*(roots(passed[k]) for k in child_returned if k < len(passed)))
                if result:
                    shares[node] = result
        elif node.op == "call_function" and (subgraphs := _subgraphs(node, owner)):
            # A higher-order operator (torch.no_grad() in forward exports as
            # wrap_with_set_grad_enabled): how its operands reach its graphs differs from one
            # operator to the next, so a graph that writes any input counts as writing them all.
            analysed = [_analyse(g, m) for g, m in subgraphs]
            reached = roots((node.args, node.kwargs))
            if any(w for _, w, _ in analysed):
                written |= reached
            if any(r for _, _, r in analysed) and reached:
                shares[node] = reached
        elif node.op == "output":
            returned |= roots(node.args)
    return placeholders, written, returned


def inputs_written_in_place(graph: fx.Graph) -> list[fx.Node]:
    """The placeholders of ``graph`` that it writes in place, directly or through a view.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def forward(self, x, y):
        ...         x[:, 0].add_(1)  # a write through a view of x
        ...         return x * y
        >>> gm = torch.export.export(M(), (torch.randn(2, 3), torch.randn(2, 3))).module()
        >>> [p.name for p in inputs_written_in_place(gm.graph)]
        ['x']
    """
    placeholders, written, _ = _analyse(graph, graph.owning_module)
    return [p for i, p in enumerate(placeholders) if i in written]


def clone_inputs_written_in_place(graph: fx.Graph) -> list[str]:
    """Give every placeholder that ``graph`` writes in place a private copy; return their names.

    Example:
        >>> import torch
        >>> class M(torch.nn.Module):
        ...     def forward(self, x, y):
        ...         return x.relu_() + y
        >>> gm = torch.export.export(M(), (torch.randn(2), torch.randn(2))).module()
        >>> clone_inputs_written_in_place(gm.graph)
        ['x']
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][:2]
        [<OpOverload(op='aten.clone', overload='default')>, <OpOverload(op='aten.relu_', overload='default')>]
    """
    names = []
    for placeholder in inputs_written_in_place(graph):
        with graph.inserting_after(placeholder):
            copy = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
        # Passes after this one (boundary descriptions, stage metadata) read what a value is.
        for key in ("val", "tensor_meta"):
            if key in placeholder.meta:
                copy.meta[key] = placeholder.meta[key]
        placeholder.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
        names.append(placeholder.name)
    if names:
        graph.lint()
        if isinstance(graph.owning_module, fx.GraphModule):
            graph.owning_module.recompile()
    return names
