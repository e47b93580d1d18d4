"""The simulated timeline of a Plan: the Gantt chart every report draws.

Example:
    >>> from autopipe.planning.plan import Plan, StagePlan
    >>> from autopipe.reporting.timeline import plan_timeline
    >>> stages = [StagePlan(index=i, fqns=[f"layers.{i}"], first_segment=i, last_segment=i,
    ...                     fwd_s=1.0, bwd_s=2.0, comm_s=0.0, param_bytes=0, act_bytes=0,
    ...                     peak_bytes=0, send_bytes=0, recv_bytes=0) for i in range(2)]
    >>> plan = Plan(num_stages=2, split_points=["layers.1"], stages=stages, schedule="1F1B",
    ...             n_microbatches=4, bottleneck_s=3.0, predicted_step_s=15.0, lower_bound_s=3.0)
    >>> plan_timeline(plan).step_s
    15.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..planning.plan import Plan
    from ..planning.timeline import Timeline

def cut_comm_s(plan: "Plan") -> list[float]:
    """One-way transfer time of each cut of ``plan``, in seconds, as the planner charged it.

    Example:
        >>> cut_comm_s(plan) == [0.0]  # doctest: +SKIP
    """
    return plan.cut_comm_s()


def plan_timeline(plan: "Plan") -> "Timeline":
    """Simulate one training step of ``plan`` under its schedule: the timeline reports draw.

    Args:
        plan: a :class:`~autopipe.planning.plan.Plan` (from :func:`autopipe.partition` or ``Plan.load``).

    Returns:
        A :class:`~autopipe.planning.timeline.Timeline`; ``to_chrome_trace()`` gives the Chrome trace,
        ``to_text()`` a text Gantt chart.

    Raises:
        ValueError: the plan's schedule, stage count and micro-batches do not go together
            (a hand-edited plan file).

    Example:
        >>> print(plan_timeline(plan).to_text())  # doctest: +SKIP
    """
    from ..planning.costmodel import simulate_step

    return simulate_step([s.fwd_s for s in plan.stages], [s.bwd_s for s in plan.stages], plan.cut_comm_s(),
                         **plan.simulation_options())


def split_timeline(plan: "Plan", split_points: "list[str]") -> "Timeline":
    """Simulate ``plan``'s schedule with another split of the same profiled layers.

    Example:
        >>> hand = split_timeline(plan, ["layers.2"])  # doctest: +SKIP
        >>> hand.step_s >= plan.predicted_step_s  # doctest: +SKIP
        True
    """
    from ..planning.costmodel import simulate_step, stage_times_s

    cuts = plan.segment_cuts(split_points)
    fwd, bwd = stage_times_s(plan.segments, cuts, plan.n_microbatches)
    return simulate_step(fwd, bwd, plan.cut_comm_s(split_points), **plan.simulation_options())
