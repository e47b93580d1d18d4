"""Tensor-parallel stages: a traced stage's matrices, found by the planner's graph analysis,
sharded with torch's ``ColwiseParallel`` / ``RowwiseParallel`` (docs/design.md, "Tensor-parallel
stages")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..layouts.sharding import TensorParallelPlan

#: Ops that only view a matrix product's input or output.
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
#: Ops that split a fused projection's output into its parts.
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default)
#: Ops whose output a reshape cannot view without a copy when they are not the identity.
_STRIDING = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.expand.default)


def parallelize_stage(stage_module: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, *,
                      sequence_parallel: bool = False) -> dict[str, str]:
    """Shard the column/row matrices of ``stage_module`` (a traced stage, changed in place) over
    the one-dimensional ``tp_mesh`` with torch's styles, as ``plan`` (``find_tensor_parallel``
    of the model's trace) says; return ``{module name: "column" | "row"}``. Indivisible heads or
    features, nothing to shard, or a matrix's module running more than its one product raise
    ValueError first. With ``sequence_parallel``, what runs between a row matrix and the next column one (the
    residual adds, the norms) runs on sequence shards: rows reduce-scatter along dimension 1,
    columns all-gather their input, and the stage's outputs are gathered whole.

    Example:
        >>> parallelize_stage(nn.Linear(4, 4), type("M", (), {"size": lambda m: 2})(), TensorParallelPlan([]))
        Traceback (most recent call last):
        ValueError: tensor parallelism of degree 2 cannot shard this model: nothing to shard...
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    why = plan.why_not(tp)
    if why:
        raise ValueError(f"tensor parallelism of degree {tp} cannot shard this model: {why}")
    held = {name for name, _ in stage_module.named_parameters()}
    styles = {m.parameter.rpartition(".")[0]: m.shard for m in plan.sharded() if m.parameter in held}
    linears, matrices = {}, {}
    for name, shard in styles.items():
        module = stage_module.get_submodule(name)
        parts = _fused_parts(stage_module, name) if shard == "column" else 1
        linear = _as_linear(module)
        if linear is not None and parts == 1:
            linears[name] = linear
            continue
        if linear is None and not _stores_transposed(module):
            raise ValueError(f"{name} does not run one matrix product on its own weight in the traced stage "
                             "(an aten.linear, or an addmm/mm on a weight stored (in, out) as GPT-2's Conv1D "
                             "stores it); it cannot be sharded column- or row-wise")
        matrices[name] = _ShardedMatrix(module.weight, getattr(module, "bias", None), tp_mesh, shard=shard,
                                        transposed=linear is None, parts=parts, sequence_parallel=sequence_parallel)
    for name, replacement in {**linears, **matrices}.items():
        _put_module(stage_module, name, replacement)
    _copy_before_strided_reshapes(stage_module)
    # Stages traced again (another input length, eval mode) read the first stages' sharded
    # parameters: torch's styles leave those as they are, and the same objects are put back.
    already = {(name, p): param for name in linears for p, param in linears[name].named_parameters()
               if isinstance(param, DTensor)}
    # A column matrix's output stays sharded (a DTensor) through the ops up to its row matrix,
    # which all-reduces it into a plain tensor (reduce-scatters it, under sequence parallelism).
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else RowwiseParallel()
    parallelize_module(stage_module, tp_mesh, {
        name: ColwiseParallel(use_local_output=False) if styles[name] == "column" else row for name in linears})
    for (name, p), param in already.items():
        setattr(stage_module.get_submodule(name), p, param)
    for name, matrix in matrices.items():
        if matrix.parts > 1:
            _return_parts(stage_module, name)
    columns = {name for name, shard in styles.items() if shard == "column"}
    # Under sequence parallelism every column's input is gathered (from its sequence shards) first.
    _replicate_shared_inputs(stage_module, tp_mesh, columns, readers=1 if sequence_parallel else 2)
    if sequence_parallel:
        _replicate_other_parameters(stage_module, tp_mesh)
        _whole_boundaries(stage_module, tp_mesh)
        _drop_metadata_asserts(stage_module)
    return styles


@dataclass(frozen=True)
class StageSharding:
    """How tensor parallelism shards every trace of a rank's stages: over ``mesh`` (its ``tp``
    group), the matrices ``plan`` names, with or without sequence parallelism."""

    mesh: DeviceMesh
    plan: TensorParallelPlan
    sequence_parallel: bool = False


def shard_stages(modules: Mapping[int, nn.Module], sharding: StageSharding) -> None:
    """:func:`parallelize_stage` on each of this rank's stage modules (collective over the ``tp`` group)."""
    for module in modules.values():
        parallelize_stage(module, sharding.mesh, sharding.plan, sequence_parallel=sharding.sequence_parallel)


@torch.no_grad()
def sum_partial_gradients(params: Iterable[torch.Tensor]) -> None:
    """Sum over the ``tp`` group the gradients DTensor left partial: a replicated parameter that
    read sequence shards (a norm's weight under sequence parallelism) has a part of its
    gradient on each rank. One all-reduce each; the other gradients are left as they are."""
    from torch.distributed.tensor import Replicate

    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and any(q.is_partial() for q in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, [Replicate() if q.is_partial() else q for q in grad.placements])


def vocabulary_parallel(plan: TensorParallelPlan, model: nn.Module) -> TensorParallelPlan:
    """``plan`` with ``model``'s output layer sharded along the vocabulary too, its logits left
    sharded for a loss run under torch's ``loss_parallel`` (``DataParallelOptions(loss_parallel=True)``).

    Raises:
        ValueError: the export has no output layer to shard (no matrix whose output columns
            reach the model's output or its loss alone), or its weight is tied to another
            parameter (an input embedding, which stays whole).

    Example:
        >>> vocabulary_parallel(TensorParallelPlan([]), nn.Linear(2, 2))
        Traceback (most recent call last):
        ValueError: loss_parallel=True shards the model's output layer along the vocabulary, but...
    """
    heads = [m.parameter for m in plan.matmuls if m.shard == "vocab"]
    if not heads:
        raise ValueError("loss_parallel=True shards the model's output layer along the vocabulary, but its export "
                         "has none: no matrix whose output columns reach the model's output or its loss alone")
    params = dict(model.named_parameters(remove_duplicate=False))
    for head in heads:
        tied = [n for n, p in params.items() if n != head and p is params.get(head)]
        if tied:
            raise ValueError(f"loss_parallel=True cannot shard the output layer's {head}: it is tied to {tied[0]}, "
                             "which stays whole on every rank; untie them (tie_word_embeddings=False) or leave "
                             "loss_parallel off")
    return plan.with_output_sharded()


def counts_once(tensor: torch.Tensor, coords: Mapping[str, int]) -> bool:
    """Whether this rank's part of ``tensor`` adds to a sum over every rank, where ``coords`` is this
    rank's place along each parallel dimension (``{"dp": 1, "tp": 0}``): along a dimension that
    shards it every part counts, along one that replicates it only the first rank's.

    Example:
        >>> counts_once(torch.ones(2), {"dp": 0, "tp": 1})
        False
    """
    sharded: set[str] = set()
    if isinstance(tensor, DTensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        sharded = {names[d] for d, p in enumerate(tensor.placements) if names and not p.is_replicate()}
    return all(rank == 0 for dim, rank in coords.items() if dim not in sharded)


class CollectiveCount(TorchDispatchMode):
    """Counts, by name, the collectives DTensor issues while it is active (torch's functional
    ``_c10d_functional`` ops): what a tensor-parallel step communicates.

    Example::

        with CollectiveCount() as count:
            pipe.step(x, target=y)
        count.counts   # {'all_reduce': 64}
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name.startswith(("all_", "reduce_", "broadcast")):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tensor_parallel_context(device: torch.device, loss_parallel: bool = False) -> Iterator[None]:
    """Where tensor-parallel stages run forward and backward: whole tensors met by sharded ones are
    taken as replicated; on the CPU attention runs its math kernel (docs/design.md says why); with
    ``loss_parallel``, a cross-entropy of logits sharded along the vocabulary runs on the shards
    (torch's ``loss_parallel``), forward and backward.

    Example:
        >>> with tensor_parallel_context(torch.device("cpu")):
        ...     pass
    """
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel as sharded_loss
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        if loss_parallel:
            stack.enter_context(sharded_loss())
        if device.type == "cpu":
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        yield


def _as_linear(module: nn.Module) -> nn.Linear | None:
    """An ``nn.Linear`` over ``module``'s own parameters, where its graph is one ``aten.linear``."""
    if isinstance(module, nn.Linear):
        return module
    graph = getattr(module, "graph", None)
    if graph is None:
        return None
    calls = [n for n in graph.nodes if n.op == "call_function"]
    weight = getattr(module, "weight", None)
    if len(calls) != 1 or calls[0].target is not torch.ops.aten.linear.default or weight is None:
        return None
    bias = getattr(module, "bias", None)
    with torch.device("meta"):  # the parameters are the stage's own, swapped in below
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    return linear


def _stores_transposed(module: nn.Module) -> bool:
    """Whether ``module`` runs one addmm/mm on its own weight stored (in, out), views around it (GPT-2's Conv1D)."""
    if type(module).__name__ == "Conv1D":  # transformers' own, called eagerly
        return True
    graph = getattr(module, "graph", None)
    if graph is None or getattr(module, "weight", None) is None or module.weight.dim() != 2:
        return False
    products = [n for n in graph.nodes if n.op == "call_function" and n.target not in _VIEWS]
    if len(products) != 1 or products[0].target not in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
        return False
    node = products[0]
    with_bias = node.target is torch.ops.aten.addmm.default
    operands = {"weight": node.args[2 if with_bias else 1], **({"bias": node.args[0]} if with_bias else {})}
    return all(isinstance(a, torch.fx.Node) and a.op == "get_attr" and a.target == attr for attr, a in operands.items())


def _fused_parts(stage_module: nn.Module, name: str) -> int:
    """Into how many equal parts along its features the stage splits the output of column matrix ``name``
    and reads nothing else of it (q, k and v of one fused matrix: 3); 1 where it does not."""
    parent, graph, call = _call_of(stage_module, name)
    if call is None or len(call.users) != 1:
        return 1
    (split,) = call.users
    out = call.meta.get("val")
    if split.op != "call_function" or split.target not in _SPLITS or not isinstance(out, torch.Tensor):
        return 1
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    width, size = out.shape[-1], split.args[1]
    if not isinstance(dim, int) or dim % out.dim() != out.dim() - 1:
        return 1
    if split.target is torch.ops.aten.split_with_sizes.default:
        return len(size) if len(set(size)) == 1 and len(size) > 1 else 1
    if split.target is torch.ops.aten.chunk.default:
        return size if width % size == 0 else 1
    return width // size if width % size == 0 and width > size else 1


def _return_parts(stage_module: nn.Module, name: str) -> None:
    """Let the stage read the parts of fused matrix ``name`` from the tuple its :class:`_ShardedMatrix` returns."""
    parent, graph, call = _call_of(stage_module, name)
    (split,) = call.users
    split.replace_all_uses_with(call)
    graph.erase_node(split)
    _recompile(parent, graph)


def _parent_of(stage_module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding submodule ``name``, and ``name`` within it."""
    parent_name, _, leaf = name.rpartition(".")
    return (stage_module.get_submodule(parent_name) if parent_name else stage_module), leaf


def _call_of(stage_module: nn.Module, name: str) -> tuple[nn.Module, Any, torch.fx.Node | None]:
    """The module holding ``name``, its graph and the one node calling ``name`` (None unless exactly one)."""
    parent, leaf = _parent_of(stage_module, name)
    graph = getattr(parent, "graph", None)
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == leaf] if graph is not None else []
    return parent, graph, calls[0] if len(calls) == 1 else None


def _put_module(stage_module: nn.Module, name: str, module: nn.Module) -> None:
    parent, leaf = _parent_of(stage_module, name)
    for owner in _owners(parent, getattr(parent, "graph", None)):
        setattr(owner, leaf, module)


def _owners(module: nn.Module, graph: Any) -> list[nn.Module]:
    """``module`` and its graph's own GraphModule (an unflattened module's generated copy), which must hold its submodules too."""
    return list({id(m): m for m in (module, getattr(graph, "owning_module", None)) if m is not None}.values())


class _ShardedMatrix(nn.Module):
    """One weight matrix torch's styles do not shard: one stored (in, out), ``x @ weight + bias``
    (GPT-2's Conv1D), or a column matrix whose output the stage splits into equal parts (q, k and v
    in one). Each rank holds its slice of every part (torch's ``_StridedShard``, the placement FSDP2
    gives a tensor-parallel shard), so every part comes out sharded by head, as Megatron shards a
    fused projection. Columns return DTensors sharded along their features, rows a plain tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mesh: DeviceMesh, *, shard: str,
                 transposed: bool, parts: int, sequence_parallel: bool = False) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        super().__init__()
        self.mesh, self.shard, self.parts, self.sequence_parallel = mesh, shard, parts, sequence_parallel
        self.out_dim = 1 if transposed else 0  # the weight's dimension of output features
        if shard == "row":
            placements = (Shard(1 - self.out_dim), Replicate())  # the bias is added after the all-reduce
        elif parts > 1:
            # The bias stays whole: FSDP2 would shard a strided shard of it again along its only
            # dimension, which no placement describes; each rank slices its parts in the forward.
            placements = (_StridedShard(self.out_dim, split_factor=parts), Replicate())
        else:
            placements = (Shard(self.out_dim), Shard(0))
        self.weight = _distributed(weight, mesh, placements[0])
        self.register_parameter("bias", None if bias is None else _distributed(bias, mesh, placements[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        if self.shard == "row":
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, self.mesh, [Shard(-1)], run_check=False)
            y = torch.matmul(x, self._oriented(self.weight))
            if self.sequence_parallel:  # reduce-scattered along the sequence, left sharded
                y = y.redistribute(self.mesh, [Shard(1)])
                return y if self.bias is None else y + self.bias
            y = y.redistribute(self.mesh, [Replicate()]).to_local()
            return y if self.bias is None else y + self.bias.to_local()
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        weights = self.weight.to_local().chunk(self.parts, dim=self.out_dim)
        biases = [None] * self.parts
        if self.bias is not None:
            # Slicing is local; the backward all-gathers the bias's gradient.
            bias = self.bias.redistribute(self.mesh, [_StridedShard(0, split_factor=self.parts)]) if self.parts > 1 \
                else self.bias
            biases = bias.to_local().chunk(self.parts)
        outputs = []
        for w, b in zip(weights, biases):
            y = torch.matmul(x, self._oriented(DTensor.from_local(w, self.mesh, [Shard(self.out_dim)], run_check=False)))
            outputs.append(y if b is None else y + DTensor.from_local(b, self.mesh, [Shard(0)], run_check=False))
        return outputs[0] if self.parts == 1 else tuple(outputs)

    def _oriented(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as the (in, out) right-hand side of ``x @ weight``."""
        return weight if self.out_dim == 1 else weight.t()


def _distributed(tensor: torch.Tensor, mesh: DeviceMesh, placement: Any) -> nn.Parameter:
    """``tensor`` sharded over ``mesh``: a parameter sharded already (a stage traced again) is kept."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(tensor, DTensor):
        return tensor
    return nn.Parameter(distribute_tensor(tensor.detach(), mesh, [placement]), requires_grad=tensor.requires_grad)


class _Replicated(nn.Module):
    """A whole tensor as a replicated DTensor, made once for every column matrix that reads it."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Replicate

        if isinstance(x, DTensor):  # sequence shards, gathered
            return x.redistribute(self.mesh, [Replicate()])
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


def _replicate_shared_inputs(stage_module: nn.Module, tp_mesh: DeviceMesh, columns: set[str],
                             readers: int = 2) -> None:
    """Column matrices that read one tensor (q, k and v; gate and up) read one replicated DTensor of it,
    so the backward sums their input gradients before one all-reduce, not after one each: torch's
    ``ColwiseParallel`` would otherwise wrap the tensor once per matrix. Tensors read by fewer than
    ``readers`` columns are left to the columns."""
    for scope, module in stage_module.named_modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            full = f"{scope}.{node.target}" if scope else str(node.target)
            if node.op == "call_module" and full in columns and node.args and isinstance(node.args[0], torch.fx.Node):
                found.setdefault(node.args[0], []).append(node)
        shared = {source: nodes for source, nodes in found.items() if len(nodes) >= readers}
        for k, (source, nodes) in enumerate(shared.items()):
            name, replicate = f"autopipe_replicated_{k}", _Replicated(tp_mesh)
            for owner in _owners(module, graph):
                owner.add_module(name, replicate)
            with graph.inserting_after(source):
                replicated = graph.call_module(name, (source,))
            for node in nodes:
                node.replace_input_with(source, replicated)
        if shared:
            _recompile(module, graph)


def _replicate_other_parameters(stage_module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter tensor parallelism leaves whole becomes a replicated DTensor, so that where
    it meets sequence shards (a norm's weight) DTensor keeps its gradient as the partial sum it is
    (:func:`sum_partial_gradients` completes it); a plain tensor's would be one rank's part."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    replaced: dict[int, nn.Parameter] = {}
    for module in list(stage_module.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()],
                                                                     src_data_rank=None),
                                                   requires_grad=param.requires_grad)
            for owner in _owners(module, getattr(module, "graph", None)):
                setattr(owner, name, replaced[id(param)])


class _Whole(nn.Module):
    """A stage's output whole again: sequence shards gathered, a replicated DTensor its local
    tensor; logits sharded along the vocabulary (``loss_parallel``) stay as they are."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: Any) -> Any:
        from torch.distributed.tensor import Replicate

        if not isinstance(x, DTensor) or any(p.is_shard(x.ndim - 1) for p in x.placements):
            return x
        return x.redistribute(self.mesh, [Replicate()]).to_local()


def _whole_boundaries(stage_module: nn.Module, mesh: DeviceMesh) -> None:
    """The stage's floating-point inputs enter as replicated DTensors (:class:`_Replicated`), so the
    gradient sent back across the cut is gathered from the shards that used them (implicit
    replication would leave it unwritten), and every output leaves whole (:class:`_Whole`)."""
    graph = getattr(stage_module, "graph", None)
    if graph is None:
        return
    for owner in _owners(stage_module, graph):
        owner.add_module("autopipe_whole", _Whole(mesh))
        owner.add_module("autopipe_replicated_input", _Replicated(mesh))
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    for node in inputs:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.is_floating_point() and node.users:
            with graph.inserting_after(inputs[-1]):  # after every placeholder, as a graph must be
                replicated = graph.call_module("autopipe_replicated_input", (node,))
            replicated.meta = dict(node.meta)
            node.replace_all_uses_with(replicated, delete_user_cb=lambda user: user is not replicated)
    output = next(n for n in graph.nodes if n.op == "output")

    def whole(node: torch.fx.Node) -> torch.fx.Node:
        with graph.inserting_before(output):
            gathered = graph.call_module("autopipe_whole", (node,))
        gathered.meta = dict(node.meta)  # the same whole value (torch's stage reads its shape)
        return gathered

    output.args = torch.fx.node.map_arg(output.args, whole)
    _recompile(stage_module, graph)


def _drop_metadata_asserts(stage_module: nn.Module) -> None:
    """Remove the trace's dtype checks (``aten._assert_tensor_metadata``, what a ``.to(dtype)`` leaves):
    DTensor has no rule for them, and under sequence parallelism the tensors they check are DTensors."""
    for module in stage_module.modules():
        graph = getattr(module, "graph", None)
        checks = [n for n in graph.nodes if n.op == "call_function" and not n.users
                  and n.target is torch.ops.aten._assert_tensor_metadata.default] if graph is not None else []
        for node in checks:
            graph.erase_node(node)
        if checks:
            _recompile(module, graph)


def _recompile(module: nn.Module, graph: torch.fx.Graph) -> None:
    graph.lint()
    if hasattr(module, "finalize"):  # an unflattened InterpreterModule runs its own copy
        module.finalize()
    else:
        module.recompile()


def _copy_before_strided_reshapes(stage_module: nn.Module) -> None:
    """Give every reshape of a transposed, permuted or expanded tensor a contiguous input."""
    for module in stage_module.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.aten.reshape.default:
                continue
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "call_function" and source.target in _STRIDING:
                with graph.inserting_before(node):
                    copied = graph.call_function(torch.ops.aten.clone.default, (source,),
                                                 {"memory_format": torch.contiguous_format})
                node.replace_input_with(source, copied)
                changed = True
        if changed:
            _recompile(module, graph)
