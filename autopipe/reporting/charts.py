"""The report's figures, drawn with matplotlib from :func:`~autopipe.reporting.data.report_data`.

Example:
    >>> from autopipe.reporting.charts import save_pngs
    >>> paths = save_pngs(report_data(plan), "charts/")  # doctest: +SKIP
    >>> sorted(paths)  # doctest: +SKIP
    ['baselines', 'layers', 'stages', 'timeline']
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .tables import alternative_step_s
from .units import format_seconds

#: Figure names in the order reports show them.
FIGURE_NAMES = ("stages", "layers", "baselines", "timeline", "alternatives")

# One colour per stage (tab10, repeating), the darker shade of a pair for backward.
_STAGE_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3",
                  "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]
# Action kinds in the Gantt chart: forward light, backward dark, zero-bubble halves between.
_KIND_COLOURS = {"F": "#8FB9E6", "B": "#2F5F98", "I": "#E39B62", "W": "#6BAF6B"}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
_CHOSEN = "#2F5F98"
# Legends under a panel, so they never cover bars or the lines annotated on them.
_BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.2), "fontsize": 7, "frameon": False, "ncols": 1}
_OTHER = "#B8B8B8"
_WARN = "#C44E52"


def _stage_colour(stage: int | None) -> str:
    return _OTHER if stage is None else _STAGE_COLOURS[stage % len(_STAGE_COLOURS)]


def _shade(hex_colour: str, factor: float) -> str:
    """Lighter (factor > 1) or darker (factor < 1) version of a colour, for fwd vs bwd."""
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    if factor >= 1:
        r, g, b = (int(c + (255 - c) * (factor - 1)) for c in (r, g, b))
    else:
        r, g, b = (int(c * factor) for c in (r, g, b))
    return f"#{min(r, 255):02x}{min(g, 255):02x}{min(b, 255):02x}"


def _time_unit(max_s: float) -> tuple[float, str]:
    """Scale and unit name so the largest time reads as a small number."""
    if max_s >= 1:
        return 1.0, "s"
    if max_s >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _byte_unit(max_bytes: float) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return 1.0 / scale, unit
    return 1.0, "B"


def _title(data: dict[str, Any]) -> str:
    s = data["summary"]
    return f"{s['model'] or 'model'}: {s['num_stages']} stages, {s['schedule']} x {s['n_microbatches']} micro-batches"


# --------------------------------------------------------------------------- per layer


def layer_cost_figure(layers: list[dict[str, Any]], *, title: str = "Per-layer cost (one micro-batch)") -> Figure:
    """Per-layer cost: time (forward + backward) on the left, memory on the right.

    Example:
        >>> layer_cost_figure(report_data(plan)["layers"]).savefig("layers.png")  # doctest: +SKIP
    """
    if not layers:
        raise ValueError("layers is empty: there is no per-layer profile to draw")
    n = len(layers)
    height = min(0.32 * n + 1.6, 40.0)
    fig = Figure(figsize=(11, height), layout="constrained")
    ax_t, ax_m = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(n))
    tscale, tunit = _time_unit(max(r["fwd_s"] + r["bwd_s"] for r in layers))
    mscale, munit = _byte_unit(max(max(r["param_bytes"], r["act_bytes"]) for r in layers) or 1)
    has_stage = any(r.get("stage") is not None for r in layers)
    fwd_colours = [_shade(_stage_colour(r.get("stage") if has_stage else 0), 1.45) for r in layers]
    bwd_colours = [_stage_colour(r.get("stage") if has_stage else 0) for r in layers]
    fwd = [r["fwd_s"] * tscale for r in layers]
    bwd = [r["bwd_s"] * tscale for r in layers]
    ax_t.barh(y, fwd, color=fwd_colours, edgecolor="white", linewidth=0.4)
    ax_t.barh(y, bwd, left=fwd, color=bwd_colours, edgecolor="white", linewidth=0.4)
    ax_t.set_xlabel(f"time per micro-batch ({tunit}); light = forward, dark = backward")
    ax_t.set_yticks(y, [_layer_label(r) for r in layers], fontsize=8 if n <= 40 else 6)
    ax_t.invert_yaxis()  # graph order reads top to bottom
    ax_t.margins(y=0.5 / n)
    ax_t.grid(axis="x", alpha=0.3)

    h = 0.38
    params = [r["param_bytes"] * mscale for r in layers]
    acts = [r["act_bytes"] * mscale for r in layers]
    ax_m.barh([v - h / 2 for v in y], params, height=h, color="#7F7F7F", label="parameters")
    ax_m.barh([v + h / 2 for v in y], acts, height=h, color="#E0A458", label="activations saved for backward")
    ax_m.set_xlabel(f"memory ({munit}): parameters; activations per micro-batch")
    ax_m.grid(axis="x", alpha=0.3)
    ax_m.legend(loc="best", fontsize=8)
    if has_stage:
        stages = sorted({r["stage"] for r in layers if r.get("stage") is not None})
        ax_t.legend(handles=[Patch(color=_stage_colour(s), label=f"stage {s}") for s in stages],
                    loc="best", fontsize=8)
        for i in range(1, n):  # a dashed line at every split point
            if layers[i].get("stage") != layers[i - 1].get("stage"):
                for ax in (ax_t, ax_m):
                    ax.axhline(i - 0.5, color="black", linestyle="--", linewidth=0.8)
    fig.suptitle(title)
    return fig


def _layer_label(row: dict[str, Any]) -> str:
    name = row["name"]
    if name == "<input>":
        modules = row.get("modules") or []
        name = f"<input> {modules[0]}" if modules else "<input>"
    return name if len(name) <= 40 else "..." + name[-37:]


# --------------------------------------------------------------------------- per stage


def stage_balance_figure(data: dict[str, Any]) -> Figure:
    """Per-stage balance: time per micro-batch, bytes across each cut, memory vs capacity.

    Example:
        >>> stage_balance_figure(report_data(plan)).savefig("stages.png")  # doctest: +SKIP
    """
    stages = data["stages"]
    n = len(stages)
    fig = Figure(figsize=(max(9.0, 3 * 3.2), 3.6 + 0.12 * n), layout="constrained")
    ax_t, ax_c, ax_m = fig.subplots(1, 3)
    x = list(range(n))
    labels = [f"{s['index']}" + (f"\nrank {s['rank']}" if data["summary"]["stages_per_rank"] > 1 else "") for s in stages]
    tscale, tunit = _time_unit(max(max(s["time_s"] for s in stages), data["summary"]["lower_bound_s"]))
    fwd = [s["fwd_s"] * tscale for s in stages]
    bwd = [s["bwd_s"] * tscale for s in stages]
    comm = [s["comm_s"] * tscale for s in stages]
    colours = [_stage_colour(s["index"]) for s in stages]
    ax_t.bar(x, fwd, color=[_shade(c, 1.45) for c in colours], label="forward")
    ax_t.bar(x, bwd, bottom=fwd, color=colours, label="backward")
    ax_t.bar(x, comm, bottom=[f + b for f, b in zip(fwd, bwd)], color="#333333", hatch="///",
             edgecolor="white", label="communication")
    lower = data["summary"]["lower_bound_s"] * tscale
    ax_t.axhline(lower, color="black", linestyle="--", linewidth=1)
    # x in axes fraction, y in data: the label sits at the right end of the line, whatever n is.
    ax_t.text(0.99, lower, "lower bound ", transform=ax_t.get_yaxis_transform(), ha="right", va="bottom", fontsize=8)
    ax_t.set_ylim(0, max(max(f + b + c for f, b, c in zip(fwd, bwd, comm)), lower) * 1.22)
    ax_t.set_title("time per micro-batch\n(light: forward, dark: backward)", fontsize=10)
    ax_t.set_ylabel(tunit)
    ax_t.legend(handles=[Patch(facecolor="#333333", hatch="///", edgecolor="white", label="communication")],
                **_BELOW)

    sends = [s["send_bytes"] for s in stages]
    bscale, bunit = _byte_unit(max(sends) or 1)
    ax_c.bar(x, [v * bscale for v in sends], color=colours)
    for i, s in enumerate(stages):
        if s.get("cut_comm_s") is not None and s["send_bytes"]:
            ax_c.annotate(format_seconds(s["cut_comm_s"]), (i, s["send_bytes"] * bscale), xytext=(0, 2),
                          textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax_c.set_title("sent to the next stage, per micro-batch\n(label: one-way transfer time)", fontsize=10)
    ax_c.set_ylabel(bunit)
    ax_c.set_ylim(0, max(max(sends) * bscale, 1e-9) * 1.2)

    peaks = [s["peak_bytes"] for s in stages]
    caps = [s["capacity_bytes"] for s in stages]
    mscale, munit = _byte_unit(max(peaks + [c for c in caps if c is not None]) or 1)
    static = [s["static_bytes"] * mscale for s in stages]
    acts = [(s["peak_bytes"] - s["static_bytes"]) * mscale for s in stages]
    ax_m.bar(x, static, color="#7F7F7F", label="params + grads + optimizer")
    ax_m.bar(x, acts, bottom=static, color="#E0A458", label="activations in flight")
    for i, s in enumerate(stages):
        ax_m.annotate(f"x{s['inflight_microbatches']}", (i, (s["peak_bytes"]) * mscale), xytext=(0, 2),
                      textcoords="offset points", ha="center", va="bottom", fontsize=7)
    if any(c is not None for c in caps):
        for i, c in enumerate(caps):
            if c is not None:
                ax_m.hlines(c * mscale, i - 0.45, i + 0.45, color=_WARN, linewidth=2)
        ax_m.plot([], [], color=_WARN, linewidth=2, label="capacity")
    top = max(peaks + [c for c in caps if c is not None]) * mscale
    ax_m.set_ylim(0, top * 1.3)
    ax_m.set_title("peak memory\n(xN: micro-batches in flight)", fontsize=10)
    ax_m.set_ylabel(munit)
    ax_m.legend(**_BELOW)
    for ax in (ax_t, ax_c, ax_m):
        ax.set_xticks(x, labels)
        ax.set_xlabel("stage")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Per-stage balance - {_title(data)}")
    return fig


# --------------------------------------------------------------------------- baselines


def baselines_figure(data: dict[str, Any]) -> Figure:
    """Predicted step time of the chosen split beside the usual ones, same costs and schedule.

    Example:
        >>> baselines_figure(report_data(plan)).savefig("baselines.png")  # doctest: +SKIP
    """
    summary = data["summary"]
    rows = [("autopipe", summary["split_points"], summary["predicted_step_s"], True, True)]
    rows += [(b["name"], b["split_points"], b["predicted_step_s"], b["fits_memory"], False) for b in data["baselines"]
             if not b.get("reason")]
    tscale, tunit = _time_unit(max(r[2] for r in rows))
    fig = Figure(figsize=(9, 0.55 * len(rows) + 1.5), layout="constrained")
    ax = fig.subplots()
    y = list(range(len(rows)))
    for i, (name, splits, step, fits, chosen) in enumerate(rows):
        ax.barh(i, step * tscale, color=_CHOSEN if chosen else (_OTHER if fits else "white"),
                edgecolor=_WARN if not fits else "none", hatch=None if fits else "xx")
        ratio = step / summary["predicted_step_s"] if summary["predicted_step_s"] > 0 else math.nan
        note = "chosen" if chosen else f"{ratio:.2f}x the chosen step" + ("" if fits else ", does NOT fit memory")
        ax.annotate(f"  {format_seconds(step)}  ({note})", (step * tscale, i), va="center", fontsize=8)
    ax.set_yticks(y, [f"{r[0]}\n" + _splits_label(r[1]) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r[2] for r in rows) * tscale * 1.6)
    ax.set_xlabel(f"predicted step time ({tunit}), {summary['schedule']} x {summary['n_microbatches']}")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"Chosen split vs the usual ones - {_title(data)}", fontsize=10)
    return fig


def _splits_label(splits: list[str]) -> str:
    text = ", ".join(splits) if splits else "(no split)"
    return text if len(text) <= 38 else text[:35] + "..."


# --------------------------------------------------------------------------- timeline


def timeline_figure(timeline: dict[str, Any], *, title: str | None = None) -> Figure:
    """Gantt chart of one simulated step: one row per rank, one box per action.

    Example:
        >>> timeline_figure(report_data(plan)["timeline"]).savefig("timeline.png")  # doctest: +SKIP
    """
    events = timeline["events"]
    if not events:
        raise ValueError("the timeline has no events to draw")
    n_ranks = len(timeline["busy_s"])
    n_stages = len(timeline["stage_ranks"])
    with_stage = n_stages > n_ranks
    step = timeline["step_s"]
    tscale, tunit = _time_unit(step)
    fig = Figure(figsize=(12, 0.55 * n_ranks + 1.7), layout="constrained")
    ax = fig.subplots()
    # A label fits when the box is wider than ~5 characters of the chart's width.
    min_label_s = step * (0.012 if not with_stage else 0.02)
    for e in events:
        start, dur = e["start_s"] * tscale, (e["end_s"] - e["start_s"]) * tscale
        ax.barh(e["rank"], dur, left=start, height=0.72, color=_KIND_COLOURS.get(e["kind"], _OTHER),
                edgecolor="white", linewidth=0.6)
        if e["end_s"] - e["start_s"] >= min_label_s:
            label = f"{e['stage']}:{e['microbatch']}" if with_stage else str(e["microbatch"])
            ax.text(start + dur / 2, e["rank"], label, ha="center", va="center", fontsize=7,
                    color="white" if e["kind"] in ("B", "W") else "black")
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, step * tscale)
    ax.set_xlabel(f"time in the step ({tunit})" + ("; labels: stage:micro-batch" if with_stage else "; labels: micro-batch"))
    kinds = sorted({e["kind"] for e in events}, key="FBIW".index)
    fig.legend(handles=[Patch(color=_KIND_COLOURS[k], label=_KIND_NAMES[k]) for k in kinds],
               loc="outside lower center", ncols=len(kinds), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or (
        f"Simulated {timeline['schedule']} step, {timeline['n_microbatches']} micro-batches: "
        f"{format_seconds(step)}, bubble {timeline['bubble_fraction']:.0%}"), fontsize=10)
    return fig


# --------------------------------------------------------------------------- alternatives


def alternatives_figure(data: dict[str, Any]) -> Figure | None:
    """Predicted step of every schedule / micro-batch count the planner weighed, or None.

    Example:
        >>> alternatives_figure(report_data(plan))  # doctest: +SKIP
    """
    alts = data.get("alternatives") or []
    if not alts:
        return None
    summary = data["summary"]
    alts = sorted(alts, key=alternative_step_s)
    finite = [alternative_step_s(a) for a in alts if math.isfinite(alternative_step_s(a))]
    tscale, tunit = _time_unit(max(finite) if finite else 1.0)
    fig = Figure(figsize=(9, 0.4 * len(alts) + 1.5), layout="constrained")
    ax = fig.subplots()
    for i, a in enumerate(alts):
        chosen = _is_chosen(a, summary)
        fits = a.get("fits", True)
        step = alternative_step_s(a)
        if not math.isfinite(step):
            ax.annotate(f"  not costed: {a.get('note') or 'no feasible split'}", (0, i), va="center", fontsize=8)
            continue
        ax.barh(i, step * tscale, color=_CHOSEN if chosen else (_OTHER if fits else "white"),
                edgecolor=_WARN if not fits else "none", hatch=None if fits else "xx")
        note = " (chosen)" if chosen else ("" if fits else " (does NOT fit memory)")
        ax.annotate(f"  {format_seconds(step)}{note}", (step * tscale, i), va="center", fontsize=8)
    ax.set_yticks(range(len(alts)), [_alternative_label(a) for a in alts], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (max(finite) if finite else 1.0) * tscale * 1.45)
    ax.set_xlabel(f"predicted step time ({tunit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("Alternatives the planner considered", fontsize=10)
    return fig


def _is_chosen(alt: dict[str, Any], summary: dict[str, Any]) -> bool:
    return (alt.get("schedule") == summary["schedule"] and alt.get("n_microbatches") == summary["n_microbatches"]
            and alt.get("stages_per_rank", 1) == summary["stages_per_rank"])


def _alternative_label(alt: dict[str, Any]) -> str:
    v = alt.get("stages_per_rank", 1)
    return f"{alt.get('schedule', '?')}, m={alt.get('n_microbatches', '?')}" + (f", {v} stages/rank" if v != 1 else "")


# --------------------------------------------------------------------------- output


def report_figures(data: dict[str, Any]) -> dict[str, Figure]:
    """Every figure of a plan's report, by name (see :data:`FIGURE_NAMES`).

    Example:
        >>> sorted(report_figures(report_data(plan)))  # doctest: +SKIP
        ['baselines', 'layers', 'stages', 'timeline']
    """
    figs: dict[str, Figure] = {"stages": stage_balance_figure(data)}
    if data["layers"]:
        figs["layers"] = layer_cost_figure(data["layers"], title=f"Per-layer cost - {_title(data)}")
    if data["baselines"]:
        figs["baselines"] = baselines_figure(data)
    figs["timeline"] = timeline_figure(data["timeline"])
    alt = alternatives_figure(data)
    if alt is not None:
        figs["alternatives"] = alt
    return figs


def save_pngs(data: dict[str, Any], out_dir: str | os.PathLike, *, dpi: int = 110) -> dict[str, Path]:
    """Write every figure of the report as ``<out_dir>/<name>.png``.

    Example:
        >>> save_pngs(report_data(plan), "charts")["timeline"].name  # doctest: +SKIP
        'timeline.png'
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fig in report_figures(data).items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths[name] = path
    return paths


def figure_svg(fig: Figure) -> str:
    """The figure as an inline ``<svg>`` element (text kept as text), for the HTML report.

    Example:
        >>> figure_svg(timeline_figure(report_data(plan)["timeline"]))[:4]  # doctest: +SKIP
        '<svg'
    """
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "autopipe"}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML declaration and DOCTYPE

