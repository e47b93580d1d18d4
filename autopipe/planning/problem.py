"""From a traced model and its cost graph to the partitioner's numbers, and the model's state.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> from autopipe.planning.costgraph import SegmentCost, build_cost_graph
    >>> from autopipe.machine.device import Device
    >>> model, args = seed_transformer(vocab_size=100, d_model=16, num_layers=2, seq_len=8)
    >>> traced = trace(model, args)
    >>> graph = build_cost_graph(traced, [SegmentCost(1e-3, 2e-3, 0, 0, 0)] * traced.num_segments)
    >>> problem = build_problem(graph, traced, num_stages=2, stage_devices=[Device(), Device()],
    ...                         inflight=[2, 1], optimizer_factor=2.0, link_default=(2e9, 1e-4))
    >>> problem.num_stages, problem.num_segments == traced.num_segments
    (2, True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..machine.device import Device
from . import schedules
from .costgraph import CostGraph, SegmentCost
from .costmodel import state_bytes, step_backward_s
from .partitioner import PartitionProblem
from .tracing import TracedModel

def merged_output_bytes(costs: Sequence[SegmentCost]) -> float:
    """Bytes of one micro-batch's output that a training step's last stage keeps to merge.

    Example:
        >>> merged_output_bytes([])
        0.0
    """
    if not costs or not schedules.training_merges_outputs():
        return 0.0
    return float(costs[-1].out_bytes)


def build_problem(
    cost_graph: CostGraph,
    traced: TracedModel,
    *,
    num_stages: int,
    stage_devices: Sequence[Device],
    inflight: Sequence[int],
    optimizer_factor: float,
    link_default: tuple[float, float],
    stages_per_rank: int = 1,
    n_microbatches: int = 0,
) -> PartitionProblem:
    """Turn the cost graph into the partitioner's numbers for ``num_stages`` stages.

    Example:
        >>> problem = build_problem(graph, traced, num_stages=2, stage_devices=[Device()] * 2,
        ...                         inflight=[2, 1], optimizer_factor=2.0, link_default=(2e9, 1e-4))  # doctest: +SKIP
    """
    costs = cost_graph.costs
    if costs is None:
        raise ValueError("the cost graph has no costs; profile it first (profile_segments)")
    sizes = state_sizes(traced)
    static = []
    for seg in traced.segments:
        b = 0.0
        for name in seg.param_names:  # every reader pays: torch replicates shared parameters
            nbytes, trainable = sizes.get(name, (0, False))
            b += state_bytes(nbytes, nbytes if trainable else 0, optimizer_factor)
        static.append(b)
    # On a torch whose training step returns its outputs, the last stage keeps every
    # micro-batch's output until the step ends (merged_output_bytes; zero otherwise).
    if static:
        static[-1] += n_microbatches * merged_output_bytes(costs)
    bw, lat = [], []
    for s in range(num_stages - 1):
        d = stage_devices[s]
        bw.append(d.bandwidth if d.bandwidth is not None else link_default[0])
        lat.append(d.latency_s if d.latency_s is not None else link_default[1])
    return PartitionProblem(
        compute_s=np.array([c.fwd_s + step_backward_s(c.bwd_s, c.accum_s, n_microbatches) for c in costs]),
        static_bytes=np.array(static),
        act_bytes=np.array([c.act_bytes for c in costs], dtype=float),
        cut_fwd_bytes=np.array(cost_graph.cut_fwd_bytes, dtype=float),
        cut_bwd_bytes=np.array(cost_graph.cut_bwd_bytes, dtype=float),
        num_stages=num_stages,
        speed=np.array([d.speed for d in stage_devices], dtype=float),
        bandwidth=np.array(bw, dtype=float),
        latency_s=np.array(lat, dtype=float),
        inflight=np.array(inflight, dtype=float),
        # A rank's memory is shared by its stages: each gets an equal part.
        capacity_bytes=np.array([d.memory_bytes / stages_per_rank for d in stage_devices], dtype=float),
        # What a stage that recomputes its activations pays again, and what the first one keeps then.
        fwd_s=np.array([c.fwd_s for c in costs], dtype=float),
        input_bytes=input_bytes(traced),
        cut_fwd_messages=np.array(cost_graph.cut_fwd_messages, dtype=float) if cost_graph.cut_fwd_messages else None,
        cut_bwd_messages=np.array(cost_graph.cut_bwd_messages, dtype=float) if cost_graph.cut_bwd_messages else None,
        relay_gaps=cost_graph.relay_gaps,
    )


def input_bytes(traced: TracedModel) -> float:
    """Bytes of one micro-batch of the model's tensor inputs (what a recomputing first stage keeps).

    Example:
        >>> input_bytes(traced)  # doctest: +SKIP
        64.0
    """
    leaves = torch.utils._pytree.tree_leaves((traced.example_args, traced.example_kwargs))
    return float(sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor)))


def state_sizes(traced: TracedModel) -> dict[str, tuple[int, bool]]:
    """FQN -> (bytes, trainable) of every parameter, buffer and constant of the traced model.

    Example:
        >>> state_sizes(traced)["layers.0.attn.in_proj_weight"]  # doctest: +SKIP
        (3072, True)
    """
    gm = traced.graph_module
    out: dict[str, tuple[int, bool]] = {}
    # remove_duplicate=False: a tied weight has one name per module using it (wte, lm_head),
    # and torch replicates it into every stage that reads it under either name.
    for name, p in gm.named_parameters(remove_duplicate=False):
        out[name] = (p.numel() * p.element_size(), p.requires_grad)
    for name, b in gm.named_buffers(remove_duplicate=False):
        out[name] = (b.numel() * b.element_size(), False)
    for name, c in traced.exported.constants.items():
        if isinstance(c, torch.Tensor):
            out[name] = (c.numel() * c.element_size(), False)
    return out


def state_tensors(traced: TracedModel) -> dict[int, tuple[set[str], int, bool]]:
    """Every parameter and buffer tensor, by identity: (its names, bytes, trainable).

    Example:
        >>> max(len(names) for names, _, _ in state_tensors(traced).values())  # doctest: +SKIP
        2
    """
    out: dict[int, tuple[set[str], int, bool]] = {}
    gm = traced.graph_module
    for named in (gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False)):
        for name, t in named:
            out.setdefault(id(t), (set(), t.numel() * t.element_size(), t.requires_grad))[0].add(name)
    return out


def tensor_reads(traced: TracedModel, tensors: Mapping[int, tuple[set[str], int, bool]],
                 cuts: Sequence[int], ranks: Sequence[int]) -> dict[int, dict[int, int]]:
    """Per tensor of ``tensors`` (by identity): rank -> how many of its segments read it.

    Example:
        >>> reads = tensor_reads(traced, state_tensors(traced), cuts=[3], ranks=[0, 1])  # doctest: +SKIP
    """
    tensor_of = {name: ident for ident, (names, _, _) in tensors.items() for name in names}
    edges = [0, *cuts, len(traced.segments)]
    reads: dict[int, dict[int, int]] = {}
    for s, r in enumerate(ranks):
        for seg in traced.segments[edges[s]:edges[s + 1]]:
            for ident in {tensor_of[n] for n in seg.param_names if n in tensor_of}:
                per_rank = reads.setdefault(ident, {})
                per_rank[r] = per_rank.get(r, 0) + 1
    return reads


def rank_overcount_bytes(traced: TracedModel, cuts: Sequence[int], ranks: Sequence[int],
                         optimizer_factor: float) -> list[float]:
    """Per rank, the static bytes the per-segment charge counts more than once.

    Example:
        >>> rank_overcount_bytes(traced, cuts=[3], ranks=[0, 1], optimizer_factor=2.0)  # doctest: +SKIP
        [0.0, 0.0]
    """
    tensors = state_tensors(traced)
    out = [0.0] * (max(ranks) + 1)
    for ident, per_rank in tensor_reads(traced, tensors, cuts, ranks).items():
        _, nbytes, trainable = tensors[ident]
        copy_bytes = state_bytes(nbytes, nbytes if trainable else 0, optimizer_factor)
        for r, k in per_rank.items():
            out[r] += (k - 1) * copy_bytes
    return out


def stage_grad_bytes(traced: TracedModel, cuts: Sequence[int], ranks: Sequence[int]) -> list[float]:
    """Per stage, the bytes of the weight gradients it makes: each trainable tensor once per rank.

    Example:
        >>> stage_grad_bytes(traced, cuts=[3], ranks=[0, 1])  # doctest: +SKIP
        [2048.0, 1024.0]
    """
    tensors = state_tensors(traced)
    tensor_of = {name: ident for ident, (names, _, _) in tensors.items() for name in names}
    edges = [0, *cuts, len(traced.segments)]
    owner: dict[tuple[int, int], int] = {}  # (tensor, rank) -> the last stage on that rank reading it
    for s, r in enumerate(ranks):
        for seg in traced.segments[edges[s]:edges[s + 1]]:
            for name in seg.param_names:
                if name in tensor_of and tensors[tensor_of[name]][2]:
                    owner[(tensor_of[name], r)] = s
    out = [0.0] * len(ranks)
    for (ident, _), s in owner.items():
        out[s] += tensors[ident][1]
    return out


def tied_gradient_bytes(traced: TracedModel, cuts: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, int]]:
    """``(bytes, ranks holding it)`` of every trainable tied parameter: the gradients summed once per step.

    Example:
        >>> tied_gradient_bytes(traced, cuts=[3], ranks=[0, 1])  # doctest: +SKIP
        [(262144, 2)]
    """
    tensors = state_tensors(traced)
    out = []
    for ident, per_rank in tensor_reads(traced, tensors, cuts, ranks).items():
        names, nbytes, trainable = tensors[ident]
        if trainable and len(names) > 1 and len(per_rank) > 1:
            out.append((nbytes, len(per_rank)))
    return out
