"""The report's tables as rows of text, shared by the terminal, Markdown and HTML renderers.

Example:
    >>> from autopipe.reporting.tables import layer_table
    >>> t = layer_table([{"index": 0, "name": "<input>", "modules": ["embedding"], "fwd_s": 1e-3,
    ...                   "bwd_s": 2e-3, "param_bytes": 4096, "act_bytes": 0, "out_bytes": 512}])
    >>> t.rows[0][:4]
    ['0', '<input> (embedding)', '1.00 ms', '2.00 ms']
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..machine.device import format_bytes
from .units import format_seconds, whole_pass_line

@dataclass
class Table:
    """A titled table of formatted cells."""

    title: str
    header: list[str]
    rows: list[list[str]]
    numeric: list[bool] = field(default_factory=list)  # per column: right-align
    highlight: list[bool] = field(default_factory=list)  # per row: the chosen one
    notes: list[str] = field(default_factory=list)  # lines under the table


def _modules(fqns: list[str], limit: int = 3) -> str:
    if len(fqns) <= limit:
        return ", ".join(fqns)
    return f"{fqns[0]} ... {fqns[-1]} ({len(fqns)} modules)"


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The report's opening sentences: what was planned, the prediction, the gain.

    Example:
        >>> summary_lines(report_data(plan))[0]  # doctest: +SKIP
        'SeedTransformer split into 2 stages on 2 ranks, 1F1B with 4 micro-batches.'
    """
    s = data["summary"]
    ranks = f"{s['num_ranks']} ranks" + (f" ({s['stages_per_rank']} stages each)" if s["stages_per_rank"] > 1 else "")
    lines = [
        f"{s['model'] or 'The model'} split into {s['num_stages']} stages on {ranks}, "
        f"{s['schedule']} with {s['n_microbatches']} micro-batches.",
        f"Predicted step: {format_seconds(s['predicted_step_s'])} "
        f"(bubble {s['bubble_fraction']:.1%}); heaviest stage {format_seconds(s['bottleneck_s'])} per "
        f"micro-batch against a lower bound of {format_seconds(s['lower_bound_s'])} (balance {s['balance']:.1%}).",
    ]
    speedup = s.get("speedup_over_best_baseline")
    if speedup is not None:
        if speedup >= 1.005:
            lines.append(f"{speedup:.2f}x faster than the best of the usual splits ({s['best_baseline']}), "
                         "same costs and schedule.")
        elif speedup > 0.995:
            lines.append(f"As fast as the best of the usual splits ({s['best_baseline']}, within 0.5%), "
                         "same costs and schedule.")
        else:  # only a plan that minimised the heaviest stage alone (objective="bottleneck") can lose on the step
            lines.append(f"The usual split {s['best_baseline']} is predicted {1 / speedup:.2f}x faster in the "
                         f"simulated step: this plan minimises the heaviest stage alone "
                         f"(objective={s.get('objective', 'bottleneck')!r}).")
    lines.append(
        f"Costs {s['cost_source']} on {s['device']}; memory includes {s['optimizer']} optimizer state; "
        f"exact search took {format_seconds(s['planner_s'])}"
        + (f"; planning's peak host memory was {format_bytes(s['planning_peak_rss_bytes'])}."
           if s.get("planning_peak_rss_bytes") else ".")
    )
    if s.get("whole_pass"):
        lines.append(whole_pass_line(s["whole_pass"]))
    lines += [f"Note: {n}" for n in s.get("notes") or []]
    lines += s.get("recompute") or []  # which stages recompute their activations, and why
    return lines


def split_spec_code(data: dict[str, Any]) -> str:
    """The ``split_spec`` line to paste into ``torch.distributed.pipelining.pipeline``."""
    splits = data["summary"]["split_points"]
    return "split_spec = {" + ", ".join(f'"{n}": SplitPoint.BEGINNING' for n in splits) + "}"


def stage_table(data: dict[str, Any]) -> Table:
    """One row per stage: modules, times per micro-batch, memory, bytes sent."""
    multi = data["summary"]["stages_per_rank"] > 1
    # A capacity column only when a memory limit was given; otherwise it would read "-" throughout.
    capped = any(s.get("capacity_bytes") is not None for s in data["stages"])
    header = ["stage"] + (["rank"] if multi else []) + [
        "modules", "fwd", "bwd", "comm", "total", "params", "activations", "peak mem"] + \
        (["capacity"] if capped else []) + ["sends"]
    rows = []
    for s in data["stages"]:
        cap = s.get("capacity_bytes")
        rows.append([str(s["index"])] + ([str(s["rank"])] if multi else []) + [
            _modules(s["fqns"]), format_seconds(s["fwd_s"]), format_seconds(s["bwd_s"]),
            format_seconds(s["comm_s"]), format_seconds(s["time_s"]), format_bytes(s["param_bytes"]),
            f"{format_bytes(s['act_bytes'])} x{s['inflight_microbatches']}", format_bytes(s["peak_bytes"]),
        ] + ([format_bytes(cap) if cap is not None else "unlimited"] if capped else []) + [format_bytes(s["send_bytes"])])
    numeric = [True] + ([True] if multi else []) + [False] + [True] * (len(header) - (3 if multi else 2))
    return Table(
        "Stages (times per micro-batch)", header, rows, numeric,
        highlight=[s["time_s"] >= data["summary"]["bottleneck_s"] * (1 - 1e-9) for s in data["stages"]],
        notes=["activations: bytes saved for backward per micro-batch x micro-batches in flight at the peak; "
               "peak mem adds parameters, gradients and optimizer state"],
    )


def baseline_table(data: dict[str, Any]) -> Table:
    """The chosen split and the usual ones (same costs, same schedule)."""
    s = data["summary"]
    rows = [["autopipe (chosen)", ", ".join(s["split_points"]) or "-", format_seconds(s["bottleneck_s"]),
             format_seconds(s["predicted_step_s"]), "1.00x",
             format_bytes(max(st["peak_bytes"] for st in data["stages"])), "yes"]]
    for b in data["baselines"]:
        if b.get("reason"):  # the tool's rule gives no split for this model
            rows.append([b["name"], b["reason"], "-", "-", "-", "-", "-"])
            continue
        rows.append([b["name"], ", ".join(b["split_points"]) or "-", format_seconds(b["bottleneck_s"]),
                     format_seconds(b["predicted_step_s"]), f"{b['slowdown']:.2f}x", format_bytes(b["peak_bytes"]),
                     "yes" if b["fits_memory"] else "NO"])
    return Table(
        "The chosen split beside the usual ones",
        ["split", "split points", "heaviest stage", "step", "step vs chosen", "peak mem", "fits"],
        rows, [False, False, True, True, True, True, False], highlight=[True] + [False] * len(data["baselines"]),
        notes=[f"{b['name']}: {b['description']}" for b in data["baselines"]],
    )


def alternatives_table(data: dict[str, Any]) -> Table | None:
    """The schedules and micro-batch counts the planner weighed, fastest first; None if none."""
    alts = data.get("alternatives") or []
    if not alts:
        return None
    s = data["summary"]
    alts = sorted(alts, key=alternative_step_s)
    rows, chosen = [], []
    for a in alts:
        step = a.get("predicted_step_s")
        peak = a.get("peak_bytes")
        rows.append([str(a.get("schedule", "?")), str(a.get("n_microbatches", "?")), str(a.get("stages_per_rank", 1)),
                     format_seconds(step) if _is_number(step) else "-",
                     format_bytes(peak) if _is_number(peak) else "-",
                     "yes" if a.get("fits", True) else "NO", str(a.get("note") or "")])
        chosen.append(a.get("schedule") == s["schedule"] and a.get("n_microbatches") == s["n_microbatches"]
                      and a.get("stages_per_rank", 1) == s["stages_per_rank"])
    return Table("Alternatives considered", ["schedule", "micro-batches", "stages/rank", "step", "peak mem", "fits",
                                             "note"],
                 rows, [False, True, True, True, True, False, False], highlight=chosen)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def alternative_step_s(alt: dict[str, Any]) -> float:
    """An alternative's predicted step in seconds; infinity when it could not be costed."""
    step = alt.get("predicted_step_s")
    return float(step) if _is_number(step) else math.inf


def layer_table(rows: list[dict[str, Any]], *, with_stage: bool = False) -> Table:
    """One row per layer (segment between two legal split points)."""
    header = ["#", "layer (split point)", "fwd", "bwd", "params", "activations", "out"] + (["stage"] if with_stage else [])
    out = []
    for r in rows:
        name = r["name"]
        if name == "<input>" and r.get("modules"):
            name = f"<input> ({r['modules'][0]})"
        out.append([str(r["index"]), name, format_seconds(r["fwd_s"]), format_seconds(r["bwd_s"]),
                    format_bytes(r["param_bytes"]), format_bytes(r["act_bytes"]), format_bytes(r["out_bytes"])]
                   + ([str(r.get("stage", "-"))] if with_stage else []))
    return Table("Per-layer cost (one micro-batch)", header, out,
                 [True, False, True, True, True, True, True] + ([True] if with_stage else []),
                 notes=["a layer runs from one legal split point to the next; its name is the split point it "
                        "starts at. activations: bytes saved for backward; out: bytes it hands to later layers"])


def measured_table(data: dict[str, Any]) -> Table | None:
    """Measured against predicted step time, when the report holds a measured run; else None."""
    m = data.get("measured")
    if not m:
        return None
    rows = []
    for run in m.get("runs", []):
        best, median, predicted = run.get("best_step_s"), run.get("median_step_s"), run.get("predicted_step_s")
        ratio = f"{best / predicted:.2f}" if best and predicted else "-"
        compute = " | ".join(f"{format_seconds(c)} / {format_seconds(p)}" for c, p in
                             zip(run.get("rank_compute_s", []), run.get("predicted_rank_compute_s", [])))
        rows.append([run.get("name", "?"), ", ".join(run.get("split_points", [])) or "-",
                     format_seconds(predicted) if predicted else "-",
                     format_seconds(best) if best else "-", format_seconds(median) if median else "-", ratio,
                     compute or "-", " ".join(f"{x:.3f}" for x in run.get("losses", [])) or "-"])
    return Table("Measured run", ["split", "split points", "predicted step", "measured step (best)",
                                  "measured step (median)", "best / predicted",
                                  "compute per rank, measured / predicted", "loss per step"],
                 rows, [False, False, True, True, True, True, True, False],
                 notes=["compute per rank: CPU time of each rank's compute thread per step (median); time spent "
                        "waiting for a core does not count"] + list(m.get("notes", [])))


def tail_note(data: dict[str, Any]) -> str:
    """A sentence on the step's once-per-step work, which the timeline does not draw ('' if none).

    Example:
        >>> tail_note({"summary": {"step_tail_s": {"merge_outputs_s": 0.002}}})
        ' Around its actions the step also spends 2.00 ms once (merge outputs 2.00 ms), included in the predicted step.'
    """
    tail = data.get("summary", {}).get("step_tail_s") or {}
    total = sum(tail.values())
    if total <= 0:
        return ""
    parts = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v * 1e3:.2f} ms" for k, v in tail.items() if v > 0)
    return (f" Around its actions the step also spends {total * 1e3:.2f} ms once ({parts}), "
            "included in the predicted step.")
