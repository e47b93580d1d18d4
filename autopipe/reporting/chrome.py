"""Chrome trace JSON (chrome://tracing, https://ui.perfetto.dev) of simulated and measured steps.

Example:
    >>> import json
    >>> from autopipe.reporting.chrome import simulated_trace
    >>> json.dump(simulated_trace(plan), open("trace.json", "w"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planning.plan import Plan
    from ..planning.timeline import Timeline

def simulated_trace(plan: "Plan", *, timeline: "Timeline | None" = None) -> dict[str, Any]:
    """The simulated step of ``plan`` as a Chrome trace: one track (thread) per rank.

    Example:
        >>> trace = simulated_trace(plan)  # doctest: +SKIP
        >>> {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}  # doctest: +SKIP
        {0, 1}
    """
    from .timeline import plan_timeline

    timeline = timeline or plan_timeline(plan)
    trace = timeline.to_chrome_trace()
    trace["otherData"] = {
        "source": "autopipe simulation",
        "model": plan.model_name,
        "schedule": plan.schedule,
        "n_microbatches": plan.n_microbatches,
        "split_points": ", ".join(plan.split_points),
        "predicted_step_ms": round(plan.predicted_step_s * 1e3, 4),
    }
    return trace


def merge_rank_traces(traces: Sequence[dict[str, Any] | str | os.PathLike], *,
                      label: str = "measured") -> dict[str, Any]:
    """Merge per-rank Chrome traces (e.g. ``torch.profiler``'s ``export_chrome_trace``) into one.

    Example:
        >>> merged = merge_rank_traces(["rank0.json", "rank1.json"])  # doctest: +SKIP
    """
    if not traces:
        raise ValueError("traces is empty: give one Chrome trace per rank")
    loaded = []
    for r, t in enumerate(traces):
        if not isinstance(t, dict):
            with open(t, encoding="utf-8") as f:
                t = json.load(f)
        events = t.get("traceEvents") if isinstance(t, dict) else None
        if not isinstance(events, list):
            raise ValueError(f"traces[{r}] has no 'traceEvents' list; is it a Chrome trace?")
        loaded.append(events)
    starts = [e["ts"] for events in loaded for e in events if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M"]
    t0 = min(starts) if starts else 0.0
    merged: list[dict[str, Any]] = []
    for rank, events in enumerate(loaded):
        merged.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        merged.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for e in events:
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue
            e = dict(e)
            e["pid"] = rank
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] = e["ts"] - t0
            merged.append(e)
    return {"traceEvents": merged, "displayTimeUnit": "ms", "otherData": {"source": label, "ranks": len(loaded)}}


def trace_ranks(trace: dict[str, Any]) -> set[int]:
    """The ranks with a track in a trace from this module: ``tid`` of a simulated trace,
    ``pid`` of a merged measured one.

    Example:
        >>> trace_ranks({"traceEvents": [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 1,
        ...                               "args": {"name": "rank 1"}}]})
        {1}
    """
    ranks = set()
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "M":
            continue
        name = str(e.get("args", {}).get("name", ""))
        if e.get("name") == "thread_name" and name.startswith("rank "):
            ranks.add(int(e["tid"]))
        elif e.get("name") == "process_name" and name.startswith("rank "):
            ranks.add(int(e["pid"]))
    return ranks
