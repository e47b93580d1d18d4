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
from dataclasses import dataclass, field
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
    params = dict(exported.graph_signature.inputs_to_parameters)
    state: dict[fx.Node, _Sliced] = {}
    members: dict[int, list[str]] = {}  # group -> column parameters
    rows: dict[int, list[str]] = {}
    broken: dict[int, str] = {}
    ended_at: dict[int, str] = {}  # group -> the op that ended it
    merged: dict[int, int] = {}
    heads: dict[int, tuple[int, int]] = {}
    found: dict[str, tuple[int, int, str, int | None]] = {}

    def root(g: int) -> int:
        while g in merged:
            g = merged[g]
        return g

    def join(groups: frozenset[int]) -> frozenset[int]:
        roots = sorted({root(g) for g in groups})
        for g in roots[1:]:
            merged[g] = roots[0]
        return frozenset(roots[:1])

    def sliced_inputs(node: fx.Node) -> list[tuple[fx.Node, _Sliced]]:
        return [(a, state[a]) for a in node.all_input_nodes if a in state]

    def brk(groups: frozenset[int], why: str) -> None:  # ends ``groups`` at the op the loop is on
        for g in groups:
            broken.setdefault(root(g), why)
            ended_at.setdefault(root(g), op)

    next_group = 0
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        op = _name(node)
        ins = sliced_inputs(node)
        shape = _shape(node)
        if op in _LINEAR:
            if op == "addmm":
                x, w = node.args[1], node.args[2]
                out_f, in_f = (_shape(w) or (0, 0))[::-1]
            else:
                x, w = node.args[0], node.args[1]
                ws = _shape(w) or (0, 0)
                out_f, in_f = (ws[0], ws[1]) if op == "linear" else (ws[1], ws[0])
            pname = params.get(getattr(w, "name", None))
            if pname is None:  # activation times activation (manual attention scores)
                if ins:
                    groups = join(frozenset().union(*(s.groups for _, s in ins)))
                    dims = {s.dim for _, s in ins}
                    if shape is not None and len(dims) == 1 and next(iter(dims)) < -2:
                        d = next(iter(dims))  # a batch dimension: the heads of a hand-written attention
                        state[node] = _Sliced(d, groups)
                        a, b = (_shape(arg) for arg in node.args[:2])
                        if a and b and len(ins) == 2:
                            heads.setdefault(root(next(iter(groups))), (a[d], b[d]))
                    else:
                        brk(groups, f"{node.name} ({op}) multiplies across the sliced features")
                continue
            if x in state:
                s = state[x]
                if s.dim != -1:
                    brk(s.groups, f"{node.name}: a matrix reduces over a dimension other than the sliced one")
                    found.setdefault(pname, (out_f, in_f, "whole", None))
                    continue
                g = root(next(iter(join(s.groups))))
                rows.setdefault(g, []).append(pname)
                found[pname] = (out_f, in_f, "row", g)
            else:
                g = next_group
                next_group += 1
                members[g] = [pname]
                found[pname] = (out_f, in_f, "column", g)
                state[node] = _Sliced(-1, frozenset({g}))
            continue
        if op == "embedding":
            pname = params.get(getattr(node.args[0], "name", None))
            if pname:
                rows_, width = _shape(node.args[0]) or (0, 0)
                found.setdefault(pname, (rows_, width, "embedding", None))
            continue
        if not ins:
            continue
        groups = join(frozenset().union(*(s.groups for _, s in ins)))
        dims = {s.dim for _, s in ins}
        if len(dims) > 1:
            brk(groups, f"{node.name} ({op}) combines tensors sliced along different dimensions")
            continue
        dim = next(iter(dims))
        if op in _ATTENTION:
            q, k = _shape(node.args[0]), _shape(node.args[1])
            if q and k and len(q) == 4 and dim == -3:
                heads[root(next(iter(groups)))] = (q[1], k[1])
                state[node] = _Sliced(-3, groups)
            else:
                brk(groups, f"{node.name}: attention over sliced features that are not whole heads")
            continue
        if op in _ELEMENTWISE:
            whole = [a for a in node.all_input_nodes if a not in state and _spans(_shape(a), dim)]
            if whole:  # a residual add of the sliced output to the whole stream: it must be gathered first
                brk(groups, f"{node.name} ({op}) combines the sliced features with the whole {whole[0].name}")
            else:
                state[node] = _Sliced(dim, groups)
            continue
        if op in _SHAPE:
            src = _shape(node.args[0])
            if op in ("expand", "unsqueeze", "squeeze") and src is not None:
                state[node] = _Sliced(_map_inserted(op, node.args[1:], len(src), dim), groups)
                continue
            mapped = _map_view(src, shape, dim) if src and shape else None
            if mapped is None:
                brk(groups, f"{node.name} ({op}) scatters the sliced features")
            else:
                state[node] = _Sliced(mapped, groups)
            continue
        if op == "transpose" and shape:
            rank = len(shape)
            a, b = (d if d < 0 else d - rank for d in node.args[1:3])
            state[node] = _Sliced(b if dim == a else a if dim == b else dim, groups)
            continue
        if op == "permute" and shape:
            order = [d if d < 0 else d - len(shape) for d in node.args[1]]
            state[node] = _Sliced(order.index(dim) - len(shape), groups)
            continue
        if op in ("split", "split_with_sizes", "chunk", "slice", "cat", "_softmax", "softmax", "mean", "sum"):
            axis = node.args[1] if len(node.args) > 1 else 0
            axes = axis if isinstance(axis, (list, tuple)) else [axis]
            src = _shape(node.args[0] if not isinstance(node.args[0], (list, tuple)) else node.args[0][0])
            rank = len(src) if src else 0
            if op == "split" or op == "split_with_sizes" or op == "chunk":
                # A fused projection split into its parts (GPT-2's q, k, v): each part stays sliced,
                # the runtime slicing every part of the weight by itself.
                state[node] = _Sliced(dim, groups)
                continue
            if any((a if a < 0 else a - rank) == dim for a in axes if isinstance(a, int)):
                brk(groups, f"{node.name} ({op}) works across the sliced features")
            else:
                state[node] = _Sliced(dim, groups)
            continue
        if node.target is operator.getitem:
            state[node] = _Sliced(dim, groups)
            continue
        brk(groups, f"{node.name} ({op}) is not known to keep the sliced features apart")

    out = []
    refused: dict[str, str] = {}
    for pname, (out_f, in_f, shard, g) in found.items():
        r = root(g) if g is not None else None
        if shard == "column" and r is not None and r not in rows and ended_at.get(r) in _LOSS:
            shard, r = "vocab", None  # the output layer: its softmax or loss runs vocabulary-parallel
        elif shard == "column" and r is not None and r not in rows and r not in broken:
            shard, r = "vocab", None  # its output leaves the graph unreduced: the output layer
        elif shard in ("column", "row") and r is not None and r in broken:
            refused[pname] = broken[r]
            shard, r = "whole", None
        out.append(ShardedMatmul(pname, out_f, in_f, shard, r))
    groups_heads = {}
    for g, (q_heads, k_heads) in heads.items():
        r = root(g)
        if r in broken:
            continue
        # The kernel may see keys already repeated for grouped-query attention: the key-value
        # heads are read off the projections (the narrowest column matrix, or what a fused
        # q/k/v matrix holds beyond the queries), in units of the query heads' width.
        widths = [m.out_features for m in out if m.group == r and m.shard == "column"]
        head_dim = max(widths) // q_heads if len(widths) > 1 else widths[0] // (q_heads + 2 * k_heads) if widths else 0
        if len(widths) > 1:
            kv = min(widths) // max(head_dim, 1)
        else:
            kv = (widths[0] // max(head_dim, 1) - q_heads) // 2 if widths else k_heads
        groups_heads[r] = (q_heads, min(k_heads, kv) if kv > 0 else k_heads)
    return TensorParallelPlan(out, groups_heads, refused)


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
