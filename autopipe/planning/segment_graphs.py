"""One small graph per segment of a traced model, and copies of traced graphs on another device.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
    >>> traced = trace(model, args)
    >>> [type(s.module).__name__ for s in segment_modules(traced)][:1]
    ['GraphModule']
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .inplace import clone_inputs_written_in_place
from .tracing import TracedModel

@dataclass
class SegmentModule:
    """One segment as a graph of its own: its module, the graph values it reads and those read after it."""

    module: fx.GraphModule
    inputs: list[str]  # graph value names it reads from earlier segments / model inputs
    outputs: list[str]  # graph value names later segments (or the model output) read


def segment_modules(traced: TracedModel, gm: fx.GraphModule | None = None) -> list[SegmentModule]:
    """One small GraphModule per segment, over the shared root ``gm`` (default the traced model's
    graph, else a copy of it); parameters are not copied.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.tracing import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
        >>> traced = trace(model, args)
        >>> parts = segment_modules(traced)
        >>> len(parts) == traced.num_segments, parts[0].inputs == list(traced.exported.graph_signature.user_inputs)
        (True, True)
    """
    gm = traced.graph_module if gm is None else gm
    by_name = {n.name: n for n in gm.graph.nodes}
    # Unlifting may rename the model's input placeholders (input -> input_1); they keep their
    # order, so map them back to the exported program's names, which the profiler feeds.
    gm_inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ep_name = dict(zip(gm_inputs, traced.exported.graph_signature.user_inputs))
    seg_of = {}
    for seg in traced.segments:
        for node in traced.nodes[seg.start:seg.end]:
            seg_of[node.name] = seg.index
    last = len(traced.segments)
    result = []
    for seg in traced.segments:
        graph = fx.Graph()
        env: dict[str, fx.Node] = {}
        inputs: list[str] = []

        def value(n: fx.Node, graph=graph, env=env, inputs=inputs) -> fx.Node:
            if n.name in env:
                return env[n.name]
            if n.op == "get_attr":
                env[n.name] = graph.get_attr(n.target)
            else:  # produced by an earlier segment, or a model input
                env[n.name] = graph.placeholder(n.name)
                inputs.append(ep_name.get(n.name, n.name))
            return env[n.name]

        for ep_node in traced.nodes[seg.start:seg.end]:
            node = by_name[ep_node.name]
            env[node.name] = graph.node_copy(node, lambda a: value(a))
        outputs = []
        for ep_node in traced.nodes[seg.start:seg.end]:
            node = by_name[ep_node.name]
            if any(u.op == "output" or seg_of.get(u.name, last) > seg.index for u in node.users):
                outputs.append(node.name)
        graph.output(tuple(env[o] for o in outputs))
        # A segment is fed leaves that require grad, as a stage is, and autograd refuses an
        # in-place write into one (a cut before ReLU(inplace=True) or ``out += identity``).
        # The stage copies such an input (runtime.stages.split_model), so the segment does too,
        # and its profile includes the copy's time and buffer. The copy is charged even when
        # the segment ends up inside a stage, where none is made: an overestimate of one
        # elementwise copy, rather than cuts left out or a copy the plan does not see.
        clone_inputs_written_in_place(graph)
        result.append(SegmentModule(fx.GraphModule(gm, graph), inputs, outputs))
    return result


def _retarget(value: Any, dev: torch.device) -> Any:
    """``dev`` in place of a device other than ``dev`` (a ``torch.device`` or its name), else ``value``."""
    if isinstance(value, (torch.device, str)):
        try:
            if torch.device(value) != dev:
                return dev
        except RuntimeError:  # a string that names no device
            pass
    return value


def on_meta_device(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds any parameter or buffer on the meta device (shapes, no values).

    Example:
        >>> with torch.device("meta"):
        ...     lin = torch.nn.Linear(2, 2)
        >>> on_meta_device(lin), on_meta_device(torch.nn.Linear(2, 2))
        (True, False)
    """
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


#: Standard deviation of the stand-in values of floating tensors: small, as weights start,
#: so that a profiled segment's outputs stay finite through many layers.
STAND_IN_STD = 0.02


def stand_in(t: torch.Tensor, device: str | torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``t`` on ``device``; a tensor on the meta device gets values to run with.

    Example:
        >>> ids = stand_in(torch.empty(2, 3, dtype=torch.long, device="meta"), "cpu")
        >>> ids.device.type, ids.sum().item()
        ('cpu', 0)
    """
    dev = torch.device(device)
    if not t.is_meta or dev.type == "meta":
        return t.to(dev)
    out = torch.empty(t.shape, dtype=t.dtype, device=dev)
    if t.is_floating_point() or t.is_complex():
        return out.normal_(0.0, STAND_IN_STD, generator=generator)
    return out.fill_(True if t.dtype == torch.bool else 0)


def copy_to_device(module: fx.GraphModule, device: str | torch.device) -> fx.GraphModule:
    """A copy of a traced (segment) module on ``device``, with the devices its graph names moved too.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.tracing import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=1, seq_len=8)
        >>> moved = copy_to_device(trace(model, args).graph_module, "meta")
        >>> {p.device.type for p in moved.parameters()}
        {'meta'}
    """
    dev = torch.device(device)
    moved = copy.deepcopy(module)
    generator = None
    if on_meta_device(moved) and dev.type != "meta":
        generator = torch.Generator(device=dev)
        generator.manual_seed(0)
    moved._apply(lambda t: stand_in(t, dev, generator))  # what Module.to does, with values for meta tensors
    for gm in moved.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if "device" in node.kwargs:
                node.kwargs = {**node.kwargs, "device": _retarget(node.kwargs["device"], dev)}
            if node.op == "call_function" and node.target is torch.ops.aten.to.device:
                node.args = (node.args[0], _retarget(node.args[1], dev), *node.args[2:])
            elif node.op == "get_attr":
                owner, _, name = node.target.rpartition(".")
                holder = gm.get_submodule(owner) if owner else gm
                value = getattr(holder, name)
                if isinstance(value, torch.Tensor) and value.device != dev:  # .to() moved weights and buffers
                    setattr(holder, name, stand_in(value, dev))
        gm.recompile()
    return moved
