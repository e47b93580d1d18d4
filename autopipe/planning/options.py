"""Typed option groups for :func:`autopipe.partition` and :class:`autopipe.Pipeline`.

:func:`~autopipe.planning.planner.partition` takes the questions a user answers for every
model (how many devices, which schedule, how much memory) as keywords. Two groups of
settings that most users never touch live here instead:

- :class:`ProfileOptions`: how segments are measured (where, how often, with what care).
- :class:`PlannerOptions`: everything :class:`~autopipe.runtime.pipeline.Pipeline` forwards
  to the planner when it plans for itself; the same names as ``partition``'s keywords.

Example::

    plan = autopipe.partition(model, 4, (x,), profiling=ProfileOptions(repeats=10))
    pipe = autopipe.Pipeline(model, example_args=(x,), loss_fn=loss,
                             planner=PlannerOptions(memory="16GiB", cost="flops"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..machine.device import Device


@dataclass(frozen=True)
class ProfileOptions:
    """How :func:`~autopipe.planning.planner.partition` measures the model's segments.

    Args:
        device: Where to run the profile (``"cuda"``, ``"cpu"``, a ``torch.device``); None =
            where the model's parameters are.
        warmup: Untimed runs of each segment before timing (>= 0).
        repeats: Timed runs of each segment; the median is kept (>= 1).
        flush_cache: Evict the CPU caches before each timed run, as a pipeline stage finds
            them after its neighbours ran.
        fit_to_whole: Scale the segment times so that they add up to one timed run of the
            whole model; None = when the device is a CPU.
        progress: Show progress on stderr while tracing and profiling.

    Example::

        autopipe.partition(model, 4, (x,), profiling=ProfileOptions(warmup=0, repeats=1))
    """

    device: str | torch.device | None = None
    warmup: int = 2
    repeats: int = 5
    flush_cache: bool = True
    fit_to_whole: bool | None = None
    progress: bool = True


@dataclass(frozen=True)
class PlannerOptions:
    """What :class:`~autopipe.runtime.pipeline.Pipeline` passes on to the planner.

    Each field means what the :func:`~autopipe.planning.planner.partition` keyword of the
    same name means; None leaves partition's default.

    Example::

        autopipe.Pipeline(model, example_args=(x,), loss_fn=loss,
                          planner=PlannerOptions(memory="16GiB", objective="bottleneck"))
    """

    objective: str | None = None
    memory: int | str | Sequence[int | str] | None = None
    devices: Device | Sequence[Device] | None = None
    optimizer: str | type | None = None
    cost: Any = None
    global_batch: int | None = None
    example_target: Any = None
    profiling: ProfileOptions | None = None

    def partition_kwargs(self) -> dict[str, Any]:
        """The fields that are set, as keyword arguments for ``partition``."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if getattr(self, name) is not None}
