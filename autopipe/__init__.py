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

The packages follow the data flow, each importing only those before it:
:mod:`autopipe.machine` (the devices and links, and measuring them) ->
:mod:`autopipe.planning` (trace, profile, cost graph, partitioner, schedule simulator,
the :class:`Plan`) -> :mod:`autopipe.layouts` (tp x pp x dp layouts at scale, charged and
searched) -> :mod:`autopipe.reporting` (text, tables, charts of a plan) ->
:mod:`autopipe.runtime` (the stages running under torch) -> :mod:`autopipe.models`
(example and third-party models) -> :mod:`autopipe.cli` (the ``autopipe`` command).
The top level holds the entry points below; everything else is imported from its module
(``from autopipe.planning.plan import StagePlan``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

# Public name -> the module that defines it. Loaded on first use (PEP 562), so that
# `import autopipe` and the command line start without importing torch.
_PUBLIC = {
    "partition": "planning.planner",
    "Pipeline": "runtime",
    "tune": "runtime.tuning",
    "Plan": "planning.plan",
    "Device": "machine.device",
    "ProfileOptions": "planning.options",
    "PlannerOptions": "planning.options",
    "DataParallelOptions": "planning.options",
    "simulate": "planning.simulator",
    "profile_scaling": "planning.scaling",
    "measure_link": "machine.link",
    "AutopipeError": "errors",
    "InfeasibleMemoryError": "errors",
    "PipelineStepError": "errors",
}

__all__ = list(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)

if TYPE_CHECKING:  # for editors and type checkers: the same names, imported eagerly
    from .errors import AutopipeError, InfeasibleMemoryError, PipelineStepError  # noqa: F401
    from .machine.device import Device  # noqa: F401
    from .machine.link import measure_link  # noqa: F401
    from .planning.options import DataParallelOptions, PlannerOptions, ProfileOptions  # noqa: F401
    from .planning.plan import Plan  # noqa: F401
    from .planning.planner import partition  # noqa: F401
    from .planning.scaling import profile_scaling  # noqa: F401
    from .planning.simulator import simulate  # noqa: F401
    from .runtime import Pipeline  # noqa: F401
    from .runtime.tuning import tune  # noqa: F401
