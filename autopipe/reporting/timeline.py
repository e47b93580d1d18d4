"""The simulated timeline of a Plan: the Gantt chart every report draws.

A plan stores its stages' times, not the timeline, so reports rebuild it with the same
simulator and the same numbers the planner used: stage ``s`` runs ``fwd_s`` / ``bwd_s``
per micro-batch, and cut ``c`` (between stages ``c`` and ``c + 1``) delays each tensor by
``max(activation bytes, gradient bytes) / bandwidth + latency``, one way. The result's
``step_s`` plus ``plan.step_tail_s()`` (the once-per-step work after the schedule's last
action: merging outputs, the loss broadcast, tied gradients) is the plan's ``predicted_step_s``.

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
    from ..planning.schedules import Timeline

__all__ = ["cut_comm_s", "plan_timeline", "split_timeline"]


def cut_comm_s(plan: "Plan") -> list[float]:
    """One-way transfer time of each cut of ``plan``, in seconds, as the planner charged it.

    Bytes come from the stages (activations sent forward) and, when the plan carries its
    profile, from ``plan.extras["segments"]`` (gradients sent backward); bandwidth and
    latency from ``plan.extras["links"]``, or torch-free defaults for the plan's device
    type (2 GB/s and 100 us on CPU, 10 GB/s and 20 us on CUDA) for plans without them.

    Args:
        plan: a :class:`~autopipe.planning.plan.Plan`.

    Returns:
        ``num_stages - 1`` seconds, cut ``c`` between stage ``c`` and stage ``c + 1``.

    Example:
        >>> cut_comm_s(plan) == [0.0]  # doctest: +SKIP
    """
    from ..machine.device import default_link

    segments = plan.extras.get("segments") or []
    links = plan.extras.get("links") or {}
    bandwidth = links.get("bandwidth") or []
    latency = links.get("latency_s") or []
    default_bw, default_lat = default_link(str(plan.device).split(":")[0])
    out = []
    for c in range(plan.num_stages - 1):
        fwd_bytes = plan.stages[c].send_bytes
        first = plan.stages[c + 1].first_segment
        bwd_bytes = segments[first]["cut_bwd_bytes"] if first < len(segments) else fwd_bytes
        nbytes = max(fwd_bytes, bwd_bytes)
        bw = bandwidth[c] if c < len(bandwidth) else default_bw
        lat = latency[c] if c < len(latency) else default_lat
        out.append(float(nbytes / bw + (lat if nbytes else 0.0)))
    return out


def plan_timeline(plan: "Plan") -> "Timeline":
    """Simulate one training step of ``plan`` under its schedule: the timeline reports draw.

    Args:
        plan: a :class:`~autopipe.planning.plan.Plan` (from :func:`autopipe.partition` or ``Plan.load``).

    Returns:
        A :class:`~autopipe.planning.schedules.Timeline`; ``to_chrome_trace()`` gives the Chrome trace,
        ``to_text()`` a text Gantt chart.

    Raises:
        ValueError: the plan's schedule, stage count and micro-batches do not go together
            (a hand-edited plan file).

    Example:
        >>> print(plan_timeline(plan).to_text())  # doctest: +SKIP
    """
    from ..planning.schedules import simulate

    return simulate(
        [s.fwd_s for s in plan.stages],
        [s.bwd_s for s in plan.stages],
        comm_s=cut_comm_s(plan) if plan.num_stages > 1 else 0.0,
        **plan.simulation_options(),
    )


def split_timeline(plan: "Plan", split_points: "list[str]") -> "Timeline":
    """Simulate ``plan``'s schedule with another split of the same profiled layers.

    Stage times are sums of ``plan.extras["segments"]`` between the split points; each cut
    costs ``max(activation, gradient bytes) / bandwidth + latency`` on the plan's links, as
    for the plan itself. Use it to draw the timeline of a hand split or a baseline.

    Args:
        plan: a plan that carries its per-segment profile (any plan from
            :func:`autopipe.partition`).
        split_points: segment names to cut before, in order, as many as the plan's cuts.

    Returns:
        The simulated :class:`~autopipe.planning.schedules.Timeline`.

    Raises:
        ValueError: the plan has no profile, or a split point is not a segment name, or
            the number of split points does not match the plan's stages.

    Example:
        >>> hand = split_timeline(plan, ["layers.2"])  # doctest: +SKIP
        >>> hand.step_s >= plan.predicted_step_s  # doctest: +SKIP
        True
    """
    from ..machine.device import default_link
    from ..planning.schedules import simulate

    segments = plan.extras.get("segments") or []
    if not segments:
        raise ValueError("plan has no per-segment profile (plan.extras['segments']); re-plan with autopipe.partition")
    names = [s["name"] for s in segments]
    unknown = [p for p in split_points if p not in names]
    if unknown or len(split_points) != plan.num_stages - 1:
        raise ValueError(
            f"split_points={list(split_points)!r} must be {plan.num_stages - 1} of the plan's segment names "
            f"({', '.join(names[1:6])}, ...); unknown: {unknown}"
        )
    edges = [0, *sorted(names.index(p) for p in split_points), len(segments)]
    costs = plan.segment_costs()  # backward with its gradient accumulation, as the plan's own stages
    fwd = [sum(c.fwd_s for c in costs[a:b]) for a, b in zip(edges, edges[1:])]
    bwd = [sum(c.step_bwd_s(plan.n_microbatches) for c in costs[a:b]) for a, b in zip(edges, edges[1:])]
    links = plan.extras.get("links") or {}
    default_bw, default_lat = default_link(str(plan.device).split(":")[0])
    bandwidth = links.get("bandwidth") or [default_bw] * len(split_points)
    latency = links.get("latency_s") or [default_lat] * len(split_points)
    comm = []
    for c, k in enumerate(edges[1:-1]):
        nbytes = max(segments[k]["cut_fwd_bytes"], segments[k]["cut_bwd_bytes"])
        comm.append(nbytes / bandwidth[c] + (latency[c] if nbytes else 0.0))
    return simulate(fwd, bwd, comm_s=comm if comm else 0.0, **plan.simulation_options())
