"""Plain-text report of a Plan: the stages, the predictions and the baselines beside them.

Example:
    >>> from autopipe.planning.plan import Plan, StagePlan
    >>> stages = [StagePlan(index=i, fqns=[f"layers.{i}"], first_segment=i, last_segment=i, fwd_s=1e-3,
    ...                     bwd_s=2e-3, comm_s=0.0, param_bytes=0, act_bytes=0, peak_bytes=0, send_bytes=0,
    ...                     recv_bytes=0) for i in range(2)]
    >>> plan = Plan(num_stages=2, split_points=["layers.1"], stages=stages, schedule="1F1B", n_microbatches=4,
    ...             bottleneck_s=3e-3, predicted_step_s=15e-3, lower_bound_s=3e-3)
    >>> plan_to_text(plan).splitlines()[0]
    'autopipe plan for model: 2 stages, 1F1B with 4 micro-batches'
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..machine.device import format_bytes
from ..planning.frameworks import versus_default
from .units import format_seconds, whole_pass_line


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *[line(r) for r in rows]]


def _modules_summary(fqns: list[str], limit: int = 4) -> str:
    if len(fqns) <= limit:
        return ", ".join(fqns)
    return ", ".join(fqns[:2]) + f", ... {fqns[-1]} ({len(fqns)} modules)"


def plan_to_text(plan: Any) -> str:
    """The report printed by ``plan.report()`` for a :class:`~autopipe.planning.Plan` (which calls this lazily,
    so no type import back to it here): every figure per micro-batch unless marked."""
    out = [
        f"autopipe plan for {plan.model_name or 'model'}: {plan.num_stages} stages, "
        f"{plan.schedule} with {plan.n_microbatches} micro-batches"
        + (f", {plan.stages_per_rank} stages per rank" if plan.stages_per_rank > 1 else ""),
        f"costs: {plan.cost_source} on {plan.device}; optimizer state: {plan.optimizer}; "
        f"search: exact ({plan.objective}), {format_seconds(plan.planner_s)}"
        + (f"; planning's peak host memory: {format_bytes(plan.planning_peak_rss_bytes)}"
           if plan.planning_peak_rss_bytes else ""),
        *([f"made for micro-batches of inputs shaped {', '.join(map(str, map(tuple, plan.input_shapes)))}"
           + (f" (sequence length {plan.sequence_length}; another length's step: plan.predict_at(length))"
              if plan.sequence_length else "")] if plan.input_shapes else []),
        *[f"note: {n}" for n in plan.notes],  # what autopipe changed or assumed to make the plan
        *([line] if (line := versus_default(plan)) else []),  # a framework's plan against its own default
        "",
        "split_spec = {" + ", ".join(f'"{n}": SplitPoint.BEGINNING' for n in plan.split_points) + "}",
        "",
    ]
    rows = []
    for s in plan.stages:
        rows.append([
            str(s.index), _modules_summary(s.fqns), format_seconds(s.fwd_s), format_seconds(s.bwd_s),
            format_seconds(s.comm_s), format_seconds(s.time_s), format_bytes(s.param_bytes),
            f"{format_bytes(s.act_bytes)} x{s.inflight_microbatches}", format_bytes(s.peak_bytes),
            format_bytes(s.send_bytes),
        ])
    out += _table(["stage", "modules", "fwd", "bwd", "comm", "total", "params", "activations", "peak mem", "sends"], rows)
    out += [
        "",
        f"bottleneck stage: {format_seconds(plan.bottleneck_s)} per micro-batch; "
        f"lower bound max(total/p, heaviest segment) = {format_seconds(plan.lower_bound_s)}; "
        f"balance {plan.balance:.1%}",
        f"predicted step: {format_seconds(plan.predicted_step_s)} (simulated {plan.schedule}, "
        f"bubble {plan.bubble_fraction:.1%})",
    ]
    if plan.whole_pass is not None:
        out.append(whole_pass_line(asdict(plan.whole_pass)))
    if plan.search is not None:
        out.append(
            f"search: objective '{plan.objective}', {plan.search.candidates} candidate "
            f"splits simulated; no split can beat {format_seconds(plan.search.step_lower_bound_s)} per step "
            f"under this schedule (gap to that bound {plan.search.step_gap:.1%}, most of it pipeline fill)"
        )
    if plan.memory_limit_bytes:
        out.append("memory limit per device: " + ", ".join(
            format_bytes(m) if m >= 0 else "unlimited" for m in plan.memory_limit_bytes))
    if plan.recompute_stages:  # which stages recompute their activations, and why
        from .recompute import recompute_lines  # here: recompute imports format_bytes from this module

        limits = plan.memory_limit_bytes or []
        stages = [{**asdict(s), "capacity_bytes": (limits[r] // plan.stages_per_rank
                                                   if r < len(limits) and limits[r] >= 0 else None)}
                  for s, r in zip(plan.stages, plan.stage_ranks)]
        out += recompute_lines(stages, plan.recompute_stages)
    if plan.data_parallel is not None:  # every pp x dp factorization, fastest first
        from .data_parallel import dp_table  # here: it imports the formatting from this module
        table = dp_table(plan.to_dict()["data_parallel"])
        if table is not None:
            out += ["", table.title + ":", *_table(table.header, table.rows), *[f"  {n}" for n in table.notes]]
    if plan.alternatives:
        out += ["", "schedules considered (schedule='auto'):"]
        rows = []
        for a in sorted(plan.alternatives, key=lambda a: a.predicted_step_s or float("inf")):
            chosen = a.schedule == plan.schedule and a.stages_per_rank == plan.stages_per_rank
            rows.append([
                ("* " if chosen else "  ") + a.schedule, str(a.stages_per_rank), str(a.n_microbatches),
                format_seconds(a.predicted_step_s) if a.predicted_step_s else "-",
                format_bytes(a.peak_bytes) if a.peak_bytes else "-",
                "yes" if a.fits else "NO", a.note[:60],
            ])
        out += _table(["schedule", "stages/rank", "micro-batches", "step", "peak mem/device", "fits", "note"], rows)
    if plan.baselines:
        out += ["", "the same model split the usual ways (same costs, same schedule):"]
        rows = []
        for b in plan.baselines:
            if b.reason:  # the tool's rule gives no split for this model
                rows.append([b.name, b.reason, "-", "-", "-", "-", "-"])
                continue
            speedup = b.predicted_step_s / plan.predicted_step_s if plan.predicted_step_s > 0 else float("nan")
            rows.append([
                b.name, ", ".join(b.split_points) or "-", format_seconds(b.bottleneck_s),
                format_seconds(b.predicted_step_s), f"{speedup:.2f}x", format_bytes(b.peak_bytes),
                "yes" if b.fits_memory else "NO",
            ])
        out += _table(["baseline", "split points", "bottleneck", "step", "autopipe faster by", "peak mem", "fits"], rows)
        out += [f"  {b.name}: {b.description}" for b in plan.baselines]
    return "\n".join(out)
