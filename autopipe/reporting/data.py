"""Everything a report shows, as plain JSON-ready data.

Example:
    >>> from autopipe.reporting.data import report_data
    >>> data = report_data(plan)  # doctest: +SKIP
    >>> data["summary"]["predicted_step_s"] == plan.predicted_step_s  # doctest: +SKIP
    True
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .recompute import recompute_lines

if TYPE_CHECKING:
    from ..planning.costgraph import SegmentCost
    from ..planning.plan import Plan
    from ..planning.timeline import Timeline
    from ..planning.tracing import TracedModel

#: Bumped when the layout of :func:`report_data` changes incompatibly.
REPORT_FORMAT_VERSION = 1

#: Orders ``autopipe profile`` can list layers in: graph order or a cost, largest first.
LAYER_SORT_KEYS = {
    "graph": None,
    "time": lambda r: r["fwd_s"] + r["bwd_s"],
    "fwd": lambda r: r["fwd_s"],
    "bwd": lambda r: r["bwd_s"],
    "params": lambda r: r["param_bytes"],
    "activations": lambda r: r["act_bytes"],
    "out": lambda r: r["out_bytes"],
}


def stage_ranks_of(plan: "Plan") -> list[int]:
    """The rank that runs each stage of ``plan`` (stage ``s`` -> ``ranks[s]``): ``plan.stage_ranks``."""
    return plan.stage_ranks


def _stage_capacity_bytes(plan: "Plan", rank: int) -> int | None:
    """Memory a stage may use: its rank's limit shared equally by the rank's stages."""
    limits = plan.memory_limit_bytes
    if not limits or rank >= len(limits) or limits[rank] < 0:
        return None
    return int(limits[rank] // plan.stages_per_rank)


def _layer_stage(plan: "Plan", segment_index: int) -> int | None:
    for s in plan.stages:
        if s.first_segment <= segment_index <= s.last_segment:
            return s.index
    return None


def report_data(
    plan: "Plan",
    *,
    timeline: "Timeline | None" = None,
    measured: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collect every number of a plan's report into one JSON-ready dictionary.

    Args:
        plan: a :class:`~autopipe.planning.plan.Plan`.

    Keyword Args:
        timeline: the plan's simulated timeline; built with
            :func:`~autopipe.reporting.timeline.plan_timeline` when omitted.
        measured: figures of a real run to show beside the predictions, e.g.
            ``{"step_s": [...], "median_step_s": ..., "losses": [...]}`` (the demo's).

    Returns:
        ``{"format_version", "summary", "stages", "baselines", "alternatives", "layers",
        "timeline", "measured", "plan"}``; ``"plan"`` is ``plan.to_dict()``, so
        ``Plan.from_dict(data["plan"])`` gives the plan back.

    Example:
        >>> import json
        >>> text = json.dumps(report_data(plan))  # doctest: +SKIP
    """
    from .timeline import cut_comm_s, plan_timeline

    if timeline is None:
        timeline = plan_timeline(plan)
    ranks = stage_ranks_of(plan)
    step = plan.predicted_step_s
    best_baseline = min((b for b in plan.baselines if b.fits_memory and not b.reason),
                        key=lambda b: b.predicted_step_s, default=None)
    summary = {
        "model": plan.model_name,
        "num_stages": plan.num_stages,
        "num_ranks": plan.num_stages // plan.stages_per_rank,
        "stages_per_rank": plan.stages_per_rank,
        "schedule": plan.schedule,
        "n_microbatches": plan.n_microbatches,
        "split_points": list(plan.split_points),
        "predicted_step_s": step,
        # Once-per-step work around the schedule's actions (not drawn in the timeline).
        "step_tail_s": asdict(plan.step_tail),
        "bottleneck_s": plan.bottleneck_s,
        "lower_bound_s": plan.lower_bound_s,
        "balance": plan.balance,
        "bubble_fraction": timeline.bubble_fraction,
        "cost_source": plan.cost_source,
        "device": plan.device,
        "optimizer": plan.optimizer,
        "planner_s": plan.planner_s,
        "planning_peak_rss_bytes": plan.planning_peak_rss_bytes,
        "whole_pass": asdict(plan.whole_pass) if plan.whole_pass is not None else None,
        "notes": list(plan.notes),  # what autopipe changed or assumed to make the plan
        "recompute_stages": list(plan.recompute_stages),
        "best_baseline": best_baseline.name if best_baseline else None,
        "speedup_over_best_baseline": (best_baseline.predicted_step_s / step) if best_baseline and step > 0 else None,
        "objective": plan.objective,
    }
    comm = cut_comm_s(plan)
    stages = []
    for s in plan.stages:
        # A recomputing stage's peak holds its inputs instead: the kept peak, where recorded, gives the static part.
        static = (s.peak_bytes_kept or s.peak_bytes) - s.inflight_microbatches * s.act_bytes
        stages.append({
            **asdict(s),
            "time_s": s.time_s,
            "rank": ranks[s.index],
            "static_bytes": int(max(0, static)),  # parameters, gradients, optimizer state
            "capacity_bytes": _stage_capacity_bytes(plan, ranks[s.index]),
            "cut_comm_s": comm[s.index] if s.index < len(comm) else None,
        })
    summary["recompute"] = recompute_lines(stages, plan.recompute_stages)
    baselines = [
        {**asdict(b), "slowdown": (b.predicted_step_s / step) if step > 0 and not b.reason else math.nan}
        for b in plan.baselines
    ]
    layers = []
    for i, seg in enumerate(plan.segments):
        layers.append({"index": i, **asdict(seg), "stage": _layer_stage(plan, i)})
    alternatives = [asdict(a) for a in plan.alternatives]
    return _json_safe({
        "format_version": REPORT_FORMAT_VERSION,
        "summary": summary,
        "stages": stages,
        "baselines": baselines,
        "alternatives": alternatives,
        "layers": layers,
        "timeline": timeline_data(timeline),
        "measured": measured,
        "plan": plan.to_dict(),
    })


def timeline_data(timeline: "Timeline") -> dict[str, Any]:
    """A simulated timeline as JSON-ready data (what the Gantt chart draws).

    Example:
        >>> from autopipe.planning.simulator import simulate
        >>> timeline_data(simulate([1.0], [2.0], schedule="GPipe", n_microbatches=1))["step_s"]
        3.0
    """
    return {
        "schedule": timeline.schedule,
        "n_microbatches": timeline.n_microbatches,
        "stage_ranks": list(timeline.stage_ranks),
        "step_s": timeline.step_s,
        "bubble_fraction": timeline.bubble_fraction,
        "busy_s": list(timeline.busy_s),
        "events": [asdict(e) for e in timeline.events],
    }


def layer_rows(traced: "TracedModel", costs: "list[SegmentCost]") -> list[dict[str, Any]]:
    """The per-layer profile: one row per segment, named by the split point it starts at.

    Args:
        traced: a :class:`~autopipe.planning.tracing.TracedModel`.
        costs: its profile, one :class:`~autopipe.planning.costgraph.SegmentCost` per segment.

    Returns:
        Rows with ``index``, ``name``, ``modules``, ``fwd_s``, ``bwd_s``, ``param_bytes``,
        ``act_bytes``, ``out_bytes``, ``flops``, in graph order (the layout of
        ``plan.segments``).

    Raises:
        ValueError: ``costs`` does not have one entry per segment.

    Example:
        >>> rows = layer_rows(traced, costs)  # doctest: +SKIP
    """
    if len(costs) != traced.num_segments:
        raise ValueError(f"costs has {len(costs)} entries; the traced model has {traced.num_segments} segments")
    return [
        {
            "index": seg.index, "name": seg.name, "modules": list(seg.modules),
            "fwd_s": c.fwd_s, "bwd_s": c.bwd_s, "param_bytes": c.param_bytes,
            "act_bytes": c.act_bytes, "out_bytes": c.out_bytes, "flops": c.flops,
        }
        for seg, c in zip(traced.segments, costs)
    ]


def sort_layer_rows(rows: list[dict[str, Any]], by: str = "graph") -> list[dict[str, Any]]:
    """``rows`` in graph order (``by="graph"``) or by a cost, largest first.

    Example:
        >>> sort_layer_rows([{"fwd_s": 1, "bwd_s": 0}, {"fwd_s": 2, "bwd_s": 0}], "time")[0]["fwd_s"]
        2
    """
    if by not in LAYER_SORT_KEYS:
        raise ValueError(f"sort={by!r} is not known; use one of {list(LAYER_SORT_KEYS)}")
    key = LAYER_SORT_KEYS[by]
    return list(rows) if key is None else sorted(rows, key=key, reverse=True)


def _json_safe(value: Any) -> Any:
    """Infinities and NaN as strings, since JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
