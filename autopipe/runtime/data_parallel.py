"""Pipeline x data parallel: replicas of the same pipeline on a 2-D ``DeviceMesh``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from ..machine.precision import precision_dtype
from ..planning.schedules import schedule_spec
from .params import stage_state

#: How gradients are reduced over the ``dp`` dimension.
DP_MODES = ("fsdp", "replicate")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, ``t`` itself otherwise.

    Example:
        >>> local_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: a DTensor gathered (collective over its mesh), ``t`` itself otherwise.

    Example:
        >>> full_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    return t.full_tensor() if isinstance(t, DTensor) else t


def stored_form(t: Any) -> Any:
    """``t`` as a checkpoint holds it: a DTensor sharded strided (the parts of one fused matrix, each
    sliced) resharded into contiguous blocks, which ``torch.distributed.checkpoint`` can write
    (collective over its mesh); anything else as it is. :func:`placed_like` undoes it.

    Example:
        >>> stored_form(torch.ones(2)).shape
        torch.Size([2])
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor) or not any(isinstance(p, _StridedShard) for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements])


def placed_like(value: Any, like: Any) -> Any:
    """``value`` (read from a checkpoint) in the placements of ``like``, the live DTensor it is loaded into."""
    if isinstance(value, DTensor) and isinstance(like, DTensor) and tuple(value.placements) != tuple(like.placements):
        return value.redistribute(like.device_mesh, like.placements)
    return value


def _fsdp_placement(param: nn.Parameter) -> Any:
    """Where FSDP2 shards ``param``: its rows, or its columns where tensor parallelism sharded the rows
    strided (one fused matrix's q, k and v, each sliced): a second cut of those rows would be a layout
    no DTensor placement describes, and ``full_tensor`` and checkpoints would read it wrongly."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements)
    return Shard(1) if strided and param.dim() > 1 else None


def data_parallel_from_plan(plan: Any, mesh: Any, dp_degree: int | None,
                            dp_mode: str | None) -> tuple[int | None, str]:
    """``(dp_degree, dp_mode)`` to build with: the caller's, else the plan's, else a pure pipeline and ``"fsdp"``.

    Example:
        >>> from types import SimpleNamespace
        >>> data_parallel_from_plan(SimpleNamespace(dp_degree=4, dp_mode="replicate"), None, None, None)
        (4, 'replicate')
        >>> data_parallel_from_plan(None, None, None, None)
        (None, 'fsdp')
    """
    planned = plan is not None and getattr(plan, "dp_degree", 1) > 1
    if mesh is None and dp_degree is None and planned:
        dp_degree = plan.dp_degree
    if dp_mode is None:
        dp_mode = plan.dp_mode if planned and plan.dp_mode in DP_MODES else "fsdp"
    return dp_degree, dp_mode


def check_mesh_arguments(mesh: Any, dp_degree: Any, dp_mode: Any) -> None:
    """Check the mesh, degree and mode of ``Pipeline(data_parallel=)`` alone (no communication).

    Example:
        >>> check_mesh_arguments(None, 2, "fsdp")
        >>> check_mesh_arguments(None, 0, "fsdp")
        Traceback (most recent call last):
        ...
        ValueError: data_parallel degree=0 must be a positive integer (the number of data-parallel replicas)
    """
    if dp_mode not in DP_MODES:
        raise ValueError(f"data_parallel mode={dp_mode!r} is not one of {list(DP_MODES)}")
    if mesh is not None and dp_degree is not None:
        raise ValueError(f"give data_parallel a mesh or degree={dp_degree!r}, not both: the mesh already says how "
                         f"many data-parallel replicas there are")
    if dp_degree is not None and (isinstance(dp_degree, bool) or not isinstance(dp_degree, int) or dp_degree < 1):
        raise ValueError(f"data_parallel degree={dp_degree!r} must be a positive integer (the number of "
                         "data-parallel replicas)")
    if mesh is None:
        return
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if sorted(names) not in (["dp", "pp"], ["dp", "pp", "tp"]):
        raise ValueError(f"mesh must be 2-D with dimensions named 'dp' and 'pp' (e.g. init_device_mesh(device, "
                         f"(dp, pp), mesh_dim_names=('dp', 'pp'))), or 3-D with 'pp', 'dp' and 'tp' "
                         f"(autopipe.runtime.placement.layout_mesh); got {mesh.ndim}-D with names {names}")


@dataclass
class DataParallel:
    """Where this rank sits in the ``dp x pp`` (or ``pp x dp x tp``) mesh, and the reductions over ``dp``."""

    mesh: DeviceMesh
    mode: str
    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int
    replicas: list[list[int]]
    batch: str = "replica"  # what a call is given: its replica's rows, or the global batch

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, *, mode: str, batch: str = "replica") -> "DataParallel":
        """Read the coordinates of this rank from ``mesh`` (no communication)."""
        names = list(mesh.mesh_dim_names)
        # Every pipeline (one per coordinate of the other dimensions: dp, and tp where there is one) in pp order.
        return cls(mesh=mesh, mode=mode, dp_size=mesh.size(names.index("dp")), pp_size=mesh.size(names.index("pp")),
                   dp_rank=mesh.get_local_rank("dp"), pp_rank=mesh.get_local_rank("pp"),
                   replicas=groups_of(mesh, "pp"), batch=batch)

    @property
    def batch_replicas(self) -> int:
        """How many replicas' rows a call's batch holds: all of them for a global batch, else this one's."""
        return self.dp_size if self.batch == "global" else 1

    @property
    def pp_group(self) -> Any:
        """The process group of this rank's pipeline (its replica)."""
        return self.mesh.get_group("pp")

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's stage in every replica."""
        return self.mesh.get_group("dp")

    # ------------------------------------------------------------------ the batch
    def shard(self, value: Any, n_microbatches: int) -> Any:
        """This replica's rows of ``value``: all of them unless it is the global batch."""
        if self.batch != "global":
            return value
        parts = self.dp_size * n_microbatches
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] % parts:
                raise ValueError(
                    f"a global batch of {t.shape[0]} rows (shape {tuple(t.shape)}) does not split into dp="
                    f"{self.dp_size} replicas x n_microbatches={n_microbatches} micro-batches; give every rank "
                    f"the global batch, with a first dimension divisible by {parts}")

        def take(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            rows = t.shape[0] // self.dp_size
            return t.narrow(0, self.dp_rank * rows, rows)

        return tree_map(take, value)

    # ------------------------------------------------------------------ the stages
    @torch.no_grad()
    def synchronize(self, tensors: Iterable[torch.Tensor]) -> None:
        """Give every replica dp rank 0's values (parameters and buffers), as DDP does at its start."""
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return
        tensors = [local_tensor(t) for t in tensors]  # a tensor-parallel shard is the same in every replica
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
        dist.broadcast(flat, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()

    def shard_modules(self, modules: Mapping[int, nn.Module], stages: Sequence[Any],
                      mixed_precision: str | None = None) -> None:
        """FSDP2 ``fully_shard`` on every stage module over the ``dp`` sub-mesh (``"fsdp"`` only).

        With a mixed precision, gradients are reduced in float32 and, on a GPU, parameters
        gathered in its dtype (``MixedPrecisionPolicy``, torchtitan's setting for bf16
        training). On the CPU they are gathered in float32 and autocast casts them where it
        computes: the CPU kernels of layer and batch norm take float32 weights only.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if mixed_precision:
            gathered = precision_dtype(mixed_precision) if self.mesh.device_type != "cpu" else None
            policy = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32)
        dp_mesh = self.mesh["dp"]
        for stage in stages:
            module = modules[stage.stage_index]
            # Gathered once per step, not once per micro-batch (torchtitan's setting under pipelining).
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy,
                        shard_placement_fn=_fsdp_placement)
            stage.submod = module

    @torch.no_grad()
    def average_grads(self, params: Iterable[torch.Tensor]) -> None:
        """Average the gradients over the ``dp`` group, one all-reduce (``"replicate"`` only)."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def groups_of(mesh: DeviceMesh, dim: str) -> list[list[int]]:
    """The ranks of each group along ``dim`` (no communication).

    Example::

        groups_of(placement.layout_mesh({"pp": 2, "tp": 2}), "pp")   # [[0, 2], [1, 3]]
    """
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh.movedim(names.index(dim), -1)
    return [[int(r) for r in row] for row in grid.reshape(-1, grid.shape[-1]).tolist()]


def resolve_data_parallel(mesh: DeviceMesh | None, dp_degree: int | None, dp_mode: str, *, world_size: int,
                          device_type: str, batch: str = "replica") -> DataParallel | None:
    """The data-parallel layout, or None for a pure pipeline (creates the mesh's process groups)."""
    if mesh is None and dp_degree is None:
        return None
    if mesh is not None:
        if mesh.size() != world_size:
            raise ValueError(f"the mesh holds {mesh.size()} ranks (dp x pp = {tuple(mesh.mesh.shape)}) but the world "
                             f"has {world_size} processes; build the mesh over every rank")
    else:
        if world_size % dp_degree:
            raise ValueError(f"data_parallel degree={dp_degree} does not divide the world size {world_size}: pp x dp "
                             "must be the world size")
        if dp_degree == 1:
            return None
        mesh = init_device_mesh(device_type, (dp_degree, world_size // dp_degree), mesh_dim_names=("dp", "pp"))
    return DataParallel.from_mesh(mesh, mode=dp_mode, batch=batch)


def prepare_replicas(dp: DataParallel, built: Any, schedule: str, mixed_precision: str | None = None) -> None:
    """Make the replicas of this rank's stages equal, and shard them under ``"fsdp"`` (collective)."""
    if dp.mode == "fsdp":
        spec = schedule_spec(schedule)
        if spec.split_backward or spec.placement == "v":
            raise ValueError(f"data_parallel mode 'fsdp' runs schedules with one whole backward per stage and "
                             f"looped placement; schedule={schedule!r} is not one: use mode='replicate'")
        # Told at the first eval-mode call, where the eval-mode trace is taken (runtime.stages.EvalModules).
        built.eval.refusal = ("data_parallel mode 'fsdp' shards the training trace's modules, but this model computes "
                              "differently in eval mode (dropout, batch norm or a branch on training) and needs a "
                              "second trace that would not be sharded: run inference in train mode, or use "
                              "mode='replicate'")
    modules = list(built.train_modules.values())
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            seen.setdefault(id(t), t)
    dp.synchronize(seen.values())
    if dp.mode == "fsdp":
        dp.shard_modules(built.train_modules, built.train_stages, mixed_precision)
        state: dict[str, torch.Tensor] = {}
        for module in modules:
            for canon, (_, tensor) in stage_state(module, built.names).items():
                state.setdefault(canon, tensor)
        built.state = state
