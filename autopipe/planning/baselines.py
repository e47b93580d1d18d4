"""The splits the tools a user would pick instead give, costed with autopipe's own model.

Example:
    >>> from autopipe.planning.baselines import layer_units
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> model, args = seed_transformer(vocab_size=100, num_layers=4, seq_len=8)
    >>> units = layer_units(trace(model, args))
    >>> units.names
    ['embedding', 'pos_encoding', 'layers.0', 'layers.1', 'layers.2', 'layers.3', 'out_linear']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import peers
from .costgraph import SegmentCost
from .partitioner import PartitionProblem, PartitionResult, evaluate
from .tracing import TracedModel, module_spans

#: name -> one-line description shown in reports (with the version of the tool followed).
BASELINES = {
    "deepspeed_parameters": "DeepSpeed 0.19.8 PipelineModule partition_method='parameters' (balanced trainable "
                            "parameters per layer)",
    "deepspeed_uniform": "DeepSpeed 0.19.8 partition_method='uniform' (equal layer counts, remainder first)",
    "torchtitan_default": "torchtitan 0.3.0 default split (blocks + embedding + head as equal units)",
    "torchgpipe_time": "torchgpipe 0.0.7 balance_by_time (block partition of per-layer forward+backward time)",
    "pippy_equal_size": "torchpippy 0.2.0 split_into_equal_size (equal parameter+buffer elements per stage)",
    "flops_dp": "torchtitan PR #2113 / torch PR #179212 auto-partition (forward FLOPs, min-max DP, simulated 1F1B)",
}


@dataclass
class LayerUnits:
    """The model's layers as segment ranges: the units a by-layer tool splits between."""

    names: list[str]  # one per unit, in order
    starts: list[int]  # first segment of each unit (starts[0] == 0)
    num_segments: int
    # Each list of repeated blocks: (container name, index of its first unit, of its last unit).
    block_lists: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def first_block(self) -> int:
        """Index of the first unit of the longest block list (0 without one)."""
        return self._longest()[1]

    @property
    def last_block(self) -> int:
        """Index of the last unit of the longest block list (the last unit without one)."""
        return self._longest()[2]

    @property
    def block_names(self) -> list[str]:
        return self.names[self.first_block : self.last_block + 1]

    def _longest(self) -> tuple[str, int, int]:
        if not self.block_lists:
            return ("", 0, len(self.names) - 1)
        return max(self.block_lists, key=lambda b: b[2] - b[1])

    def unit_sums(self, per_segment: Sequence[float] | np.ndarray) -> np.ndarray:
        """Sum a per-segment quantity over each unit."""
        per_segment = np.asarray(per_segment, dtype=float)
        edges = [*self.starts, self.num_segments]
        return np.array([per_segment[edges[u] : edges[u + 1]].sum() for u in range(len(self.names))])

    def segment_cuts(self, bounds: Sequence[int]) -> list[int]:
        """Segment cuts of unit boundaries ``[0, b1, ..., len(names)]``."""
        return [self.starts[b] for b in bounds[1:-1]]


@dataclass
class BaselineSplit:
    """One baseline's answer: segment ``cuts``, or None with the ``reason`` it gives no split."""

    name: str
    cuts: list[int] | None
    reason: str = ""


def _module_tree(traced: TracedModel) -> tuple[dict[str, int], dict[str, list[str]], dict[str, str]]:
    """First node of every module that ran (and of every container of one), children in order, class names."""
    spans, _ = module_spans(traced.nodes)
    first: dict[str, int] = {}
    kind: dict[str, str] = {}
    for node in traced.nodes:
        for fqn, cls in (node.meta.get("nn_module_stack") or {}).values():
            if fqn and fqn not in kind:
                kind[fqn] = getattr(cls, "__qualname__", None) or str(cls).rsplit(".", 1)[-1]
    for fqn, idx in spans.items():
        parts = fqn.split(".")
        for k in range(1, len(parts) + 1):  # a ModuleList is never called: its first node is its first child's
            name = ".".join(parts[:k])
            first[name] = min(first.get(name, idx[0]), idx[0])
    children: dict[str, list[str]] = {}
    for name in first:
        children.setdefault(name.rpartition(".")[0], []).append(name)
    for kids in children.values():
        kids.sort(key=lambda n: first[n])
    return first, children, kind


def _is_block_list(fqn: str, children: dict[str, list[str]], kind: dict[str, str]) -> bool:
    """Numbered children, at least two, all of one class: a list of repeated blocks."""
    kids = children.get(fqn, [])
    if len(kids) < 2 or not all(re.fullmatch(r"\d+", k.rpartition(".")[2]) for k in kids):
        return False
    return len({kind.get(k, k) for k in kids}) == 1


def layer_units(traced: TracedModel) -> LayerUnits:
    """Split the model into the layers a by-layer tool would be given (see the module docstring).

    Example:
        >>> from zoo import build
        >>> from autopipe.planning.tracing import trace
        >>> model, args = build("unet", batch=1)
        >>> layer_units(trace(model, args)).names
        ['down.0', 'down.1', 'down.2', 'mid', 'up.0', 'up.1', 'up.2', 'head']
    """
    first, children, kind = _module_tree(traced)
    seg_start: dict[str, int] = {}
    for k, c in enumerate(traced.candidates, start=1):
        for name in (c.name, *c.aliases):
            seg_start[name] = k
    holds_list: dict[str, bool] = {}

    def has_list(fqn: str) -> bool:  # a block list at or below fqn, not inside a block
        if fqn not in holds_list:
            holds_list[fqn] = _is_block_list(fqn, children, kind) or any(
                has_list(c) for c in children.get(fqn, []) if not re.fullmatch(r"\d+", c.rpartition(".")[2]))
        return holds_list[fqn]

    emitted: list[tuple[str, str]] = []  # (module, the block list it belongs to or "")

    def expand(fqn: str) -> None:
        before_list = bool(fqn)  # inside an opened wrapper (GPT-2's transformer, Llama's model)
        pre_list = 0
        for child in children.get(fqn, []):
            if _is_block_list(child, children, kind):
                emitted.extend((b, child) for b in children[child])
                before_list = False
            elif has_list(child) and children.get(child):
                expand(child)
                before_list = False
            else:
                # The wrapper's own code joins what precedes its block list (GPT-2 adds its token and
                # position embeddings), so a user gives those modules as one embedding layer: "-".
                emitted.append((child, "-" if before_list and pre_list else ""))
                pre_list += before_list

    if _is_block_list("", children, kind):
        emitted.extend((b, "") for b in children[""])  # an nn.Sequential of blocks: they are the layers
    else:
        expand("")
    names: list[str] = []
    starts: list[int] = []
    owner: list[str] = []
    for fqn, lst in emitted:
        start = 0 if not starts else None if lst == "-" else seg_start.get(fqn)
        if start is None or (starts and start <= starts[-1]):
            continue  # no legal cut before it: it stays with the layer before
        names.append(fqn)
        starts.append(start)
        owner.append(lst)
    if not names:  # nothing ran inside a submodule: the whole model is one layer
        names, starts, owner = [traced.segments[0].name], [0], [""]
    lists: list[tuple[str, int, int]] = []
    for i, lst in enumerate(owner):
        if lst and lists and lists[-1][0] == lst and lists[-1][2] == i - 1:
            lists[-1] = (lst, lists[-1][1], i)
        elif lst:
            lists.append((lst, i, i))
    return LayerUnits(names=names, starts=starts, num_segments=traced.num_segments,
                      block_lists=[b for b in lists if b[2] > b[1]])


def pippy_node_params(traced: TracedModel) -> tuple[list[dict[str, int]], int, str]:
    """Per graph node, the parameters and buffers it reads (elements), as torchpippy 0.2.0 counts them.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.tracing import trace
        >>> per_node, total, problem = pippy_node_params(trace(*seed_transformer(vocab_size=50, num_layers=2)))
        >>> total > 0 and problem == ""
        True
    """
    ep = traced.exported
    sig = ep.graph_signature
    state_dict = ep.state_dict
    constants = getattr(ep, "constants", {}) or {}
    state_of: dict[str, str] = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    lifted = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    numel: dict[str, int] = {k: int(v.numel()) for k, v in state_dict.items()}
    numel.update({k: int(v.numel()) for k, v in constants.items() if hasattr(v, "numel")})
    problem = ""
    per_node: list[dict[str, int]] = []
    for node in traced.nodes:
        reads: dict[str, int] = {}
        for arg in node.all_input_nodes:
            fqn = state_of.get(arg.name) or lifted.get(arg.name)
            if fqn is None:
                continue
            if fqn not in state_dict and not problem:
                problem = fqn
            reads[fqn] = numel.get(fqn, 0)
        per_node.append(reads if node.op == "call_function" else {})
    # gm.parameters() + gm.buffers() of the module torchpippy traces: shared tensors once,
    # non-persistent buffers included.
    seen: set[int] = set()
    total = 0
    for name in [*sig.parameters, *sig.buffers]:
        t = state_dict.get(name, constants.get(name))
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += int(t.numel())
    return per_node, total, problem


def unit_param_counts(traced: TracedModel, units: LayerUnits) -> np.ndarray:
    """Trainable parameter elements per layer, as DeepSpeed 0.19.8 counts them for ``"parameters"``.

    Example:
        >>> import torch
        >>> from autopipe.planning.tracing import trace
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> traced = trace(model, (torch.randn(3, 4),))
        >>> unit_param_counts(traced, layer_units(traced)).tolist()
        [40.0, 0.0, 18.0]
    """
    state = traced.exported.state_dict
    edges = [*units.starts, units.num_segments]
    out = np.zeros(len(units.names))
    for u in range(len(units.names)):
        names = {f for seg in traced.segments[edges[u]:edges[u + 1]] for f in seg.param_names}
        out[u] = sum(state[f].numel() for f in names if f in state and getattr(state[f], "requires_grad", False))
    return out


def _from_bounds(name: str, units: LayerUnits, bounds: Sequence[int], tool: str) -> BaselineSplit:
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        return BaselineSplit(name, None, f"{tool} gives stages of {sizes} layers over this model's "
                                         f"{len(units.names)} layers: some stage would be empty")
    return BaselineSplit(name, units.segment_cuts(bounds))


def baseline_split(name: str, traced: TracedModel, costs: Sequence[SegmentCost], num_stages: int,
                   units: LayerUnits | None = None) -> BaselineSplit:
    """The split baseline ``name`` gives for ``num_stages`` stages, or no split and why.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.tracing import trace
        >>> from autopipe.planning.profile import profile_segments
        >>> traced = trace(*seed_transformer(vocab_size=50, num_layers=4, seq_len=8))
        >>> costs = profile_segments(traced, cost="flops", progress=False, device_flops=1e9)
        >>> split = baseline_split("deepspeed_uniform", traced, costs, 2)
        >>> [traced.segments[c].name for c in split.cuts]
        ['layers.2']
    """
    if name not in BASELINES:
        raise ValueError(f"name={name!r} is not a baseline; known: {list(BASELINES)}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be a positive integer")
    units = units if units is not None else layer_units(traced)
    n, p = len(units.names), num_stages
    if p == 1:
        return BaselineSplit(name, [])
    if name == "pippy_equal_size":
        return _pippy(traced, p)
    if n < p:
        return BaselineSplit(name, None, f"this model has {n} layers as the tool sees them, fewer than {p} stages")
    if name == "deepspeed_uniform":
        return _from_bounds(name, units, peers.deepspeed_partition_uniform(n, p), "DeepSpeed 0.19.8 'uniform'")
    if name == "deepspeed_parameters":
        weights = unit_param_counts(traced, units)
        return _from_bounds(name, units, peers.deepspeed_partition_balanced(weights, p),
                            "DeepSpeed 0.19.8 'parameters'")
    if name == "torchgpipe_time":
        times = units.unit_sums([c.fwd_s + c.bwd_s for c in costs])
        return _from_bounds(name, units, peers.torchgpipe_solve(list(times), p), "torchgpipe 0.0.7's solve")
    if name == "torchtitan_default":
        return _torchtitan(units, p)
    fwd_flops = units.unit_sums([c.flops / 3.0 for c in costs])  # the profile counts forward + backward (2x)
    if not fwd_flops.sum() > 0:
        return BaselineSplit(name, None, "the profile counted no FLOPs for this model")
    return _from_bounds(name, units, peers.flops_dp_partition(fwd_flops, p), "the FLOPs DP")


def _torchtitan(units: LayerUnits, p: int) -> BaselineSplit:
    name = "torchtitan_default"
    if len(units.block_lists) != 1:
        what = "no list of repeated blocks" if not units.block_lists else (
            f"{len(units.block_lists)} lists of blocks ({', '.join(b[0] for b in units.block_lists)})")
        return BaselineSplit(name, None, f"torchtitan 0.3.0's rule splits one list of repeated blocks; this model "
                                         f"has {what}")
    _, lo, hi = units.block_lists[0]
    try:
        counts = peers.torchtitan_stage_layers(p, hi - lo + 1)
    except ValueError as e:
        return BaselineSplit(name, None, str(e))
    bounds, block = [0], lo
    for c in counts[:-1]:
        block += c
        bounds.append(block)
    bounds.append(len(units.names))
    return _from_bounds(name, units, bounds, "torchtitan 0.3.0")


def _pippy(traced: TracedModel, p: int) -> BaselineSplit:
    name = "pippy_equal_size"
    per_node, total, problem = pippy_node_params(traced)
    if problem:
        return BaselineSplit(name, None, f"torchpippy 0.2.0 fails on {problem!r}, a buffer or constant absent from "
                                         "the state_dict it sizes tensors from")
    cuts = peers.pippy_equal_size_cuts(per_node, total, p)
    if len(cuts) < p - 1:
        return BaselineSplit(name, None, f"torchpippy 0.2.0 finds only {len(cuts) + 1} stages of equal size here")
    seg_of = {c.position: k for k, c in enumerate(traced.candidates, start=1)}
    out = []
    for i in cuts:
        if i not in seg_of:
            node = traced.nodes[i] if i < len(traced.nodes) else None
            stack = list((node.meta.get("nn_module_stack") or {}).values()) if node is not None else []
            where = stack[-1][0] if stack else "the model's top level"
            return BaselineSplit(name, None, f"torchpippy 0.2.0 cuts before graph node {node.name if node else i!r} "
                                             f"inside {where!r}, where the pipeline cannot split")
        out.append(seg_of[i])
    return BaselineSplit(name, out)


def evaluate_baselines(
    traced: TracedModel, costs: Sequence[SegmentCost], problem: PartitionProblem, units: LayerUnits | None = None
) -> dict[str, PartitionResult | str]:
    """Every baseline under the same problem: its costed split, or the reason it gives none.

    Example:
        >>> results = evaluate_baselines(traced, costs, problem)  # doctest: +SKIP
        >>> sorted(results) == sorted(BASELINES)  # doctest: +SKIP
        True
    """
    units = units if units is not None else layer_units(traced)
    out: dict[str, PartitionResult | str] = {}
    for name in BASELINES:
        split = baseline_split(name, traced, costs, problem.num_stages, units)
        out[name] = evaluate(problem, split.cuts) if split.cuts is not None else f"not applicable: {split.reason}"
    return out
