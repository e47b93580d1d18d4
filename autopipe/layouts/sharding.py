"""What tensor parallelism can shard, read from a traced graph.

Megatron-LM's rule, found in the graph rather than in a per-model table: a weight matrix
whose input is replicated (the residual stream, a norm of it) shards **column-wise**: each
rank computes a slice of its output features. Whatever is computed from such slices alone,
feature by feature (element-wise ops, reshapes that split the features into heads, rotary
embeddings, the attention core over whole heads, a gate times an up projection) stays
sliced. A weight matrix whose input is sliced along the features it reduces over shards
**row-wise**: each rank multiplies its slice, and one all-reduce (or reduce-scatter) makes
the output whole again. A column/row group is the unit sharded together: an attention, a
feed-forward.

:func:`find_tensor_parallel` walks a ``torch.export`` graph in order, tracking for every
tensor whether it is whole or sliced, along which dimension and by which group. A group is
refused, with the op named, where something mixes the sliced features (a norm over them, a
slice that cuts across them); its matrices then stay whole. A column matrix whose output
leaves the graph unreduced (the output layer) is sharded over its output features, the
vocabulary, with a parallel loss; an embedding table is sharded over its rows.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class MLP(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
    ...     def forward(self, x):
    ...         return x + self.down(torch.relu(self.up(x)))
    >>> ep = torch.export.export(MLP(), (torch.randn(2, 8),))
    >>> plan = find_tensor_parallel(ep)
    >>> {m.parameter: m.shard for m in plan.matmuls}
    {'up.weight': 'column', 'down.weight': 'row'}
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from .shapes import TransformerShape

# Ops that work feature by feature: a sliced input gives an output sliced the same way.
_ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "pow", "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "rsqrt", "sqrt",
    "dropout", "native_dropout", "to", "_to_copy", "type_as", "contiguous", "clone", "alias", "detach", "where",
    "masked_fill", "clamp", "abs", "erf", "log", "scalar_tensor", "_assert_tensor_metadata", "lift_fresh_copy",
}
_SHAPE = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "flatten", "unflatten"}
_LINEAR = {"linear", "addmm", "mm", "matmul"}
# Reductions over the vocabulary an output layer's loss may run sharded (a parallel cross-entropy).
_LOSS = {"_log_softmax", "log_softmax", "_softmax", "softmax", "cross_entropy_loss", "nll_loss_forward", "logsumexp"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention"}


@dataclass(frozen=True)
class ShardedMatmul:
    """A weight matrix and how tensor parallelism shards it."""

    parameter: str  # the parameter's name in the model
    out_features: int
    in_features: int
    shard: str  # "column", "row", "vocab" (the output layer), "embedding" (rows of a table) or "whole"
    group: int | None  # the attention or feed-forward it is sharded with; None when whole or alone


@dataclass
class TensorParallelPlan:
    """What :func:`find_tensor_parallel` found in a graph."""

    matmuls: list[ShardedMatmul]
    heads: dict[int, tuple[int, int]] = field(default_factory=dict)  # group -> (query heads, key-value heads)
    refused: dict[str, str] = field(default_factory=dict)  # parameter -> why it stays whole

    def sharded(self) -> list[ShardedMatmul]:
        return [m for m in self.matmuls if m.shard in ("column", "row")]

    def with_output_sharded(self) -> "TensorParallelPlan":
        """This plan with the output layer sharded column-wise as well: its logits split along the
        vocabulary, for a loss that reads them so (torch's ``loss_parallel``)."""
        return replace(self, matmuls=[replace(m, shard="column") if m.shard == "vocab" else m for m in self.matmuls])

    def why_not(self, tp: int) -> str | None:
        """None when every sharded dimension divides by ``tp``, else the first that does not."""
        if not self.sharded():
            reasons = "; ".join(f"{k}: {v}" for k, v in list(self.refused.items())[:3])
            return "nothing to shard: no column/row pair of weight matrices" + (f" ({reasons})" if reasons else "")
        for group, (q, kv) in sorted(self.heads.items()):
            for count, what in ((q, "attention heads"), (kv, "key-value heads")):
                if count % tp:
                    return f"{count} {what} (group {group}) do not divide by tp={tp}"
        for m in self.sharded():
            width = m.out_features if m.shard == "column" else m.in_features
            if width % tp:
                return f"{m.parameter}: {width} features do not divide by tp={tp}"
        return None


@dataclass(frozen=True)
class _Sliced:
    dim: int  # counted from the end (negative), so broadcasting keeps it
    groups: frozenset[int]


def _name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _map_view(before: tuple[int, ...], after: tuple[int, ...], dim: int) -> int | None:
    """Where a sliced dimension of ``before`` lands in ``after`` (a reshape): the output
    dimension that starts at the same element offset, or None when the slice is scattered."""
    d = len(before) + dim
    prefix = 1
    for s in before[:d]:
        prefix *= s
    acc = 1
    for i, s in enumerate(after):
        if acc == prefix and s != 1:  # dimensions of size 1 start at every offset: skip them
            return i - len(after)
        acc *= s
    return None


def _spans(shape: tuple[int, ...] | None, dim: int) -> bool:
    """Whether a tensor of ``shape`` has more than one element along ``dim`` (from the end)."""
    return shape is not None and len(shape) >= -dim and shape[dim] > 1


def _map_inserted(op: str, args: tuple, rank: int, dim: int) -> int:
    """Where a sliced dimension lands after ``expand`` (same place from the end), or after
    ``unsqueeze``/``squeeze`` inserts or removes a dimension to its right."""
    if op == "expand" or not args or not isinstance(args[0], int):
        return dim
    at = rank + dim  # the sliced dimension from the front
    if op == "unsqueeze":
        p = args[0] if args[0] >= 0 else rank + 1 + args[0]
        return dim - 1 if p > at else dim
    p = args[0] if args[0] >= 0 else rank + args[0]
    return dim + 1 if p > at else dim


def find_tensor_parallel(exported: Any) -> TensorParallelPlan:
    """Classify every weight matrix of ``exported`` (a ``torch.export.ExportedProgram``).

    Args:
        exported: the traced program, e.g. ``autopipe.planning.trace(model, args).exported``.

    Returns:
        A :class:`TensorParallelPlan`: each matrix's shard, the heads of each attention
        group (from its attention kernel's query and key shapes), and why any matrix stays
        whole.
    """
    walk = _Walk(dict(exported.graph_signature.inputs_to_parameters))
    for node in exported.graph.nodes:
        if node.op == "call_function":
            walk.visit(node)
    return walk.plan()


class _Walk:
    """One pass over a graph in execution order: which tensors are sliced, and by which group."""

    def __init__(self, params: dict[str, str]) -> None:
        self.params = params  # placeholder name -> parameter name
        self.state: dict[fx.Node, _Sliced] = {}
        self.rows: dict[int, list[str]] = {}  # group -> its row-parallel parameters
        self.broken: dict[int, str] = {}  # group -> why it cannot be sharded
        self.ended_at: dict[int, str] = {}  # group -> the op that ended it
        self.merged: dict[int, int] = {}  # group -> the group it joined (gate and up become one)
        self.heads: dict[int, tuple[int, int]] = {}
        self.found: dict[str, tuple[int, int, str, int | None]] = {}  # parameter -> (out, in, shard, group)
        self.groups = 0

    # ------------------------------------------------------------------ groups

    def root(self, g: int) -> int:
        while g in self.merged:
            g = self.merged[g]
        return g

    def join(self, groups: frozenset[int]) -> frozenset[int]:
        roots = sorted({self.root(g) for g in groups})
        for g in roots[1:]:
            self.merged[g] = roots[0]
        return frozenset(roots[:1])

    def end(self, groups: frozenset[int], op: str, why: str) -> None:
        for g in groups:
            self.broken.setdefault(self.root(g), why)
            self.ended_at.setdefault(self.root(g), op)

    # ------------------------------------------------------------------ ops

    def visit(self, node: fx.Node) -> None:
        op = _name(node)
        if op in _LINEAR:
            self.matmul(node, op)
            return
        if op == "embedding":
            pname = self.params.get(getattr(node.args[0], "name", None))
            if pname:
                rows, width = _shape(node.args[0]) or (0, 0)
                self.found.setdefault(pname, (rows, width, "embedding", None))
            return
        ins = [self.state[a] for a in node.all_input_nodes if a in self.state]
        if not ins:
            return  # nothing sliced reaches this op
        groups = self.join(frozenset().union(*(s.groups for s in ins)))
        dims = {s.dim for s in ins}
        if len(dims) > 1:
            self.end(groups, op, f"{node.name} ({op}) combines tensors sliced along different dimensions")
            return
        kept = self.follow(node, op, next(iter(dims)), groups)
        if isinstance(kept, str):
            self.end(groups, op, kept)
        else:
            self.state[node] = _Sliced(kept, groups)

    def matmul(self, node: fx.Node, op: str) -> None:
        """A weight matrix (column or row, by whether its input is sliced), or an activation
        product (the scores and weighted values of a hand-written attention)."""
        if op == "addmm":
            x, w = node.args[1], node.args[2]
            out_f, in_f = (_shape(w) or (0, 0))[::-1]
        else:
            x, w = node.args[0], node.args[1]
            ws = _shape(w) or (0, 0)
            out_f, in_f = (ws[0], ws[1]) if op == "linear" else (ws[1], ws[0])
        pname = self.params.get(getattr(w, "name", None))
        ins = [self.state[a] for a in node.all_input_nodes if a in self.state]
        if pname is None:
            if not ins:
                return
            groups = self.join(frozenset().union(*(s.groups for s in ins)))
            dims = {s.dim for s in ins}
            d = next(iter(dims))
            if _shape(node) is None or len(dims) > 1 or d >= -2:
                self.end(groups, op, f"{node.name} ({op}) multiplies across the sliced features")
                return
            self.state[node] = _Sliced(d, groups)  # a batch dimension: the heads
            a, b = (_shape(arg) for arg in node.args[:2])
            if a and b and len(ins) == 2:
                self.heads.setdefault(self.root(next(iter(groups))), (a[d], b[d]))
            return
        if x in self.state:
            s = self.state[x]
            if s.dim != -1:
                self.end(s.groups, op, f"{node.name}: a matrix reduces over a dimension other than the sliced one")
                self.found.setdefault(pname, (out_f, in_f, "whole", None))
                return
            g = self.root(next(iter(self.join(s.groups))))
            self.rows.setdefault(g, []).append(pname)
            self.found[pname] = (out_f, in_f, "row", g)
            return
        g, self.groups = self.groups, self.groups + 1
        self.found[pname] = (out_f, in_f, "column", g)
        self.state[node] = _Sliced(-1, frozenset({g}))

    def follow(self, node: fx.Node, op: str, dim: int, groups: frozenset[int]) -> int | str:
        """Where the sliced dimension is in ``node``'s output, or why the slices end here."""
        shape = _shape(node)
        if op in _ATTENTION:
            q, k = _shape(node.args[0]), _shape(node.args[1])
            if q and k and len(q) == 4 and dim == -3:
                self.heads[self.root(next(iter(groups)))] = (q[1], k[1])
                return -3
            return f"{node.name}: attention over sliced features that are not whole heads"
        if op in _ELEMENTWISE:
            whole = [a for a in node.all_input_nodes if a not in self.state and _spans(_shape(a), dim)]
            if whole:  # a residual add of the sliced output to the whole stream: it must be gathered first
                return f"{node.name} ({op}) combines the sliced features with the whole {whole[0].name}"
            return dim
        if op in _SHAPE:
            src = _shape(node.args[0])
            if op in ("expand", "unsqueeze", "squeeze") and src is not None:
                return _map_inserted(op, node.args[1:], len(src), dim)
            mapped = _map_view(src, shape, dim) if src and shape else None
            return f"{node.name} ({op}) scatters the sliced features" if mapped is None else mapped
        if op == "transpose" and shape:
            a, b = (d if d < 0 else d - len(shape) for d in node.args[1:3])
            return b if dim == a else a if dim == b else dim
        if op == "permute" and shape:
            order = [d if d < 0 else d - len(shape) for d in node.args[1]]
            return order.index(dim) - len(shape)
        if op in ("split", "split_with_sizes", "chunk") or node.target is operator.getitem:
            # A fused projection split into its parts (GPT-2's q, k, v): each part stays
            # sliced, the runtime slicing every part of the weight by itself.
            return dim
        if op in ("slice", "cat", "_softmax", "softmax", "mean", "sum"):
            axis = node.args[1] if len(node.args) > 1 else 0
            first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
            rank = len(_shape(first) or ())
            axes = axis if isinstance(axis, (list, tuple)) else [axis]
            if any((a if a < 0 else a - rank) == dim for a in axes if isinstance(a, int)):
                return f"{node.name} ({op}) works across the sliced features"
            return dim
        return f"{node.name} ({op}) is not known to keep the sliced features apart"

    # ------------------------------------------------------------------ result

    def plan(self) -> TensorParallelPlan:
        out = []
        refused: dict[str, str] = {}
        for pname, (out_f, in_f, shard, g) in self.found.items():
            r = self.root(g) if g is not None else None
            alone = shard == "column" and r is not None and r not in self.rows
            if alone and (self.ended_at.get(r) in _LOSS or r not in self.broken):
                shard, r = "vocab", None  # the output layer: left unreduced, or its loss vocabulary-parallel
            elif shard in ("column", "row") and r is not None and r in self.broken:
                refused[pname] = self.broken[r]
                shard, r = "whole", None
            out.append(ShardedMatmul(pname, out_f, in_f, shard, r))
        return TensorParallelPlan(out, self.head_counts(out), refused)

    def head_counts(self, matmuls: list[ShardedMatmul]) -> dict[int, tuple[int, int]]:
        """Query and key-value heads per attention group. The kernel may see keys already
        repeated for grouped-query attention, so the key-value heads are read off the
        projections: the narrowest column matrix, or what a fused q/k/v matrix holds beyond
        the queries, in units of a query head's width."""
        counts = {}
        for g, (q_heads, k_heads) in self.heads.items():
            r = self.root(g)
            widths = [m.out_features for m in matmuls if m.group == r and m.shard == "column"]
            if r in self.broken or not widths:
                continue
            if len(widths) > 1:  # separate projections: the query's is the widest
                head_dim = max(max(widths) // q_heads, 1)
                kv = min(widths) // head_dim
            else:  # one fused q/k/v matrix, as wide as the queries and twice the key-values
                head_dim = max(widths[0] // (q_heads + 2 * k_heads), 1)
                kv = (widths[0] // head_dim - q_heads) // 2
            counts[r] = (q_heads, min(k_heads, kv) if kv > 0 else k_heads)
        return counts


def shape_from_graph(exported: Any, *, seq_len: int, name: str = "") -> TransformerShape:
    """The :class:`~autopipe.layouts.shapes.TransformerShape` a traced decoder stack has.

    Read from :func:`find_tensor_parallel`'s groups: each attention group (it has heads)
    followed by a feed-forward group is one block; the blocks must be alike. The hidden size
    is the attention output's width, the feed-forward width the down projection's input, a
    block is Llama-like when its feed-forward has a gate (its column matrices hold twice the
    down projection's input) and GPT-like otherwise; the vocabulary is the output layer's.

    Raises:
        ValueError: no attention group, groups that do not alternate attention and
            feed-forward, blocks of different sizes, or no output layer.
    """
    plan = find_tensor_parallel(exported)
    by_group: dict[int, list[ShardedMatmul]] = {}
    for m in plan.matmuls:
        if m.group is not None:
            by_group.setdefault(m.group, []).append(m)
    order = sorted(by_group)
    blocks = []
    for i in range(0, len(order) - 1, 2):
        attn, ffn = order[i], order[i + 1]
        if attn not in plan.heads or ffn in plan.heads:
            raise ValueError("shape_from_graph: the traced groups do not alternate attention and feed-forward "
                             f"(group {attn} then {ffn}); give a TransformerShape by hand")
        row_a = next(m for m in by_group[attn] if m.shard == "row")
        row_f = next(m for m in by_group[ffn] if m.shard == "row")
        columns = sum(m.out_features for m in by_group[ffn] if m.shard == "column")
        blocks.append((row_a.out_features, *plan.heads[attn], row_f.in_features, columns == 2 * row_f.in_features))
    if not blocks or len(order) % 2:
        raise ValueError("shape_from_graph: no attention followed by a feed-forward was found"
                         + (f" ({'; '.join(f'{k}: {v}' for k, v in list(plan.refused.items())[:2])})"
                            if plan.refused else ""))
    if len(set(blocks)) > 1:
        raise ValueError(f"shape_from_graph: the {len(blocks)} blocks differ in size ({sorted(set(blocks))[:2]}); "
                         "layouts charge a stack of identical blocks")
    hidden, heads, kv_heads, ffn_width, gated = blocks[0]
    vocab = [m for m in plan.matmuls if m.shard == "vocab"]
    if not vocab:
        raise ValueError("shape_from_graph: no output layer (a matrix whose output leaves the graph unreduced)")
    tables = [m for m in plan.matmuls if m.shard == "embedding" and m.out_features == vocab[0].out_features]
    return TransformerShape(layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn_width,
                            vocab=vocab[0].out_features, seq_len=seq_len, kind="llama" if gated else "gpt",
                            tied=not tables, name=name)
