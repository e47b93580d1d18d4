"""Code run on each rank by tests/test_frameworks.py: a plan's boundaries handed to DeepSpeed's PipelineModule."""

from __future__ import annotations

import torch
import torch.nn as nn

import autopipe


def uneven_layers() -> list[nn.Module]:
    """Eight layers whose widths differ, so that an equal count of layers per stage is not the plan."""
    widths = [16, 256, 256, 16, 16, 16, 16, 16, 16]
    return [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]


def deepspeed_stages(rank: int, world_size: int) -> dict:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    layers = uneven_layers()
    plan = autopipe.partition(nn.Sequential(*layers), world_size, (torch.randn(4, 16),),
                              planner=autopipe.PlannerOptions(target="deepspeed", cost="flops",
                                                              profiling=autopipe.ProfileOptions(progress=False)))
    parts = plan.to_deepspeed(num_layers=len(layers))["parts"]

    class Planned(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:  # DeepSpeed's hook for the boundaries
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    deepspeed.init_distributed(dist_backend="gloo")
    module = Planned(layers=layers, num_stages=world_size)
    held = {id(p) for p in module.parameters()}
    local = [k for k, layer in enumerate(layers) if any(id(p) in held for p in layer.parameters())]
    return {"parts": parts, "split": plan.split_points, "local": local,
            "stage_fqns": [s.fqns for s in plan.stages]}
