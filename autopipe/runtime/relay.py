"""Rewire a split model so that every stage talks only to its neighbours.

Example:
        >>> from torch.distributed.pipelining import pipeline  # doctest: +SKIP
        >>> pipe = pipeline(model, (x,), split_spec=spec)  # doctest: +SKIP
        >>> relay_skip_connections(pipe)  # doctest: +SKIP
        2
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

def _stage_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_module"]


def _producer(value: fx.Node, stage_of: dict[fx.Node, int]) -> int:
    """Stage that computes a top-level value (a stage call or a getitem of one); -1 for an input."""
    node = value.args[0] if value.op == "call_function" and value.target is operator.getitem else value
    return stage_of.get(node, -1)


def boundary_values(graph: fx.Graph) -> tuple[list[list[fx.Node]], dict[fx.Node, int]]:
    """The values live across each cut of a split graph, in a fixed order.

    Example:
        >>> live, _ = boundary_values(pipe.split_gm.graph)  # doctest: +SKIP
    """
    stages = _stage_nodes(graph)
    stage_of = {node: k for k, node in enumerate(stages)}
    position = {node: i for i, node in enumerate(graph.nodes)}
    last_reader: dict[fx.Node, int] = {}
    producer: dict[fx.Node, int] = {}

    def read(value: fx.Node, reader: int) -> None:
        p = max(_producer(value, stage_of), 0)  # a model input is held by stage 0
        if reader > p:
            producer[value] = p
            last_reader[value] = max(last_reader.get(value, reader), reader)

    for k, node in enumerate(stages):
        for value in node.all_input_nodes:
            read(value, k)
    output = next(n for n in graph.nodes if n.op == "output")
    for value in output.all_input_nodes:
        read(value, len(stages) - 1)  # the last stage returns every output of the model
    live = []
    for b in range(len(stages) - 1):
        crossing = [v for v, p in producer.items() if p <= b < last_reader[v]]
        live.append(sorted(crossing, key=lambda v: (producer[v], position[v])))
    return live, producer


def relay_skip_connections(pipe: Any) -> int:
    """Make every stage of ``pipe`` receive exactly what the previous stage sends, in order.

    Example:
        >>> relay_skip_connections(pipe)  # doctest: +SKIP
        0
    """
    top = pipe.split_gm.graph
    live, producer = boundary_values(top)
    stages = _stage_nodes(top)
    n = len(stages)
    # Non-tensor inputs (flags, sizes) are baked into the graph by torch.export and read by
    # no stage; torch's stages carry tensors only.
    model_inputs = [node for node in top.nodes if node.op == "placeholder"
                    and (isinstance(node.meta.get("val"), torch.Tensor) or node.users)]
    top_output = next(o for o in top.nodes if o.op == "output")
    output_leaves = [v for v in _flat(top_output.args[0]) if isinstance(v, fx.Node)]
    relays = 0
    # inside[k][v]: the node inside stage k's graph that holds top-level value v.
    inside: list[dict[fx.Node, fx.Node]] = []
    for k, call in enumerate(stages):
        module = pipe.split_gm.get_submodule(call.target)
        graph: fx.Graph = module.graph
        placeholders = [p for p in graph.nodes if p.op == "placeholder"]
        output = next(o for o in graph.nodes if o.op == "output")
        held: dict[fx.Node, fx.Node] = {}

        # Inputs: the model's inputs for stage 0, else exactly live[k - 1], in order. Reuse
        # a placeholder for a value the stage already read; add one for a value it only
        # passes on.
        wanted = model_inputs if k == 0 else live[k - 1]
        old = dict(zip(call.args, placeholders))  # a value passed twice keeps one placeholder
        for value, placeholder in zip(call.args, placeholders):
            if old[value] is not placeholder:
                placeholder.replace_all_uses_with(old[value])
        first = next(iter(graph.nodes))
        for value in wanted:
            with graph.inserting_before(first):
                new = graph.placeholder(_placeholder_name(value, k, producer))
            source = value if k == 0 else inside[producer[value]][value]
            new.meta["val"] = source.meta.get("val")
            if value in old:
                old[value].replace_all_uses_with(new)
            held[value] = new
        for placeholder in placeholders:
            graph.erase_node(placeholder)
        if k == 0:
            # torch gives stage 0 the model's pytree signature when the input counts match;
            # the stage is now called with the flat inputs, in graph order.
            graph._codegen = fx.graph.CodeGen()

        # Outputs this stage computes, as the top-level values that name them.
        results = output.args[0]
        if isinstance(results, (tuple, list)):
            for user in call.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    held[user] = results[user.args[1]]
        else:
            held[call] = results
        inside.append(held)

        sent = live[k] if k < n - 1 else output_leaves
        values = []
        for value in sent:
            node = held[value]
            if node.op == "placeholder":
                relays += k < n - 1
                # Passed on as a copy: torch's stages detach their outputs in place during
                # the zero-bubble backward, which neither an input nor a view survives.
                with graph.inserting_before(output):
                    copy = graph.call_function(torch.ops.aten.clone.default, (node,))
                copy.meta["val"] = node.meta.get("val")
                node = copy
            values.append(node)
        output.args = (tuple(values) if len(values) != 1 else values[0],)
        graph.lint()
        module.recompile()

    # The top-level graph: stage 0 called with the model inputs, stage k with live[k - 1],
    # outputs unpacked in order.
    new_top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in top.nodes:
        if node.op == "placeholder":
            env[node] = new_top.node_copy(node, lambda a: env[a])
    for k, call in enumerate(stages):
        args = tuple(env[v] for v in (model_inputs if k == 0 else live[k - 1]))
        new_call = new_top.call_module(call.target, args)
        new_call.meta = dict(call.meta)
        sent = live[k] if k < n - 1 else output_leaves
        if len(sent) == 1:
            unpacked = {sent[0]: new_call}
        else:
            unpacked = {value: new_top.call_function(operator.getitem, (new_call, i))
                        for i, value in enumerate(sent)}
        if k < n - 1:
            env.update(unpacked)
        else:
            final = unpacked
    new_top.output(fx.node.map_arg(top_output.args[0], lambda a: final[a]))
    new_top.lint()
    # Swap the nodes inside the same Graph object: Pipe and its executor hold on to it.
    for node in reversed(list(top.nodes)):
        top.erase_node(node)
    top.output(top.graph_copy(new_top, {}))
    top.lint()
    pipe.split_gm.recompile()
    return relays


def _flat(value: Any) -> list[Any]:
    """The leaves of a graph output argument (nested tuples and lists), in order."""
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _flat(item)]
    return [value]


def _placeholder_name(value: fx.Node, stage: int, producer: dict[fx.Node, int]) -> str:
    """The model input's own name in stage 0; elsewhere where the value comes from."""
    if stage == 0:
        return value.name
    return f"from_stage_{producer[value]}_{value.name}"
