"""Where each rank of a tp × pp × dp layout runs. The layout planner orders ranks tensor-parallel
first, then data-parallel, then pipeline (:mod:`autopipe.layouts.step`); ``torchrun`` numbers ranks
node by node, so a ``(pp, dp, tp)`` mesh keeps each tensor-parallel group on one node."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._checks import check_int
from .compat import forget_cached_sharding
from .data_parallel import DataParallel, groups_of, resolve_data_parallel

#: The mesh's dimensions, outermost first: the layout planner's rank order, reversed.
MESH_DIMS = ("pp", "dp", "tp")


def check_placement(degrees: dict[str, int], world_size: int, ranks_per_node: int) -> None:
    """Refuse degrees (``{"pp": p, "dp": d, "tp": t}``, 1 where left out) that do not make up
    ``world_size``, or a tensor-parallel group that would span nodes of ``ranks_per_node``.

    Example:
        >>> check_placement({"pp": 2, "tp": 4}, 8, 2)
        Traceback (most recent call last):
        ValueError: tp=4 does not divide the 2 ranks of a node (LOCAL_WORLD_SIZE): ...
    """
    for dim, degree in degrees.items():
        if dim not in MESH_DIMS:
            raise ValueError(f"degree {dim!r} is not a mesh dimension; use {list(MESH_DIMS)}")
        check_int(dim, degree)
    pp, dp, tp = (degrees.get(dim, 1) for dim in MESH_DIMS)
    if pp * dp * tp != world_size:
        raise ValueError(f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp} ranks, but the world has {world_size}")
    if ranks_per_node % tp:
        raise ValueError(f"tp={tp} does not divide the {ranks_per_node} ranks of a node (LOCAL_WORLD_SIZE): each "
                         "tensor-parallel group must lie inside one node")


def layout_mesh(degrees: dict[str, int], device_type: str = "cpu") -> DeviceMesh:
    """The ``(pp, dp, tp)`` mesh of ``degrees`` on this world, checked first (collective).

    Example::

        mesh = layout_mesh({"pp": 2, "tp": 2})   # on 4 ranks: tp groups [0, 1] and [2, 3]
    """
    world = dist.get_world_size()
    check_placement(degrees, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return init_device_mesh(device_type, tuple(degrees.get(dim, 1) for dim in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def check_mesh(mesh: DeviceMesh, degrees: dict[str, int]) -> None:
    """Refuse a user's mesh that is not the plan's, naming the dimension that differs.

    Example::

        check_mesh(mesh, {"pp": 2, "tp": 2})   # ValueError: the mesh's 'tp' dimension has 4 ranks, ...
    """
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [name for name in names if name not in MESH_DIMS]
    if unknown:
        raise ValueError(f"the mesh's dimension {unknown[0]!r} is not one of {list(MESH_DIMS)}")
    for dim in MESH_DIMS:
        wanted = degrees.get(dim, 1)
        if dim not in names:
            if wanted != 1:
                raise ValueError(f"the mesh has no {dim!r} dimension, the plan's {dim}={wanted}")
        elif mesh.size(names.index(dim)) != wanted:
            raise ValueError(f"the mesh's {dim!r} dimension has {mesh.size(names.index(dim))} ranks, the plan's "
                             f"{dim}={wanted}")
    if "tp" in names and names[-1] != "tp":
        raise ValueError(f"the mesh's 'tp' dimension must be its last (innermost), so that each tensor-parallel "
                         f"group is consecutive ranks on one node; its dimensions are {names}")


def rank_nodes(mesh: DeviceMesh) -> list[dict[str, Any]]:
    """Every rank's ``{"rank", "node", "pp", "dp", "tp"}``, in rank order (collective), for the report.

    Example::

        rank_nodes(layout_mesh({"tp": 2}))[1]   # {'rank': 1, 'node': 'host0', 'pp': 0, 'dp': 0, 'tp': 1}
    """
    names = tuple(mesh.mesh_dim_names or ())
    mine = {"rank": dist.get_rank(), "node": socket.gethostname(),
            **{dim: mesh.get_local_rank(dim) if dim in names else 0 for dim in MESH_DIMS}}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted(everyone, key=lambda r: r["rank"])


@dataclass
class RankPlace:
    """Where this rank runs: its place in its pipeline, its replica, its tensor-parallel group."""

    pp_rank: int
    pp_size: int
    pp_group: Any  # None: the whole world is one pipeline
    pipelines: list[list[int]] | None  # every pipeline's ranks in pp order; None: the world's
    dp: DataParallel | None
    tp_mesh: DeviceMesh | None
    mesh: DeviceMesh | None = None  # the whole (pp, dp, tp) mesh under tensor parallelism

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    @property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank() if self.tp_mesh is not None else 0


def tensor_parallel_size(mesh: DeviceMesh | None, tp_degree: int | None) -> int:
    """The tensor-parallel degree a Pipeline is asked for: ``tp_degree``, else the size of ``mesh``'s
    ``tp`` dimension, else 1 (no communication).

    Example:
        >>> tensor_parallel_size(None, None), tensor_parallel_size(None, 2)
        (1, 2)
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return tp_degree or (mesh.size(names.index("tp")) if "tp" in names else 1)


def place_rank(mesh: DeviceMesh | None, dp_degree: int | None, dp_mode: str, tp_degree: int | None, *,
               world_size: int, rank: int, device_type: str, batch: str = "replica") -> RankPlace:
    """This rank's :class:`RankPlace` under ``Pipeline(data_parallel=DataParallelOptions(degree=, mesh=,
    tensor_parallel=))`` (creates the mesh's process groups). Without tensor parallelism the ``(dp, pp)`` mesh of
    :mod:`~autopipe.runtime.data_parallel`; with it, the ``(pp, dp, tp)`` mesh of :func:`layout_mesh`,
    or the user's, checked against the degrees."""
    given_tp = mesh is not None and "tp" in (mesh.mesh_dim_names or ())
    if not given_tp and (tp_degree or 1) == 1:
        dp = resolve_data_parallel(mesh, dp_degree, dp_mode, world_size=world_size, device_type=device_type,
                                   batch=batch)
        if dp is None:
            return RankPlace(rank, world_size, None, None, None, None)
        return RankPlace(dp.pp_rank, dp.pp_size, dp.pp_group, dp.replicas, dp, None)
    if mesh is None:
        dp_size, tp = dp_degree or 1, tp_degree
        if world_size % (dp_size * tp):
            raise ValueError(f"tensor_parallel={tp} x data_parallel={dp_size} does not divide the world size "
                             f"{world_size}: pp x dp x tp must be the world size")
        mesh = layout_mesh({"pp": world_size // (dp_size * tp), "dp": dp_size, "tp": tp}, device_type)
    else:
        names = list(mesh.mesh_dim_names)
        if mesh.size() != world_size:
            raise ValueError(f"the mesh holds {mesh.size()} ranks but the world has {world_size} processes; build "
                             "the mesh over every rank")
        if sorted(names) != sorted(MESH_DIMS):
            raise ValueError(f"tensor parallelism needs a mesh with the dimensions {list(MESH_DIMS)} (or none: the "
                             f"pipeline builds it from the degrees); got {names}")
        degrees = {dim: mesh.size(names.index(dim)) for dim in names}
        if tp_degree is not None:
            degrees["tp"] = tp_degree
        check_mesh(mesh, degrees)
    forget_cached_sharding()
    dp = DataParallel.from_mesh(mesh, mode=dp_mode, batch=batch) if mesh["dp"].size() > 1 else None
    return RankPlace(mesh.get_local_rank("pp"), mesh["pp"].size(), mesh["pp"].get_group(), groups_of(mesh, "pp"),
                     dp, mesh["tp"], mesh)
