"""autopipe: automatic pipeline parallelism for PyTorch.

Trace a model, measure what each piece costs, find the split points that make the
pipeline schedule fastest within each device's memory, explain the choice, and run the
stages on ``torch.distributed.pipelining``::

    import autopipe
    plan = autopipe.partition(model, n_gpus=4, example_args=(x_mb,))
    print(plan.report())
    pipe = torch.distributed.pipelining.pipeline(model, (x_mb,), split_spec=plan.split_spec)

To train, :class:`Pipeline` builds this rank's stage(s) from a plan and steps one of
torch's schedules (``pipe.step(x, target=y)``); launch with ``torchrun`` or
``autopipe run script.py --nproc N``.

The data flow (one module each): :mod:`autopipe.planning.trace` -> :mod:`autopipe.planning.profile` ->
:mod:`autopipe.planning.costgraph` -> :mod:`autopipe.planning.partitioner` -> :mod:`autopipe.planning.plan`, with
:mod:`autopipe.planning.schedules` for schedule timings and :mod:`autopipe.planning.baselines` for the splits
other tools would choose.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it. Loaded on first use (PEP 562), so that
# `import autopipe` and the command line start without importing torch.
_PUBLIC = {
    "partition": "planning.planner",
    "Pipeline": "runtime",
    "Plan": "planning.plan",
    "StagePlan": "planning.plan",
    "BaselinePlan": "planning.plan",
    "Device": "machine.device",
    "parse_bytes": "machine.device",
    "simulate": "planning.schedules",
    "Timeline": "planning.schedules",
    "SCHEDULES": "planning.schedules",
    "profile_scaling": "planning.scaling",
    "ScaledProfile": "planning.scaling",
    "measure_link": "machine.measure",
    "measure_devices": "machine.measure",
    "profile_in_ranks": "planning.rank_profile",
    "AutopipeError": "errors",
    "InfeasibleMemoryError": "errors",
    "MissingExampleInputsError": "errors",
    "ModelExportError": "errors",
    "PlanFileError": "errors",
    "PipelineStepError": "errors",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'autopipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if TYPE_CHECKING:  # for editors and type checkers: the same names, imported eagerly
    from .machine.device import Device, parse_bytes  # noqa: F401
    from .errors import (AutopipeError, InfeasibleMemoryError, MissingExampleInputsError, ModelExportError,  # noqa: F401
                         PlanFileError)
    from .machine.measure import measure_devices, measure_link  # noqa: F401
    from .planning.plan import BaselinePlan, Plan, StagePlan  # noqa: F401
    from .planning.rank_profile import profile_in_ranks  # noqa: F401
    from .planning.planner import partition  # noqa: F401
    from .runtime import Pipeline  # noqa: F401
    from .planning.scaling import ScaledProfile, profile_scaling  # noqa: F401
    from .planning.schedules import SCHEDULES, Timeline, simulate  # noqa: F401
