"""What each rank runs in the placement tests (spawned by tests/_dist_utils.run_world)."""

from __future__ import annotations

import os

from autopipe.runtime.placement import groups_of, layout_mesh, rank_nodes


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
