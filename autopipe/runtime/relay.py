"""Rewire a split model so that every stage talks only to its neighbours.

``torch.distributed.pipelining.pipeline()`` lets stage ``k`` read any earlier stage's
output directly. A cut inside a residual block, or a mask computed once and read by every
decoder block, then makes a *skip connection*: stage 1 sends to stage 3. torch's
multi-stage schedules refuse that ("only supports adjacent-stage communication"), its
manual ``PipelineStage`` (used for V schedules) assumes it never happens, and its traced
stage cannot run the backward of one ("Backward of skip connections not supported yet").

:func:`relay_skip_connections` rewrites the split graph so each such value is passed
along by every stage in between (received, copied out, its gradient passed back),
which is also what autopipe's cost model charges each cut for: every tensor live across it.
After the rewrite, stage ``k`` receives exactly what stage ``k - 1`` sends, in order.

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

__all__ = ["relay_skip_connections", "boundary_values"]


def _stage_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_module"]


def _producer(value: fx.Node, stage_of: dict[fx.Node, int]) -> int:
    """Stage that computes a top-level value (a stage call or a getitem of one); -1 for an input."""
    node = value.args[0] if value.op == "call_function" and value.target is operator.getitem else value
    return stage_of.get(node, -1)


def boundary_values(graph: fx.Graph) -> tuple[list[list[fx.Node]], dict[fx.Node, int]]:
    """The values live across each cut of a split graph, in a fixed order.

    Args:
        graph: ``pipe.split_gm.graph``.

    Returns:
        ``(live, producer)``: ``live[b]`` lists the top-level values computed at or before
        stage ``b`` and read after it (the tensors cut ``b`` must carry), ordered by the
        stage that computes them, then graph order; ``producer[v]`` is that stage.

    Raises:
        NotImplementedError: a stage other than the first reads a model input directly,
            or the model's output comes from a stage other than the last.

    Example:
        >>> live, _ = boundary_values(pipe.split_gm.graph)  # doctest: +SKIP
    """
    stages = _stage_nodes(graph)
    stage_of = {node: k for k, node in enumerate(stages)}
    position = {node: i for i, node in enumerate(graph.nodes)}
    last_reader: dict[fx.Node, int] = {}
    producer: dict[fx.Node, int] = {}
    for k, node in enumerate(stages):
        for value in node.all_input_nodes:
            p = _producer(value, stage_of)
            if p < 0 and k > 0:
                raise NotImplementedError(
                    f"stage {k} reads the model input {value.name!r} directly; autopipe can only "
                    f"run splits where the inputs are read by the first stage"
                )
            if p >= 0:
                producer[value] = p
                last_reader[value] = max(last_reader.get(value, k), k)
    output = next(n for n in graph.nodes if n.op == "output")
    for value in output.all_input_nodes:
        if _producer(value, stage_of) != len(stages) - 1:
            raise NotImplementedError(
                f"the model's output {value.name!r} is computed by stage "
                f"{_producer(value, stage_of)}, not the last; autopipe needs every output from the last stage"
            )
    live = []
    for b in range(len(stages) - 1):
        crossing = [v for v, p in producer.items() if p <= b < last_reader[v]]
        live.append(sorted(crossing, key=lambda v: (producer[v], position[v])))
    return live, producer


def relay_skip_connections(pipe: Any) -> int:
    """Make every stage of ``pipe`` receive exactly what the previous stage sends, in order.

    Changes ``pipe`` in place: the stage modules' graphs (new inputs and outputs) and the
    top-level graph that wires them. A pipe without skip connections, whose stages already
    pass their values in the order the next stage reads them, is rewired to the same thing.

    Args:
        pipe: a ``torch.distributed.pipelining.Pipe`` from ``pipeline()``.

    Returns:
        How many (value, intermediate stage) relays were added.

    Raises:
        NotImplementedError: see :func:`boundary_values`.

    Example:
        >>> relay_skip_connections(pipe)  # doctest: +SKIP
        0
    """
    top = pipe.split_gm.graph
    live, producer = boundary_values(top)
    stages = _stage_nodes(top)
    n = len(stages)
    relays = 0
    # inside[k][v]: the node inside stage k's graph that holds top-level value v.
    inside: list[dict[fx.Node, fx.Node]] = []
    for k, call in enumerate(stages):
        module = pipe.split_gm.get_submodule(call.target)
        graph: fx.Graph = module.graph
        placeholders = [p for p in graph.nodes if p.op == "placeholder"]
        output = next(o for o in graph.nodes if o.op == "output")
        held: dict[fx.Node, fx.Node] = {}

        if k > 0:
            # Inputs: exactly live[k - 1], in order. Reuse a placeholder for a value the
            # stage already read; add one for a value it only passes on.
            wanted = live[k - 1]
            old = dict(zip(call.args, placeholders))  # a value passed twice keeps one placeholder
            for value, placeholder in zip(call.args, placeholders):
                if old[value] is not placeholder:
                    placeholder.replace_all_uses_with(old[value])
            first = next(iter(graph.nodes))
            for value in wanted:
                with graph.inserting_before(first):
                    new = graph.placeholder(f"from_stage_{producer[value]}_{value.name}")
                new.meta["val"] = inside[producer[value]][value].meta.get("val")
                if value in old:
                    old[value].replace_all_uses_with(new)
                held[value] = new
            for placeholder in placeholders:
                graph.erase_node(placeholder)

        # Outputs this stage computes, as the top-level values that name them.
        results = output.args[0]
        if isinstance(results, (tuple, list)):
            for user in call.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    held[user] = results[user.args[1]]
        else:
            held[call] = results
        inside.append(held)

        if k < n - 1:
            sent = []
            for value in live[k]:
                node = held[value]
                if node.op == "placeholder":
                    relays += 1
                    # Passed on as a copy: torch's stages detach their outputs in place during
                    # the zero-bubble backward, which neither an input nor a view survives.
                    with graph.inserting_before(output):
                        copy = graph.call_function(torch.ops.aten.clone.default, (node,))
                    copy.meta["val"] = node.meta.get("val")
                    node = copy
                sent.append(node)
            output.args = (tuple(sent) if len(sent) > 1 else sent[0],)
        graph.lint()
        module.recompile()

    # The top-level graph: stage k called with live[k - 1], its outputs unpacked in order.
    new_top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in top.nodes:
        if node.op == "placeholder":
            env[node] = new_top.node_copy(node, lambda a: env[a])
    for k, call in enumerate(stages):
        args = tuple(env[a] for a in call.args) if k == 0 else tuple(env[v] for v in live[k - 1])
        new_call = new_top.call_module(call.target, args)
        new_call.meta = dict(call.meta)
        env[call] = new_call
        if k < n - 1:
            if len(live[k]) == 1:
                env[live[k][0]] = new_call
            else:
                for i, value in enumerate(live[k]):
                    env[value] = new_top.call_function(operator.getitem, (new_call, i))
    last = stages[-1]
    for user in last.users:  # the last stage's outputs, as the original graph unpacked them
        if user.op == "call_function" and user.target is operator.getitem:
            env[user] = new_top.call_function(operator.getitem, (env[last], user.args[1]))
    output = next(o for o in top.nodes if o.op == "output")
    new_top.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
    new_top.lint()
    # Swap the nodes inside the same Graph object: Pipe and its executor hold on to it.
    for node in reversed(list(top.nodes)):
        top.erase_node(node)
    top.output(top.graph_copy(new_top, {}))
    top.lint()
    pipe.split_gm.recompile()
    return relays
