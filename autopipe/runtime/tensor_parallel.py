"""Tensor-parallel stages: a traced stage's matrices, found by the planner's graph analysis,
sharded with torch's ``ColwiseParallel`` / ``RowwiseParallel`` (docs/design.md, "Tensor-parallel
stages")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..layouts.sharding import TensorParallelPlan

#: Ops whose output a reshape cannot view without a copy when they are not the identity.
_STRIDING = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.expand.default)


def parallelize_stage(stage_module: nn.Module, tp_mesh: DeviceMesh,
                      plan: TensorParallelPlan) -> dict[str, str]:
    """Shard the column/row matrices of ``stage_module`` (a traced stage, changed in place) over
    the one-dimensional ``tp_mesh`` with torch's styles, as ``plan`` (``find_tensor_parallel``
    of the model's trace) says; return ``{module name: "column" | "row"}``. Indivisible heads or
    features, nothing to shard, or a matrix's module not a plain linear raise ValueError first.

    Example:
        >>> parallelize_stage(nn.Linear(4, 4), type("M", (), {"size": lambda m: 2})(), TensorParallelPlan([]))
        Traceback (most recent call last):
        ValueError: tensor parallelism of degree 2 cannot shard this model: nothing to shard...
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    why = plan.why_not(tp)
    if why:
        raise ValueError(f"tensor parallelism of degree {tp} cannot shard this model: {why}")
    held = {name for name, _ in stage_module.named_parameters()}
    styles = {m.parameter.rpartition(".")[0]: m.shard for m in plan.sharded() if m.parameter in held}
    linears = {}
    for name in styles:
        linear = _as_linear(stage_module.get_submodule(name))
        if linear is None:
            raise ValueError(f"{name} does not run a plain linear in the traced stage (one aten.linear on its own "
                             "weight; GPT-2's Conv1D is an addmm on a transposed weight); it cannot be sharded "
                             "column- or row-wise")
        linears[name] = linear
    for name, linear in linears.items():
        parent, _, leaf = name.rpartition(".")
        setattr(stage_module.get_submodule(parent) if parent else stage_module, leaf, linear)
    _copy_before_strided_reshapes(stage_module)
    # Stages traced again (another input length, eval mode) read the first stages' sharded
    # parameters: torch's styles leave those as they are, and the same objects are put back.
    already = {(name, p): param for name in styles for p, param in linears[name].named_parameters()
               if isinstance(param, DTensor)}
    # A column matrix's output stays sharded (a DTensor) through the ops up to its row matrix,
    # which all-reduces it into a plain tensor.
    parallelize_module(stage_module, tp_mesh, {
        name: ColwiseParallel(use_local_output=False) if shard == "column" else RowwiseParallel()
        for name, shard in styles.items()})
    for (name, p), param in already.items():
        setattr(stage_module.get_submodule(name), p, param)
    _replicate_shared_inputs(stage_module, tp_mesh, {name for name, shard in styles.items() if shard == "column"})
    return styles


def shard_stages(modules: Mapping[int, nn.Module], tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> None:
    """:func:`parallelize_stage` on each of this rank's stage modules (collective over ``tp_mesh``)."""
    for module in modules.values():
        parallelize_stage(module, tp_mesh, plan)


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
def tensor_parallel_context(device: torch.device) -> Iterator[None]:
    """Where tensor-parallel stages run forward and backward: whole tensors met by sharded ones are
    taken as replicated; on the CPU attention runs its math kernel (docs/design.md says why).

    Example:
        >>> with tensor_parallel_context(torch.device("cpu")):
        ...     pass
    """
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
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


class _Replicated(nn.Module):
    """A whole tensor as a replicated DTensor, made once for every column matrix that reads it."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Replicate

        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


def _replicate_shared_inputs(stage_module: nn.Module, tp_mesh: DeviceMesh, columns: set[str]) -> None:
    """Column matrices that read one tensor (q, k and v; gate and up) read one replicated DTensor of it,
    so the backward sums their input gradients before one all-reduce, not after one each: torch's
    ``ColwiseParallel`` would otherwise wrap the tensor once per matrix."""
    for scope, module in stage_module.named_modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            full = f"{scope}.{node.target}" if scope else str(node.target)
            if node.op == "call_module" and full in columns and node.args and isinstance(node.args[0], torch.fx.Node):
                readers.setdefault(node.args[0], []).append(node)
        shared = {source: nodes for source, nodes in readers.items() if len(nodes) > 1}
        for k, (source, nodes) in enumerate(shared.items()):
            name, replicate = f"autopipe_replicated_{k}", _Replicated(tp_mesh)
            # The graph's own GraphModule (an unflattened module's generated copy) must hold it too.
            for owner in {id(m): m for m in (module, graph.owning_module) if m is not None}.values():
                owner.add_module(name, replicate)
            with graph.inserting_after(source):
                replicated = graph.call_module(name, (source,))
            for node in nodes:
                node.replace_input_with(source, replicated)
        if shared:
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
