"""The simulated timeline of a Plan: the Gantt chart every report draws.

A plan stores its stages' times, not the timeline, so reports rebuild it with the cost
model the planner used (:mod:`autopipe.planning.costmodel`): stage ``s`` runs ``fwd_s`` /
``bwd_s`` per micro-batch, and each cut delays each tensor by
:func:`~autopipe.planning.costmodel.cut_time_s` (:meth:`Plan.cut_comm_s
<autopipe.planning.plan.Plan.cut_comm_s>`). The result's ``step_s`` plus
``plan.step_tail_s()`` (the once-per-step work around the schedule's actions: the ranks'
agreement to start, merging outputs, the loss broadcast, tied gradients) is the plan's ``predicted_step_s``.

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

    :meth:`Plan.cut_comm_s <autopipe.planning.plan.Plan.cut_comm_s>`: bytes from the
    stages (activations sent forward) and the profile (gradients sent back), links from
    ``plan.machine`` or the defaults of the plan's device type.

    Args:
        plan: a :class:`~autopipe.planning.plan.Plan`.

    Returns:
        ``num_stages - 1`` seconds, cut ``c`` between stage ``c`` and stage ``c + 1``.

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

    Stage times are :func:`~autopipe.planning.costmodel.stage_times_s` of ``plan.segments``
    between the split points, cuts :meth:`Plan.cut_comm_s
    <autopipe.planning.plan.Plan.cut_comm_s>` of that split on the plan's links, as for
    the plan itself. Use it to draw the timeline of a hand split or a baseline.

    Args:
        plan: a plan that carries its per-segment profile (any plan from
            :func:`autopipe.partition`).
        split_points: segment names to cut before, in order, as many as the plan's cuts.

    Returns:
        The simulated :class:`~autopipe.planning.timeline.Timeline`.

    Raises:
        ValueError: the plan has no profile, or a split point is not a segment name, or
            the number of split points does not match the plan's stages.

    Example:
        >>> hand = split_timeline(plan, ["layers.2"])  # doctest: +SKIP
        >>> hand.step_s >= plan.predicted_step_s  # doctest: +SKIP
        True
    """
    from ..planning.costmodel import simulate_step, stage_times_s

    cuts = plan.segment_cuts(split_points)
    fwd, bwd = stage_times_s(plan.segments, cuts, plan.n_microbatches)
    return simulate_step(fwd, bwd, plan.cut_comm_s(split_points), **plan.simulation_options())
