"""What each rank runs in the placement tests (spawned by tests/_dist_utils.run_world)."""

from __future__ import annotations

import os

from autopipe.runtime.data_parallel import groups_of
from autopipe.runtime.placement import layout_mesh, rank_nodes


def mesh_run(rank: int, world_size: int, degrees: dict, ranks_per_node: int) -> dict:
    """The groups and the placement report of a layout's mesh, on ``ranks_per_node`` ranks a node."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    try:
        mesh = layout_mesh(degrees)
    except ValueError as e:
        return {"refused": str(e)}
    finally:
        if before is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before
    return {"tp": groups_of(mesh, "tp"), "pp": groups_of(mesh, "pp"), "dp": groups_of(mesh, "dp"),
            "nodes": rank_nodes(mesh)}


def rebuilt_run(rank: int, world_size: int) -> list[str]:
    """A sharded matmul on a tensor-parallel mesh, twice: the second mesh, built by ``place_rank`` after
    the first one's groups were destroyed, equals the first (same ranks, same names)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.tensor import Shard, distribute_tensor

    from autopipe.runtime.placement import place_rank

    before = set(c10d._world.pg_map)
    outcomes = []
    for _ in range(2):
        place = place_rank(None, None, "fsdp", 2, world_size=world_size, rank=rank, device_type="cpu")
        t = distribute_tensor(torch.ones(4, 4), place.tp_mesh, [Shard(0)])
        try:
            outcomes.append(str((t @ t).full_tensor().sum().item()))
        except RuntimeError as e:
            outcomes.append(str(e))
        for group in [g for g in list(c10d._world.pg_map) if g not in before]:
            dist.destroy_process_group(group)
    return outcomes
