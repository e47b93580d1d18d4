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

The data flow (one module each): :mod:`autopipe.trace` -> :mod:`autopipe.profile` ->
:mod:`autopipe.costgraph` -> :mod:`autopipe.partitioner` -> :mod:`autopipe.plan`, with
:mod:`autopipe.simulate` for schedule timings and :mod:`autopipe.baselines` for the splits
other tools would choose.
"""

from .devices import Device, parse_bytes
from .errors import AutopipeError, InfeasibleMemoryError, MissingExampleInputsError, ModelExportError
from .plan import Plan, StagePlan, BaselinePlan
from .planner import partition
from .runtime import Pipeline
from .simulate import SCHEDULES, Timeline, simulate

__version__ = "0.1.0"

__all__ = [
    "partition",
    "Pipeline",
    "Plan",
    "StagePlan",
    "BaselinePlan",
    "Device",
    "parse_bytes",
    "simulate",
    "Timeline",
    "SCHEDULES",
    "AutopipeError",
    "InfeasibleMemoryError",
    "MissingExampleInputsError",
    "ModelExportError",
]
