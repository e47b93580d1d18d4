"""Placement of a layout's ranks (autopipe.runtime.placement): tensor-parallel groups on consecutive
ranks of one node, a mesh given by the user checked against the plan."""

from __future__ import annotations

import socket

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import _placement_workers as workers
from _dist_utils import run_world
from autopipe.runtime.placement import MESH_DIMS, check_mesh, check_placement, place_rank


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A mesh of ranks 0..n-1 made without a process group (nothing communicates in these tests)."""
    n = 1
    for size in shape:
        n *= size
    return DeviceMesh("cpu", torch.arange(n).view(*shape), mesh_dim_names=names, _init_backend=False, _rank=0)


@pytest.mark.parametrize("degrees, world, per_node, message", [
    ({"pp": 2, "tp": 2}, 8, 8, "pp x dp x tp = 2 x 1 x 2 = 4 ranks, but the world has 8"),
    ({"pp": 2, "tp": 4}, 8, 2, "tp=4 does not divide the 2 ranks of a node"),
    ({"tp": 3}, 3, 4, "tp=3 does not divide the 4 ranks of a node"),
    ({"pp": 0}, 1, 1, "pp=0"),
    ({"ep": 2}, 2, 2, "degree 'ep' is not a mesh dimension"),
])
def test_bad_degrees_are_named_before_anything_is_communicated(degrees, world, per_node, message):
    with pytest.raises(ValueError, match=message):
        check_placement(degrees, world, per_node)


def test_a_users_mesh_is_checked_against_the_plan_naming_the_dimension():
    check_mesh(_mesh((2, 1, 2), MESH_DIMS), {"pp": 2, "tp": 2})
    check_mesh(_mesh((2, 2), ("pp", "tp")), {"pp": 2, "tp": 2})
    with pytest.raises(ValueError, match="the mesh's 'tp' dimension has 4 ranks, the plan's tp=2"):
        check_mesh(_mesh((4,), ("tp",)), {"tp": 2})
    with pytest.raises(ValueError, match="the mesh has no 'pp' dimension, the plan's pp=2"):
        check_mesh(_mesh((4,), ("tp",)), {"pp": 2, "tp": 2})
    with pytest.raises(ValueError, match="the mesh's 'dp' dimension has 2 ranks, the plan's dp=1"):
        check_mesh(_mesh((2, 2), ("pp", "dp")), {"pp": 2})
    with pytest.raises(ValueError, match="'tp' dimension must be its last"):
        check_mesh(_mesh((2, 2), ("tp", "pp")), {"pp": 2, "tp": 2})
    with pytest.raises(ValueError, match="dimension 'cp' is not one of"):
        check_mesh(_mesh((2,), ("cp",)), {})


def test_a_pipelines_mesh_that_disagrees_with_its_tensor_parallel_degree_is_refused_naming_why():
    args = dict(world_size=4, rank=0, device_type="cpu")
    with pytest.raises(ValueError, match="the mesh's 'tp' dimension has 2 ranks, the plan's tp=4"):
        place_rank(_mesh((2, 1, 2), MESH_DIMS), None, "fsdp", 4, **args)
    with pytest.raises(ValueError, match=r"tensor parallelism needs a mesh with the dimensions \['pp', 'dp', 'tp'\]"):
        place_rank(_mesh((2, 2), ("dp", "pp")), None, "fsdp", 2, **args)
    with pytest.raises(ValueError, match="the mesh holds 2 ranks but the world has 4"):
        place_rank(_mesh((1, 1, 2), MESH_DIMS), None, "fsdp", None, **args)


@pytest.mark.distributed
def test_tensor_parallel_groups_are_consecutive_ranks_of_one_node_and_each_rank_is_reported():
    per_rank = run_world(workers.mesh_run, 4, {"pp": 2, "tp": 2}, 2, timeout_s=120)
    first = per_rank[0]
    assert first["tp"] == [[0, 1], [2, 3]] and first["pp"] == [[0, 2], [1, 3]]
    assert [(r["rank"], r["pp"], r["tp"]) for r in first["nodes"]] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert {r["node"] for r in first["nodes"]} == {socket.gethostname()}
    assert all(r == first for r in per_rank)


@pytest.mark.distributed
def test_a_group_that_would_span_nodes_is_refused_on_every_rank():
    per_rank = run_world(workers.mesh_run, 4, {"pp": 2, "tp": 2}, 1, timeout_s=120)
    assert all("tp=2 does not divide the 1 ranks of a node" in r["refused"] for r in per_rank)


@pytest.mark.distributed
def test_a_mesh_built_again_after_its_groups_were_destroyed_uses_its_own_groups():
    # DTensor caches sharding decisions under meshes that compare equal; stale groups would be used.
    for outcomes in run_world(workers.rebuilt_run, 4, timeout_s=120):
        assert outcomes == ["64.0", "64.0"]
