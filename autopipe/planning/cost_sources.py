"""Where a segment's seconds come from: one object per cost source, asked by the profiler and the planner.

``partition`` and ``profile_segments`` take a source by name (``"measured"``, ``"flops"``,
``"params"``) or as one of these objects; everything downstream asks the object, so adding a
source is one class here.

Example:
    >>> cost_source("flops").measured, cost_source(MEASURED) is MEASURED
    (False, True)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .attention_count import FusedAttention
from .costgraph import SegmentCost


class CostSource:
    """One way to put seconds on a segment. ``measured``: timed on this host's device.

    A measured source's costs are this host's: the profile is timed in rounds beside the whole
    graph, the loss is timed, the ranks may profile together, and a link measured on this host
    may decide the split. An estimated source times nothing and counts attention as a GPU's
    fused kernel would run it.
    """

    name = ""
    measured = False

    def attention(self) -> AbstractContextManager[Any]:
        """How attention is counted while a segment runs for its FLOPs and saved bytes."""
        return nullcontext() if self.measured else FusedAttention()

    def estimate(self, costs: list[SegmentCost], device_flops: float) -> None:
        """Fill ``fwd_s`` / ``bwd_s`` of counted segments at ``device_flops`` FLOP/s (a measured source times them)."""

    def __repr__(self) -> str:
        return f"cost_source({self.name!r})"


class Measured(CostSource):
    """Forward and backward timed on the profiling device."""

    name = "measured"
    measured = True


class Flops(CostSource):
    """Seconds from the segment's FLOPs at the device's rate; backward twice the forward (two matmuls)."""

    name = "flops"

    def estimate(self, costs: list[SegmentCost], device_flops: float) -> None:
        _check_rate(device_flops)
        for c in costs:
            c.fwd_s = c.flops / 3.0 / device_flops
            c.bwd_s = 2.0 * c.flops / 3.0 / device_flops


class Params(CostSource):
    """The model's FLOPs shared out by parameter bytes: what a count of parameters per layer would split by."""

    name = "params"

    def estimate(self, costs: list[SegmentCost], device_flops: float) -> None:
        _check_rate(device_flops)
        total_s = sum(c.flops for c in costs) / device_flops
        total_bytes = sum(c.param_bytes for c in costs) or 1
        for c in costs:
            share = total_s * c.param_bytes / total_bytes
            c.fwd_s, c.bwd_s = share / 3.0, 2.0 * share / 3.0


def _check_rate(device_flops: float) -> None:
    if device_flops <= 0:
        raise ValueError(f"device_flops={device_flops!r} must be > 0 FLOP/s")


MEASURED, FLOPS, PARAMS = Measured(), Flops(), Params()
#: Every source by name (the names also in options.COST_SOURCE_NAMES, for the command line without torch).
COST_SOURCES: dict[str, CostSource] = {s.name: s for s in (MEASURED, FLOPS, PARAMS)}


def cost_source(value: str | CostSource) -> CostSource:
    """The source ``value`` names (or is); a ValueError lists the names for anything else."""
    if isinstance(value, CostSource):
        return value
    if isinstance(value, str) and value in COST_SOURCES:
        return COST_SOURCES[value]
    raise ValueError(f"cost={value!r} is not a cost source; use one of {list(COST_SOURCES)}")
