"""The cost graph: segments as nodes, the tensors between them as edges, bytes on every cut.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.tracing import trace
    >>> from autopipe.planning.costgraph import build_cost_graph
    >>> model, args = seed_transformer(vocab_size=100, d_model=16, num_layers=2, batch=2, seq_len=8)
    >>> cg = build_cost_graph(trace(model, args))
    >>> k = cg.segment_index("layers.1")
    >>> cg.cut_fwd_bytes[k]  # the residual stream: 2 x 8 x 16 float32
    1024
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .costmodel import step_backward_s
from .tracing import TracedModel

@dataclass
class SegmentCost:
    """What one segment costs per micro-batch, measured or estimated (see ``autopipe.planning.profile``)."""

    fwd_s: float  # forward time
    bwd_s: float  # backward time (input and weight gradients)
    param_bytes: int  # parameters and buffers it owns (shared ones counted where first used)
    act_bytes: int  # tensors saved for backward, excluding parameters
    out_bytes: int  # bytes of the tensors it produces that later segments read
    flops: float = 0.0  # forward + backward floating point operations, when counted
    trainable_param_bytes: int = 0  # the part of param_bytes that gets gradients and optimizer state
    # Adding one micro-batch's weight gradients into the gradients accumulated so far: torch's
    # pipeline stages do it for every micro-batch after the first (an in-place add per
    # parameter), which a profile that takes the gradients with autograd.grad never pays.
    accum_s: float = 0.0
    # Peak bytes its backward allocates beyond act_bytes (the gradient arriving at its output,
    # those flowing back, the fresh weight gradients added into .grad, temporaries; autograd
    # frees saved tensors as it goes): what a stage needs on top of all it holds while it runs
    # a backward (autopipe.machine.working_set). bwd_input_peak_bytes: the same for the input
    # gradients alone, as in a stage's first backward of a step, whose weight gradients become
    # the .grad counted with the parameters.
    bwd_peak_bytes: int = 0
    bwd_input_peak_bytes: int = 0

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def step_bwd_s(self, n_microbatches: int) -> float:
        """Backward seconds per micro-batch inside a step of ``n_microbatches``: ``bwd_s`` plus
        the gradient accumulation that all but the first micro-batch pay, spread evenly.

        Example:
            >>> SegmentCost(fwd_s=1.0, bwd_s=2.0, param_bytes=0, act_bytes=0, out_bytes=0,
            ...             accum_s=0.5).step_bwd_s(4)
            2.375
        """
        return step_backward_s(self.bwd_s, self.accum_s, n_microbatches)


@dataclass(frozen=True)
class TensorEdge:
    """The tensors segment ``producer`` hands to the later segment ``consumer``, per micro-batch."""

    producer: int
    consumer: int
    bytes: int  # forward: the tensors themselves
    grad_bytes: int  # backward: the gradients of those that require grad
    tensors: tuple[str, ...]  # their names in the exported graph


@dataclass
class CostGraph:
    """Segments, the tensors between them, and the bytes crossing each candidate cut.

    Index ``k`` of the ``cut_*`` lists is the cut *before* segment ``k``; entries 0 and
    ``num_segments`` are the model's inputs and outputs, which no stage boundary sends.
    These lists and ``costs`` are what the planner reads; :attr:`graph` exports them.
    """

    segment_names: list[str]
    cut_fwd_bytes: list[int]
    cut_bwd_bytes: list[int]
    cut_tensors: list[list[str]]  # names of the graph values crossing each cut
    # Messages crossing each cut per micro-batch: torch's stages send every tensor on its own,
    # and a gradient back for every floating-point one (whether the model needs it or not).
    cut_fwd_messages: list[int] = field(default_factory=list)
    cut_bwd_messages: list[int] = field(default_factory=list)
    # (lo, hi, gradient bytes) for each stretch a tensor with a gradient crosses unread: made or
    # read in segment lo (-1: a model input), read next in segment hi. A stage lying inside the
    # stretch only relays the tensor, and passes its gradient back in the storage it received.
    relay_gaps: list[tuple[int, int, int]] = field(default_factory=list)
    edges: list[TensorEdge] = field(default_factory=list)
    segment_modules: list[list[str]] = field(default_factory=list)  # per segment, the modules it runs
    segment_num_nodes: list[int] = field(default_factory=list)  # per segment, its exported graph nodes
    costs: list[SegmentCost] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_segments(self) -> int:
        return len(self.segment_names)

    @property
    def graph(self) -> nx.DiGraph:
        """The segments and the tensors between them as a new ``networkx.DiGraph`` (an export).

        Node ``i`` is segment ``i`` (``name``, ``modules``, ``num_nodes``, and its costs once
        attached); edge ``(a, b)`` carries ``bytes``, ``grad_bytes`` and ``tensors``. Built on
        each access from the lists above, so it always agrees with them; changing it
        changes nothing the planner reads.

        Example:
            >>> nx.is_directed_acyclic_graph(cost_graph.graph)  # doctest: +SKIP
            True
        """
        g = nx.DiGraph()
        for i, name in enumerate(self.segment_names):
            g.add_node(i, name=name, modules=list(self.segment_modules[i]) if self.segment_modules else [],
                       num_nodes=self.segment_num_nodes[i] if self.segment_num_nodes else 0)
            if self.costs is not None:
                c = self.costs[i]
                g.nodes[i].update(fwd_s=c.fwd_s, bwd_s=c.bwd_s, accum_s=c.accum_s, param_bytes=c.param_bytes,
                                  act_bytes=c.act_bytes, out_bytes=c.out_bytes, flops=c.flops)
        for e in self.edges:
            g.add_edge(e.producer, e.consumer, bytes=e.bytes, grad_bytes=e.grad_bytes, tensors=list(e.tensors))
        return g

    def segment_index(self, name: str) -> int:
        """Index of the segment that starts at split point ``name`` (KeyError if none)."""
        try:
            return self.segment_names.index(name)
        except ValueError:
            raise KeyError(f"no segment starts at {name!r}") from None

    def torch_stage_order(self, split_points: list[str]) -> list[int]:
        """The order in which torch's ``pipeline()`` would call the stages of this split.

        ``torch.fx.passes.split_module`` sorts the partitions topologically, taking the last
        ready one first: a stage that needs nothing computed by the stage before it (a
        decoder's embedding after the encoder) is called first, and torch's stages, which
        treat stage ``k - 1`` as stage ``k``'s sender, then compute another function.
        autopipe's runtime keeps the split's order; a plan handed to torch's own
        ``pipeline()`` says when it would not.

        Example:
            >>> cg = CostGraph(["a", "b", "c"], [0] * 4, [0] * 4, [[]] * 4,
            ...                edges=[TensorEdge(0, 2, 4, 4, ("x",)), TensorEdge(1, 2, 4, 4, ("y",))])
            >>> cg.torch_stage_order(["b", "c"]), cg.torch_stage_order(["c"])
            ([1, 0, 2], [0, 1])
        """
        starts = sorted(self.segment_index(p) for p in split_points)
        stage_of = [bisect.bisect_right(starts, s) for s in range(self.num_segments)]
        n = len(starts) + 1
        needs: list[set[int]] = [set() for _ in range(n)]
        for e in self.edges:
            if stage_of[e.producer] != stage_of[e.consumer]:
                needs[stage_of[e.consumer]].add(stage_of[e.producer])
        # The graph's order lists each partition's dependents in stage order.
        ready, order = [k for k in range(n) if not needs[k]], []
        while ready:
            k = ready.pop()
            order.append(k)
            for j in range(k + 1, n):
                if k in needs[j]:
                    needs[j].discard(k)
                    if not needs[j]:
                        ready.append(j)
        return order

    def attach_costs(self, costs: list[SegmentCost]) -> "CostGraph":
        """Record per-segment costs (and so on the exported graph's nodes); returns self for chaining.

        Raises:
            ValueError: ``costs`` does not have one entry per segment.
        """
        if len(costs) != self.num_segments:
            raise ValueError(
                f"costs has {len(costs)} entries but the cost graph has {self.num_segments} segments"
            )
        self.costs = list(costs)
        return self


def tensor_bytes(value: Any, sizes: dict[str, int] | None = None, dtype: torch.dtype | None = None) -> int:
    """Bytes of every tensor inside ``value`` (tensors, fake tensors, nested tuples).

    A size that depends on data (a symbol such as ``u0``) counts as ``sizes`` gives it
    (:attr:`autopipe.planning.tracing.TracedModel.unbacked_sizes`); ``dtype``, where given,
    replaces each tensor's own element size.

    Example:
        >>> tensor_bytes((torch.ones(2, 3), torch.ones(4, dtype=torch.int8)))
        28
    """
    total = 0
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            total += numel(leaf, sizes) * (dtype.itemsize if dtype is not None else leaf.element_size())
    return total


def numel(tensor: torch.Tensor, sizes: dict[str, int] | None = None) -> int:
    """``tensor.numel()`` as an int, data-dependent sizes counted as ``sizes`` gives them."""
    n = tensor.numel()
    if isinstance(n, torch.SymInt):
        expr = n.node.expr
        known = {s: sizes[str(s)] for s in expr.free_symbols if sizes and str(s) in sizes}
        n = expr.xreplace(known)
        if n.free_symbols:
            raise ValueError(f"a traced tensor of shape {tuple(tensor.shape)} has a size no measurement or bound "
                             f"gives ({', '.join(sorted(map(str, n.free_symbols)))})")
    return int(n)


def tensor_count(value: Any) -> tuple[int, int]:
    """How many tensors ``value`` holds, and how many of them are floating point."""
    tensors = [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
    return len(tensors), sum(1 for t in tensors if t.is_floating_point() or t.is_complex())


def _is_float(value: Any) -> bool:
    leaves = [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]
    return bool(leaves) and any(x.is_floating_point() or x.is_complex() for x in leaves)


# Ops whose output never carries a gradient even if their input does.
_NO_GRAD_OPS = {"detach", "detach_", "argmax", "argmin", "lift_fresh_copy", "zeros_like", "ones_like",
                "empty_like", "full_like", "randn_like", "rand_like", "bernoulli", "eq", "ne", "lt",
                "le", "gt", "ge", "sort.values_stable"}


def requires_grad_map(traced: TracedModel) -> dict[fx.Node, bool]:
    """Which graph values would require grad in a training forward pass."""
    ep = traced.exported
    sig = ep.graph_signature
    param_of = dict(sig.inputs_to_parameters)
    params = dict(traced.graph_module.named_parameters())
    flat_inputs = tree_leaves((traced.example_args, traced.example_kwargs))
    user_inputs = [x for x in flat_inputs if isinstance(x, torch.Tensor)]
    user_names = list(sig.user_inputs)
    rg: dict[fx.Node, bool] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in param_of:
                p = params.get(param_of[node.name])
                rg[node] = bool(p is None or p.requires_grad)
            elif node.name in user_names:
                i = user_names.index(node.name)
                rg[node] = bool(i < len(user_inputs) and user_inputs[i].requires_grad)
            else:
                rg[node] = False  # buffers and constants
        elif node.op == "call_function":
            op_name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            upstream = any(rg.get(a, False) for a in node.all_input_nodes)
            rg[node] = upstream and op_name not in _NO_GRAD_OPS and _is_float(node.meta.get("val"))
        else:
            rg[node] = False
    return rg


def autocast_dtypes(traced: TracedModel, precision: str, device: torch.device) -> dict[str, torch.dtype]:
    """The dtype of each graph value under autocast in ``precision`` on ``device``, by node name.

    The traced graph runs once on fake tensors (nothing computed, nothing allocated). A
    graph that cannot run so (a model on the meta device) gives ``{}``: its values keep their
    traced dtypes.

    Example:
        >>> dtypes = autocast_dtypes(traced, "bf16", torch.device("cpu"))  # doctest: +SKIP
        >>> dtypes["linear"]  # doctest: +SKIP
        torch.bfloat16
    """
    import torch.fx._pytree as fx_pytree
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..machine.precision import mixed_precision_context

    found: dict[str, torch.dtype] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                found[n.name] = out.dtype
            return out

    gm = traced.graph_module
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        flat = fx_pytree.tree_flatten_spec((tuple(traced.example_args), dict(traced.example_kwargs or {})),
                                           gm._in_spec)
        with fake, mixed_precision_context(precision, device):
            Recorder(gm).run(*[fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat])
    except Exception:  # noqa: BLE001 - the traced dtypes stand where the graph cannot run on fake tensors
        return {}
    return found


def build_cost_graph(traced: TracedModel, costs: list[SegmentCost] | None = None,
                     dtypes: dict[str, torch.dtype] | None = None) -> CostGraph:
    """Build the cost graph of a traced model.

    Args:
        traced: The result of :func:`autopipe.planning.tracing.trace`.
        costs: Per-segment costs from :func:`autopipe.planning.profile.profile_segments`; may be
            attached later with :meth:`CostGraph.attach_costs`.
        dtypes: The dtype a value has where it differs from its traced one, by node name
            (:func:`autocast_dtypes`): the bytes crossing the cuts are counted in it.

    Returns:
        A :class:`CostGraph`; the planner reads its cut bytes and segment costs.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> from autopipe.planning.tracing import trace
        >>> model, args = seed_transformer(vocab_size=100, num_layers=2, seq_len=8)
        >>> cg = build_cost_graph(trace(model, args))
        >>> cg.num_segments == len(cg.graph.nodes)
        True
    """
    n = traced.num_segments
    seg_of: dict[fx.Node, int] = {}
    for seg in traced.segments:
        for node in traced.nodes[seg.start:seg.end]:
            seg_of[node] = seg.index
    sig = traced.exported.graph_signature
    user_inputs = set(sig.user_inputs)
    for node in traced.exported.graph.nodes:
        if node.op == "placeholder" and node.name in user_inputs:
            seg_of[node] = -1  # produced "before" the first segment
    requires_grad = requires_grad_map(traced)

    edges: dict[tuple[int, int], list[Any]] = {}  # (producer, consumer) -> [bytes, grad bytes, tensor names]
    fwd = [0] * (n + 1)
    bwd = [0] * (n + 1)
    crossing: list[list[str]] = [[] for _ in range(n + 1)]
    fwd_msgs, bwd_msgs = [0] * (n + 1), [0] * (n + 1)
    gaps: list[tuple[int, int, int]] = []

    for producer, src in seg_of.items():
        consumers = set()
        for user in producer.users:
            if user.op == "output":
                consumers.add(n)  # the model output leaves from the last stage
            elif user in seg_of:
                consumers.add(seg_of[user])
        consumers.discard(src)
        if not consumers:
            continue
        val = producer.meta.get("val")
        recast = dtypes and producer.name in dtypes and isinstance(val, torch.Tensor) and val.is_floating_point()
        nbytes = tensor_bytes(val, traced.unbacked_sizes, dtypes[producer.name] if recast else None)
        grad = nbytes if requires_grad.get(producer, False) else 0
        messages, float_messages = tensor_count(producer.meta.get("val"))
        last = max(consumers)
        if grad:
            points = sorted({src, *consumers})
            gaps += [(a, b, grad) for a, b in zip(points, points[1:]) if b - a >= 2]
        # The tensor is live across every cut between its producer and its last consumer.
        for k in range(max(src, 0) + 1, min(last, n - 1) + 1):
            fwd[k] += nbytes
            bwd[k] += grad
            fwd_msgs[k] += messages
            bwd_msgs[k] += float_messages
            crossing[k].append(producer.name)
        if src >= 0:
            for c in consumers:
                if c < n:
                    edge = edges.setdefault((src, c), [0, 0, []])
                    edge[0] += nbytes
                    edge[1] += grad
                    edge[2].append(producer.name)
    fwd[0] = fwd[n] = bwd[0] = bwd[n] = 0
    fwd_msgs[0] = fwd_msgs[n] = bwd_msgs[0] = bwd_msgs[n] = 0
    crossing[0], crossing[n] = [], []
    cg = CostGraph(
        segment_names=[s.name for s in traced.segments],
        cut_fwd_bytes=fwd,
        cut_bwd_bytes=bwd,
        cut_tensors=crossing,
        cut_fwd_messages=fwd_msgs,
        cut_bwd_messages=bwd_msgs,
        relay_gaps=gaps,
        edges=[TensorEdge(a, b, nbytes, grad, tuple(names)) for (a, b), (nbytes, grad, names) in edges.items()],
        segment_modules=[list(s.modules) for s in traced.segments],
        segment_num_nodes=[s.end - s.start for s in traced.segments],
        meta={"model_name": traced.model_name},
    )
    if costs is not None:
        cg.attach_costs(costs)
    return cg
