"""Render every benchmark's ``results.json`` into ``docs/benchmarks.md``.

Reads ``<results>/<benchmark>/results.json`` for each benchmark folder (and
``prediction_accuracy/runs.json``, several runs pooled, where it exists; ``--quick`` runs'
``results_quick.json`` are not shown) and writes one
Markdown page of current results: per benchmark what it measures, the machine it ran on,
how to rerun it and one table; and, computed from the numbers rather than written by
hand, where autopipe is behind a baseline or misses a target. A folder with a
``results.json`` this script has no renderer for is shown generically, so a new
benchmark appears without editing this file. What the measurements taught about the
cost model is in ``docs/design.md``, not here.

Example::

    python benchmarks/render_docs.py                  # benchmarks/*/results.json -> docs/benchmarks.md
    python benchmarks/render_docs.py --results DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the checkout's autopipe, for its defaults

# Order of the page; anything else found is appended.
ORDER = ("peers", "real_steps", "frameworks", "precision", "split_quality", "split_quality_sim", "planner_scaling", "runtime_overhead", "prediction_accuracy",
         "schedule_memory", "trace_profile", "gpu_one_rank", "models", "meta_planning", "recompute", "meta_model",
         "scale_study", "published_layouts", "layout_search_speed", "tensor_parallel")
TITLES = {
    "peers": "0. autopipe against the real peers (2 and 4 stages, measured)",
    "real_steps": "0b. Every layer-level split of stock decoder LMs, real steps against predictions",
    "frameworks": "0c. torchtitan's own Llama3 and Qwen3: autopipe's plan against torchtitan's default split",
    "precision": "0d. bf16 autocast, compiled stages and another sequence length: real steps against the plan",
    "split_quality": "1. Split quality, measured (2 stages, real pipelines)",
    "split_quality_sim": "2. Split quality at scale, simulated from measured segment costs",
    "planner_scaling": "3. Planner scaling",
    "runtime_overhead": "4. Runtime overhead of autopipe.Pipeline",
    "prediction_accuracy": "5. Prediction accuracy: predicted vs measured step time and memory",
    "schedule_memory": "6. Schedule memory",
    "trace_profile": "7. Trace and profile time",
    "gpu_one_rank": "8. One GPU: the plan's step against torch's runtime on a single rank",
    "models": "9. Third-party models: plans, runtime and 2-rank pipelines",
    "meta_planning": "10. Planning a model bigger than the host, from the meta device",
    "meta_model": "12. A pipeline built from the meta device: host memory per rank",
    "recompute": "11. Recomputation the planner chooses",
    "scale_study": "13. Pipeline × data parallel at scale, simulated",
    "published_layouts": "14. Layouts at scale: predictions against published measured runs",
    "layout_search_speed": "15. Layout search time at scale",
    "tensor_parallel": "16. pp 2 against tp 2 on two gloo ranks, real steps against predictions",
}
# What each benchmark measures, in a sentence or three; the folder's README has the method.
ABOUT = {
    "peers": (
        "The split each tool would pick, reproduced exactly on the layer list that tool is given, against "
        "autopipe's and the best layer-level split, all measured side by side."
    ),
    "real_steps": (
        "On stock Hugging Face decoder LMs (their own classes and default configs, small sizes), is the split "
        "autopipe chooses the fastest when it runs, and does the plan predict every split's real step? Every "
        "layer-level 2-stage split runs as a real 2-rank `autopipe.Pipeline` (gloo, 1F1B, 4 micro-batches), "
        "interleaved, in several fresh worlds; `autopipe.tune` then runs in the first."),
    "split_quality": (
        "Is autopipe's 2-stage split as good as the best split there is, measured rather than predicted? "
        "Every legal split point's stages are timed in one process to find the exhaustive best; autopipe's "
        "split and the usual splits then run as real 2-rank `autopipe.Pipeline`s (gloo, 1F1B), interleaved."),
    "split_quality_sim": (
        "How do autopipe's splits compare with the usual splits and with the lower bound beyond the 2 stages a "
        "CPU host can run? Deep models are profiled once; every figure is the cost model's simulated prediction."),
    "planner_scaling": "How long the exact partition search takes as models and pipelines grow.",
    "runtime_overhead": (
        "How much slower a step through `autopipe.Pipeline` is than the same pipeline written by hand with "
        "`torch.distributed.pipelining` (same model, split and schedule; steps alternate)."),
    "prediction_accuracy": (
        "How close the plan's predicted step time and peak memory per rank are to a real 2-rank pipeline "
        "(5 models × 4 schedules × 4 and 8 micro-batches). The other columns predict the same split with "
        "more or less measured, to show what each ingredient of the cost model is worth."),
    "schedule_memory": (
        "How much activation memory 1F1B saves over GPipe for the same plan, measured per rank, and what "
        "activation checkpointing adds."),
    "trace_profile": "How long autopipe takes to trace and measure a GPT-2-small-sized model before it can plan.",
    "gpu_one_rank": (
        "On a GPU, does the plan's predicted step match torch's runtime? One rank (one GPU): 1F1B with one "
        "stage, Interleaved1F1B with two stages on the rank."),
    "models": "What autopipe does with stock models from other libraries, at their default settings.",
    "frameworks": (
        "Planned at torchtitan's granularity (`PlannerOptions(target=\"torchtitan\")`), is autopipe's split faster "
        "than the one torchtitan makes by default, when torchtitan itself builds and runs the stages?"),
    "precision": (
        "Does the plan predict the real step of a pipeline that trains in bf16 autocast, with compiled stages, or "
        "at another sequence length than it was made for? One model, 2 gloo ranks, variants interleaved."),
    "meta_planning": (
        "Can a model of over a billion parameters, built on the meta device, be planned on this host, and with "
        "how much host memory? Measured costs time one segment at a time; counted ones run nothing."),
    "meta_model": (
        "Does each rank of a `Pipeline` built from a meta-device model hold only its own stages? Host memory "
        "per rank after construction, against the whole model's parameter bytes."),
    "published_layouts": (
        "Does `autopipe.layouts` predict the throughput of published training runs at 8 to 16,384 GPUs "
        "(Megatron-LM SC'21 Table 1, Korthikanti et al. 2022 Table 5, BLOOM-176B, torchtitan's Tables 1, 3, 4, 5, "
        "the Llama 3 paper's Table 4) "
        "when given each run's exact layout, and what layout would it choose itself? Efficiency shares are fitted "
        "on the rows named below; every other row is held out."),
}
RERUN_OPTIONS = {"recompute": "`--smoke` for a tiny run that only checks the script",
                 "precision": "`--smoke` for a tiny run that only checks the script",
                 "frameworks": "needs torchtitan 0.3.0; `--smoke` for a tiny run that only checks the script",
                 "real_steps": "`--quick` for two models, `--models` for a subset",
                 "peers": "`--quick` for a short run, `--models`/`--stages` for a subset",
                 "gpu_one_rank": "needs one GPU; `--device cpu` runs it on the CPU",
                 "models": "renders docs/models.md too; `--quick` skips the 2-rank pipelines",
                 "meta_planning": "`--layers 4 --seq 64` for a quick look",
                 "meta_model": "`--layers 2 --seq 64` for a quick look",
                 "scale_study": "`--quick` for a tiny model that only checks the script",
                 "published_layouts": "`--smoke` for three rows without the fit; seconds, no GPU",
                 "layout_search_speed": "`--smoke` for a small Llama on 64 GPUs",
                 "tensor_parallel": "`--smoke` for a tiny model that only checks the script"}
BEHIND_TOL = 0.03  # a ratio within 3% counts as a tie: the split-quality target, and about the run-to-run noise
#: Where a renderer's section splits: above it, the headline on docs/benchmarks.md; below
#: it, every row, on the benchmark's own generated RESULTS.md.
DETAIL = "<!-- every row -->"
TARGET_ERROR = 0.10  # the step-time prediction's target: median |error| under 10%


# --------------------------------------------------------------------------- formatting


def ms(x: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds, or "–" for a missing value."""
    return "–" if x is None else f"{x * 1e3:.{digits}f}"


def ratio(x: float | None) -> str:
    """A ratio to three decimals, or "–"."""
    return "–" if x is None else f"{x:.3f}"


def pct(x: float | None) -> str:
    """A signed fraction as a percentage, or "–"."""
    return "–" if x is None else f"{x:+.1%}"


def apct(x: float | None) -> str:
    """An unsigned fraction (an absolute error) as a percentage, or "–"."""
    return "–" if x is None else f"{x:.1%}"


def mib(x: float | None) -> str:
    """Bytes as MiB, or "–"."""
    return "–" if x is None else f"{x / 2**20:.1f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; a ``|`` inside a cell is escaped so it cannot split the cell."""
    def cell(c: Any) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(data: dict[str, Any]) -> str:
    """One line: CPU, cores, GPU, torch, threads per process, load average, date, wall time."""
    m = data.get("machine", {})
    host = data.get("host_end") or data.get("host_start") or data.get("host") or {}
    cpu = host.get("cpu_model") or m.get("cpu")
    parts = [f"{cpu}, {m.get('cores')} cores" if m.get("cores") else str(cpu),
             f"CUDA: {m['cuda']}" if m.get("cuda") else "no GPU",
             f"torch {m.get('torch')}"]
    threads = data.get("threads_per_process", data.get("threads", m.get("torch_threads")))
    if threads is not None:
        parts.append(f"{threads} torch thread(s) per process")
    loads = [h.get("load_avg") for h in (data.get("host_start"), data.get("host_end"), data.get("host"))
             if isinstance(h, dict) and h.get("load_avg")]
    if loads:
        parts.append("load average " + " → ".join("/".join(f"{x:.1f}" for x in la) for la in loads))
    parts.append(f"dated {m.get('date')}")
    if data.get("wall_s"):
        parts.append(f"took {data['wall_s']:.0f} s")
    return "*Machine:* " + "; ".join(parts) + "."


def readme_question(folder: Path) -> str | None:
    """The ``**Question:**`` sentence of a benchmark's README, for benchmarks without an entry in ABOUT."""
    readme = folder / "README.md"
    if not readme.exists():
        return None
    match = re.search(r"\*\*Question:\*\*\s*(.+?)(?:\n\s*\n|$)", readme.read_text(), re.S)
    return " ".join(match.group(1).split()) if match else None


# --------------------------------------------------------------------------- renderers


PEER_BEHIND = 0.05  # the peers comparison names every bottleneck where autopipe is over 5% behind the best


def render_peers(d: dict[str, Any], behind: list[str]) -> str:
    """Per model and stage count: every method's measured bottleneck (and 2-stage real step) over the best."""
    best = "best_layer_split"
    methods = list(dict.fromkeys(k for r in d["rows"] for e in r["stages"].values() for k in e["methods"]
                                 if k not in ("autopipe", best)))
    cols = ["autopipe", *methods]
    rows, column = [], {c: [] for c in cols}
    for r in d["rows"]:
        for p, e in sorted(r["stages"].items(), key=lambda kv: int(kv[0])):
            m = e["methods"]
            cells = [r["model"], p]
            for c in cols:
                x = m.get(c, {}).get("bottleneck_vs_best")
                step = m.get(c, {}).get("step_vs_best")
                if x is not None:
                    column[c].append(x)
                cells.append("n/a" if c in m and m[c].get("split") is None else
                             ratio(x) + (f" ({ratio(step)})" if step is not None else ""))
            rows.append(cells)
            a = m["autopipe"]
            # Behind: slower than the best layer-level split, or than any peer, by over 5% in the
            # bottleneck (a compute-only figure) or 3% in the real step (the split-quality target).
            for key, what, tol in (("bottleneck_vs_best", "measured bottleneck", PEER_BEHIND),
                                   ("step_vs_best", "real 2-rank step", BEHIND_TOL)):
                if a.get(key) is None:
                    continue
                winner = min((c for c in cols if m.get(c, {}).get(key) is not None), key=lambda c: m[c][key])
                if a[key] > 1 + tol or a[key] > m[winner][key] * (1 + tol):
                    lead = f", {winner} {m[winner][key]:.2f}× (`{', '.join(m[winner]['split'])}`)" \
                        if winner != "autopipe" else ""
                    interval = a.get("step_vs_best_interval") if key == "step_vs_best" else None
                    spread = f"; 95% interval {ratio(interval[0])}–{ratio(interval[1])}" if interval else ""
                    behind.append(f"peers, {r['model']} at {p} stages, {what} over the best layer-level split's "
                                  f"(`{', '.join(m[best]['split'])}`): autopipe {a[key]:.2f}× "
                                  f"(`{', '.join(a['split'])}`{spread}){lead}.")
    rows.append(["**median**", "", *(f"**{ratio(statistics.median(column[c]))}**" if column[c] else "–" for c in cols)])
    return ("Each cell: the split's compute-only bottleneck (slowest stage's forward + backward, loss on the last "
            "stage, no communication) over the best layer-level split's, re-measured side by side; in brackets at "
            "2 stages, the real 2-rank step over the best split's (the median of their steps' ratios, paired round by "
            "round over 3 fresh worlds; where autopipe's is over 3% behind, the list above gives its 95% bootstrap "
            "interval). Below 1: faster than the best layer-level split "
            "(autopipe may cut inside a layer). n/a: the tool's rule does not apply to the model (the JSON says "
            "why). Peers as reproduced in `autopipe/planning/peers.py`, versions in "
            "[comparison.md](comparison.md). At 2 stages:\n\n"
            + table(["model", "stages", *cols], [row for row in rows if row[1] in ("2", 2, "")])
            + f"\n\n{DETAIL}\n\n" + table(["model", "stages", *cols], rows))


def prediction_level(splits: list[dict[str, Any]]) -> tuple[float, float]:
    """A model's level (the median over its splits of predicted ÷ measured step, minus 1) and its
    worst split's error once that level is taken out: the profile's level, which every split of
    the model shares, apart from how the cost model places the splits against each other."""
    ratios = [s["predicted_step_s"] / s["measured_step_s"] for s in splits]
    level = statistics.median(ratios)
    return level - 1, max(abs(x / level - 1) for x in ratios)


def world_movement(splits: list[dict[str, Any]]) -> tuple[float, float] | None:
    """How far one world moves a split's step against its model's other splits: per split, its
    step ÷ the median split's step in each world, the largest of these over the smallest, minus 1;
    the median and the largest over the splits. ``None`` with fewer than two worlds. A prediction
    can be judged against the measured steps only to about this resolution."""
    worlds = [s.get("world_steps_s") or [] for s in splits]
    n = min(map(len, worlds), default=0)
    if n < 2:
        return None
    medians = [statistics.median(w[i] for w in worlds) for i in range(n)]
    apart = [max(w[i] / medians[i] for i in range(n)) / min(w[i] / medians[i] for i in range(n)) - 1 for w in worlds]
    return statistics.median(apart), max(apart)


def render_real_steps(d: dict[str, Any], behind: list[str]) -> str:
    """Per model: the chosen, the FLOPs DP's and tune's split against the fastest; every split's prediction."""
    rows, detail, missed = [], [], []
    for r in d["rows"]:
        errors = [abs(s["prediction_error"]) for s in r["splits"].values()]
        tuned = r.get("tuned") or {}
        plans = r.get("partition_splits") or []
        same = f"{plans.count(r['chosen'])}/{len(plans)}" if plans else "–"
        predicted = r.get("partition_predicted_s") or []
        if len(predicted) > 1:  # one profile's level against the next's, seconds apart
            same += f" (its step predicted {min(predicted) * 1e3:.1f}–{max(predicted) * 1e3:.1f} ms)"
        own = r.get("pipeline_splits") or []
        per_world = r.get("chosen_vs_fastest_per_world") or []
        interval = r.get("chosen_vs_fastest_interval")
        spread = f" ({ratio(interval[0])}–{ratio(interval[1])})" if interval and r["chosen"] != r["fastest"] else ""
        moved = world_movement(list(r["splits"].values()))
        rows.append([r["model"], f"`{r['chosen']}`", ratio(r["chosen_vs_fastest"]) + spread,
                     ", ".join(ratio(x) for x in per_world) or "–", f"`{r['fastest']}`",
                     ratio(r.get("flops_dp_vs_fastest")), f"`{tuned.get('label', '–')}` ({ratio(tuned.get('vs_fastest'))})",
                     apct(statistics.median(errors)), apct(max(errors)),
                     f"{apct(moved[0])} / {apct(moved[1])}" if moved else "–", same,
                     ", ".join(f"`{x}`" for x in own) or "–"])
        if r["chosen_vs_fastest"] > 1 + BEHIND_TOL:
            behind.append(f"real steps, {r['model']}: autopipe's split `{r['chosen']}` stepped "
                          f"{r['chosen_vs_fastest']:.3f}×{spread} the fastest layer-level split's (`{r['fastest']}`).")
        if max(errors) > TARGET_ERROR:
            level, shape = prediction_level(list(r["splits"].values()))
            amid = [abs(s["amid_error"]) for s in r["splits"].values() if s.get("amid_error") is not None]
            tuned_errors = [abs(s["after_tune_error"]) for s in r["splits"].values()
                            if s.get("after_tune_error") is not None]
            missed.append(f"{r['model']} {max(errors):.1%} (its level {level:+.1%}, the worst without it {shape:.1%}"
                          + (f"; its splits moved world to world by up to {moved[1]:.1%}" if moved else "")
                          + (f"; from the profiles amid the steps {max(amid):.1%}" if amid else "")
                          + (f"; calibrated to tune's step {max(tuned_errors):.1%}" if tuned_errors else "") + ")")
        if len(set(plans)) > 1:
            behind.append(f"real steps, {r['model']}: {len(plans)} plans of the same model gave "
                          f"{len(set(plans))} different splits ({', '.join(sorted(set(plans)))}).")
        for label, sp in r["splits"].items():
            detail.append([r["model"], f"`{label}`" + ("" if sp["layer_level"] else " (inside a layer)"),
                           f"{sp['measured_step_s'] * 1e3:.1f} ms", f"{sp['predicted_step_s'] * 1e3:.1f} ms",
                           pct(sp["prediction_error"]), pct(sp.get("in_ranks_error")), pct(sp.get("amid_error")),
                           pct(sp.get("after_tune_error")), ratio(sp["vs_fastest"])])
    if missed:
        behind.append(f"real steps: the worst split's predicted step is off by more than {TARGET_ERROR:.0%} on "
                      f"{', '.join(missed)} (target: every split within {TARGET_ERROR:.0%}; a model's level, the median of its "
                      "splits' predicted ÷ measured steps, is what its profile shares with every split, as the host's "
                      "speed drifting between the profile and the steps moves it: design.md, finding 13).")
    worlds = d.get("worlds", 1)
    loads = [f"{r['model']} {'/'.join(map(str, r['host_start']['load_avg']))} → "
             f"{'/'.join(map(str, r['host_end']['load_avg']))}" for r in d["rows"] if r.get("host_start")]
    # Each model's profile is taken right after the previous model's steps: its start shows them.
    per_model = (f"Load average at each model's start and end (the models run one after another): "
                 f"{', '.join(loads)}.\n\n" if loads else "")
    return per_model + (f"Each split runs in {worlds} fresh 2-rank world{'s' if worlds > 1 else ''}, one after another, "
            "stepped in interleaved rounds in each; its step is the median over all of them of the slower rank's "
            "step, and \"÷ fastest\" is " + ("the median of its steps' ratios to the fastest split's, paired round "
                                           "by round" if d.get("ratios") == "paired" else "over the fastest split's")
            + " (where no split beats every other, as the medians of ratios allow, the fastest is the one with "
              "the lowest median step, and another split's ratio can fall under 1); in brackets, a 95% bootstrap "
              "interval of autopipe's ratio over the paired steps: the noise within this run, not the host's "
              "state changing between runs, which can move the ratio as much again. "
              "\"Per world\": autopipe's split over the "
            "fastest within each world alone (which of two close splits wins moves with the host's state). "
            "\"World to world\": how far the worlds placed a split's step against its model's other splits "
            "(per split, its step ÷ the model's median split's in each world, the largest over the smallest; "
            "the median and the largest over its splits): the resolution of the measured steps a prediction is "
            "judged against (`render_docs.world_movement`). "
            "The FLOPs DP is torch PR #179212's partitioner "
            "(`autopipe/planning/peers.py`); `tune` is `autopipe.tune(plan, candidates=3)` in the first world. "
            "\"Same split\": how many of the `partition()` calls, each with a fresh profile, gave the split "
            "measured here, and the range of their predictions of that split's step (how far one profile's "
            "level lies from the next's, seconds apart); \"Pipeline's own plan\": the split `autopipe.Pipeline` chose planning for itself "
            "on the 2 ranks (profiled in both at once).\n\n"
            + table(["model", "autopipe's split", "÷ fastest", "per world", "fastest split", "FLOPs DP ÷ fastest",
                     "tune kept (÷ fastest)", "median |pred. error|", "max |pred. error|",
                     "world to world, median / max", "same split, partition() runs", "Pipeline's own plan"], rows)
            + f"\n\n{DETAIL}\n\nEvery split, predicted against measured: by `partition()`'s plan (profiled in one process "
              "before the 2-rank world starts), by the plan the `Pipeline` made for itself (both ranks "
              "profiling at once, just before the steps), and by the same cost model on profiles rank 0 took "
              "between every other round of steps, averaged (the host as fast or as slow as during the steps; "
              "`_profiled_amid` in the script), and by `partition()`'s plan calibrated to the step `autopipe.tune` "
              "measured for the split it kept, in the first world after its rounds:\n\n"
            + table(["model", "split", "measured step", "predicted step", "error", "error, profiled in the ranks",
                     "error, profiled amid the steps", "error, calibrated to tune's step", "÷ fastest"], detail))


def render_frameworks(d: dict[str, Any], behind: list[str]) -> str:
    """Per model: torchtitan's default step over autopipe's, measured at 2 stages and predicted at each count."""
    counts = sorted({r["stages"] for f in d["families"] for r in f["rows"]})
    head, rows = [], []
    for f in d["families"]:
        two = next(r for r in f["rows"] if r["stages"] == 2)
        measured = two["default_measured_s"] / two["autopipe_measured_s"]
        if measured < 1 - BEHIND_TOL:
            behind.append(f"torchtitan {f['family']}, 2 stages measured: torchtitan's default split is "
                          f"{1 / measured:.3f}x faster than autopipe's.")
        by_count = {r["stages"]: r["default_predicted_s"] / r["autopipe_predicted_s"] for r in f["rows"]}
        head.append([f["family"], ms(two["autopipe_measured_s"]), ms(two["default_measured_s"]), ratio(measured),
                     *(ratio(by_count.get(p)) for p in counts)])
        for r in f["rows"]:
            rows.append([f["family"], r["stages"], ", ".join(r["autopipe_split"]), ", ".join(r["default_split"]),
                         ms(r["autopipe_predicted_s"]), ms(r["default_predicted_s"]),
                         ms(r.get("autopipe_measured_s")), ms(r.get("default_measured_s"))])
    size = d["sizes"]
    return (f"{d['framework']}, {d['schedule']} with {size['n_microbatches']} micro-batches of {size['rows']}x"
            f"{size['seq']} tokens; width {size['dim']}, {size['layers']} layers, vocabulary {size['vocab']}. "
            "Stages built by torchtitan's `_pipeline_module_split`; ratios are torchtitan's default step ÷ "
            "autopipe's (above 1: autopipe faster).\n\n"
            + table(["model", "p=2 autopipe ms", "p=2 torchtitan ms", "p=2 measured ÷",
                     *(f"p={p} predicted ÷" for p in counts)], head)
            + f"\n\n{DETAIL}\n\n"
            + table(["model", "p", "autopipe split", "torchtitan split", "autopipe predicted ms",
                     "torchtitan predicted ms", "autopipe measured ms", "torchtitan measured ms"], rows))


def render_precision(d: dict[str, Any], behind: list[str]) -> str:
    """Per variant: the measured step, the plan's prediction and the calibrated one, with their errors."""
    rows = [[r["variant"], r["length"], ms(r["measured_s"]), ms(r["predicted_s"]), pct(r["predicted_error"]),
             ms(r.get("calibrated_s")), pct(r.get("calibrated_error"))] for r in d["rows"]]
    shape = "x".join(map(str, d["microbatch_shape"]))
    splits = "; ".join(f"{r['variant']}: {', '.join(r['split_points'])}" for r in d["rows"])
    return (f"{d['model']}, {d['schedule']} with {d['n_microbatches']} micro-batches of {shape} tokens, 2 stages. "
            "Predicted: the plan's step (at 2x length `Plan.predict_at`); calibrated: the plan with its stages "
            "timed inside running steps (`Plan.calibrate`).\n\n"
            + table(["variant", "length", "measured ms", "predicted ms", "error", "calibrated ms", "error"], rows)
            + f"\n\n{DETAIL}\n\nSplits: {splits}.")


def render_split_quality(d: dict[str, Any], behind: list[str]) -> str:
    """One row per model: autopipe's cut against the exhaustive best, and the baselines' real steps."""
    baselines = list(dict.fromkeys(k for r in d["rows"] for k in r["methods"]
                                   if k not in ("autopipe", "exhaustive_best")))
    header = ["model", "autopipe cut", "exhaustive best cut", "bottleneck ÷ best", "step ÷ best's step"] + \
             [f"{b} step ÷ autopipe's" for b in baselines] + ["within 3%?"]
    rows = []
    for r in d["rows"]:
        m = r["methods"]
        a = m["autopipe"]
        cells = [r["model"], f"`{a['split_point']}`", f"`{m['exhaustive_best']['split_point']}`",
                 ratio(a["bottleneck_vs_best"]), ratio(a.get("step_vs_best"))]
        # Each baseline's real step over autopipe's, paired round by round (split_quality/main.py).
        over_autopipe = {b: m[b]["step_vs_autopipe"] for b in baselines if "step_vs_autopipe" in m.get(b, {})}
        for b in baselines:
            cells.append(ratio(over_autopipe[b]) if b in over_autopipe else "–")
        ok_b = a["bottleneck_vs_best"] <= 1 + BEHIND_TOL
        ok_s = a.get("step_vs_best", 1.0) <= 1 + BEHIND_TOL
        cells.append("yes" if ok_b and ok_s else "**no**")
        rows.append(cells)
        if not ok_b:
            behind.append(f"split quality, {r['model']}: autopipe's measured bottleneck is {a['bottleneck_vs_best']:.3f}× "
                          f"the exhaustive best's (`{a['split_point']}` vs `{m['exhaustive_best']['split_point']}`).")
        if not ok_s:
            behind.append(f"split quality, {r['model']}: autopipe's real step is {a['step_vs_best']:.3f}× the exhaustive "
                          f"best's.")
        for b in baselines:
            x = over_autopipe.get(b)
            if x is not None and x < 1 / (1 + BEHIND_TOL):
                behind.append(f"split quality, {r['model']}: {b} (`{m[b]['split_point']}`) stepped "
                              f"{1 / x:.3f}× faster than autopipe (`{a['split_point']}`) in the real 2-rank run.")
            if b in m and m[b]["bottleneck_s"] < a["bottleneck_s"] / (1 + BEHIND_TOL):
                behind.append(f"split quality, {r['model']}: {b}'s measured bottleneck is "
                              f"{a['bottleneck_s'] / m[b]['bottleneck_s']:.3f}× lighter than autopipe's.")
    return (f"{d['schedule']} × {d['n_microbatches']} micro-batches. *Bottleneck*: the slower stage's forward + "
            "backward timed alone (no communication); *step*: the real 2-rank step, communication and runtime "
            "included, so the two can disagree. Ratios above 1 are slower than the reference.\n\n"
            + table(header, rows))


def render_split_quality_sim(d: dict[str, Any], behind: list[str]) -> str:
    """One row per model and stage count: autopipe's simulated step against the bound and the baselines."""
    baselines = list(dict.fromkeys(b for r in d["rows"] for e in r["by_stages"] for b in e.get("baselines", {})))
    # The headline shows one stage count (8 where it was run, else 2); every row goes below it.
    shown = 8 if any(e["stages"] == 8 for r in d["rows"] for e in r["by_stages"]) else 2
    rows, headline = [], []
    for r in d["rows"]:
        for e in r["by_stages"]:
            model = f"{r['model']} ({r['segments']} segments)"
            if "autopipe" not in e:
                cells = [model, e["stages"], "–", "–", "–", *("–" for _ in baselines)]
            else:
                a = e["autopipe"]
                cells = [model, e["stages"], ms(a["step_s"]), ratio(a.get("step_vs_lower_bound")),
                         ratio(a["bottleneck_vs_lower_bound"])]
                for b in baselines:
                    x = e["baselines"].get(b, {}).get("step_vs_autopipe")
                    cells.append(ratio(x))
                    if x is not None and x < 1 - BEHIND_TOL:
                        behind.append(f"simulated, {r['model']} p={e['stages']}: {b}'s predicted step is "
                                      f"{x:.3f}× autopipe's.")
            if e["stages"] == shown:
                headline.append(cells)
            rows.append([model if e is r["by_stages"][0] else "", *cells[1:]])
    header = ["model", "p", "autopipe step ms", "step ÷ bound", "bottleneck ÷ bound",
              *(f"{b} ÷ autopipe" for b in baselines)]
    return (f"{d['schedule']} with {d['microbatch_factor']}·p micro-batches, costs measured on {d['device']}. "
            "*step ÷ bound*: autopipe's step over the plan's step lower bound; *bottleneck ÷ bound*: its heaviest "
            "stage over max(total compute / p, heaviest segment); baseline columns: the baseline's step ÷ "
            f"autopipe's (above 1: autopipe faster; –: the baseline cannot make p stages). At p = {shown}:\n\n"
            + table(header, headline) + f"\n\n{DETAIL}\n\n" + table(header, rows))


PLANNER_TARGET_S = 2.0  # the exact search over 100,000 segments into 128 stages


def render_planner_scaling(d: dict[str, Any], behind: list[str]) -> str:
    """Segments × stages: median milliseconds of the exact search."""
    stages = sorted({r["stages"] for r in d["rows"]})
    segs = sorted({r["segments"] for r in d["rows"]})
    cell = {(r["segments"], r["stages"]): r["median_s"] for r in d["rows"]}
    rows = [[f"{n:,}", *(ms(cell.get((n, p))) for p in stages)] for n in segs]
    largest = cell.get((100_000, 128))
    if largest is not None and largest > PLANNER_TARGET_S:
        behind.append(f"planner scaling: 100,000 segments into 128 stages took {largest:.2f} s "
                      f"(target: under {PLANNER_TARGET_S:.0f} s).")
    return (f"Median of {d.get('repeats')} runs of `solve_bottleneck` (exact min-max search with communication "
            "and memory), in milliseconds.\n\n" + table(["segments", *(f"{p} stages" for p in stages)], rows))


def render_runtime_overhead(d: dict[str, Any], behind: list[str]) -> str:
    """Per schedule: autopipe's step, the hand-written step, and the overhead both ways."""
    rows = []
    for r in d.get("rows", []):
        rows.append([r.get("schedule"), r.get("stages_per_rank"), ms(r.get("autopipe_step_s")),
                     ms(r.get("hand_step_s")), f"{r['overhead_pct']:+.1f}%" if "overhead_pct" in r else "–",
                     f"{r['paired_overhead_pct']:+.1f}%" if "paired_overhead_pct" in r else "–", r.get("steps_each")])
        # The paired figure (each autopipe step against the hand-written step next to it) is
        # the one the benchmark trusts; the ratio of medians is the fallback.
        key = "paired_overhead_pct" if isinstance(r.get("paired_overhead_pct"), (int, float)) else "overhead_pct"
        over = r.get(key)
        if isinstance(over, (int, float)) and over > 100 * BEHIND_TOL:
            behind.append(f"runtime overhead, {r.get('schedule')}: a step through autopipe.Pipeline took "
                          f"{over:.1f}% longer ({key}) than the same pipeline written by hand with "
                          "torch.distributed.pipelining.")
    return (f"{d.get('model')}, {d.get('batch')}, {d.get('ranks')} ranks. Overhead by medians and as the median "
            "of per-round ratios (less sensitive to load drifting during the run).\n\n"
            + table(["schedule", "stages per rank", "autopipe step ms", "by hand ms", "overhead (medians)",
                     "overhead (paired)", "steps each"], rows))


# What each prediction column of prediction_accuracy uses, in short (the JSON has the long form).
COLUMNS = {
    "predicted_step_s": "the plan as made: a profile every rank took at once before the run, the machine measured once",
    "parent_profile_step_s": "the same split from a profile one process took alone, slowed by the measured contention",
    "defaults_step_s": "the profile and autopipe's defaults, nothing else measured",
    "no_overhead_step_s": "profile and measured link only: no per-action overhead, contention or lazy sends",
    "eager_sends_step_s": "the plan, with every send delivered at once (gloo's lazy sends not modelled)",
    "no_tail_step_s": "the plan, without the once-per-step tail (merged outputs, loss broadcast, tied gradients)",
    "same_time_step_s": "a profile one rank took between the rounds of steps, instead of before them",
    "in_ranks_step_s": "profiles every rank took at once between the rounds of steps",
    "contention_step_s": "each stage between its alone and together times, by how much of it another rank computes",
    "warm_cache_step_s": "a profile with the caches left warm between its passes",
    "whole_fit_step_s": "a profile with its segments scaled to the whole graph (the CUDA default)",
    "calibrated_step_s": "stage times measured alone in one process, folded in with plan.calibrate",
    "in_run_step_s": "stage times measured inside the running pipeline (Pipeline.measure_stage_times)",
}


def _column_name(c: str) -> str:
    return c.replace("_step_s", "")


#: The prediction columns docs/benchmarks.md shows; the rest are on the benchmark's RESULTS.md.
HEADLINE_COLUMNS = ("predicted_step_s", "parent_profile_step_s", "in_ranks_step_s", "calibrated_step_s")


def render_prediction_accuracy(d: dict[str, Any], behind: list[str]) -> str:
    """One row per prediction column: its error in the latest run and, pooled, over several runs."""
    s = d["summary"]
    cols = list(s.get("columns", {}))
    runs = d.get("pooled_runs")
    pooled = runs["pooled"] if runs else None
    header = ["prediction", "what it uses", "median |error|", "max |error|"]
    if pooled:
        header.append(f"pooled over {pooled['runs']} runs: median |error| (signed)")
    rows = []
    for c in cols:
        row = [f"**{_column_name(c)}**" if c == "predicted_step_s" else _column_name(c), COLUMNS.get(c, s["columns"][c]),
               apct(s.get(f"median_abs_error:{c}")), apct(s.get(f"max_abs_error:{c}"))]
        if pooled:
            p = pooled["columns"].get(c)
            row.append(f"{apct(p['median_abs_error'])} ({pct(p['median_signed_error'])})" if p else "–")
        rows.append(row)
    out = [f"Signed error = (predicted − measured) ÷ measured; negative means the plan promised a faster step "
           f"than the real pipeline delivered. **{s['run']} of {s['cases']} cases ran** in the run shown; "
           "every case's figures are in the benchmark's `results.json`. The plan's own prediction and the main "
           "alternatives (every alternative below the line):\n\n"
           + table(header, [row for c, row in zip(cols, rows) if c in HEADLINE_COLUMNS])]
    notes = []
    if pooled:
        per_run = ", ".join(apct(r["columns"]["predicted_step_s"]["median_abs_error"]) for r in runs["runs"])
        cases = pooled["columns"]["predicted_step_s"].get("cases")
        notes.append(f"**Over {pooled['runs']} full runs** ({cases} cases) the plan's own prediction has a median "
                     f"|error| of {apct(pooled['columns']['predicted_step_s']['median_abs_error'])}; per run "
                     f"{per_run}; {pooled['runs_under_target']} of {pooled['runs']} runs under the 10% target. On a "
                     "shared host the speed drifts between a model's profile and its steps, so one run's median "
                     "moves by several points with nothing changed; the pooled figure is the typical error "
                     "(`python benchmarks/prediction_accuracy/runs.py RESULTS...` pools runs).")
        head = pooled["columns"]["predicted_step_s"]["median_abs_error"]
        over = pooled["runs"] - pooled["runs_under_target"]
        if head > TARGET_ERROR or over:
            behind.append(f"prediction accuracy: the median |error| of the step-time prediction is {head:.1%} over "
                          f"every case of {pooled['runs']} full runs (target: under 10%); {over} of those runs "
                          f"had their own median above 10% (section 5).")
    else:
        head = s.get("median_abs_error:predicted_step_s")
        if head is not None and head > TARGET_ERROR:
            behind.append(f"prediction accuracy: the median |error| of the step-time prediction is {head:.1%} "
                          f"(target: under 10%) over {s['run']} real 2-rank runs; median signed error "
                          f"{s.get('median_signed_error', 0):+.1%}.")
    moved: list[str] = []  # memory and the measured machine: on the every-row page
    memory_file = Path(__file__).parent / "prediction_accuracy" / "memory.json"
    mem = json.loads(memory_file.read_text())["summary"] if memory_file.exists() else None
    if mem and mem.get("median_abs_memory_error") is not None:
        moved.append(f"Peak memory per rank (`prediction_accuracy/memory.json`, `main.py --memory-only`: plans "
                     f"from FLOP-counted costs, no step timed): median |error| "
                     f"{apct(mem['median_abs_memory_error'])}, largest {apct(mem['max_abs_memory_error'])}, "
                     f"{mem['within_10pct']} of {mem['rank_figures']} rank figures within 10% "
                     "(predicted: `plan.rank_peak_bytes`).")
        if mem["within_10pct"] < mem["rank_figures"]:
            behind.append(f"prediction accuracy: {mem['rank_figures'] - mem['within_10pct']} of {mem['rank_figures']} "
                          f"per-rank peak-memory predictions are off by more than 10% (largest "
                          f"{apct(mem['max_abs_memory_error'])}; target: every rank within 10%); section 5.")
    elif s.get("median_abs_memory_error") is not None:
        largest = s.get("max_abs_memory_error")
        moved.append(f"Peak memory per rank: median |error| {apct(s['median_abs_memory_error'])}"
                     + (f", largest {apct(largest)}" if largest is not None else "")
                     + " over every rank of every case (predicted: `plan.rank_peak_bytes`).")
    machine = d.get("measured_machine") or {}
    if machine.get("link") and machine.get("overhead"):
        link, ov = machine["link"], machine["overhead"]
        moved.append(f"The machine as measured before the run (`autopipe measure --overhead`): "
                     f"link {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s and {link['latency_s'] * 1e6:.0f} µs "
                     f"per message, {ov['action_overhead_s'] * 1e3:.2f} ms of runtime overhead per action, ranks "
                     f"computing at once {ov['concurrent_slowdown']:.2f}× as slow as alone.")
    return "\n\n".join(out + notes) + f"\n\n{DETAIL}\n\n" + "\n\n".join([*moved, table(header, rows)])


def render_schedule_memory(d: dict[str, Any], behind: list[str]) -> str:
    """Per variant and rank: the measured peak of one step and its ratio to GPipe's."""
    rows = [[r.get("variant"), r.get("n_microbatches", "–"), r.get("rank"), mib(r.get("peak_step_bytes")),
             r.get("predicted_inflight_microbatches"), ratio(r.get("vs_gpipe"))] for r in d.get("rows", [])]
    split = ", ".join(f"`{s}`" for s in d.get("split_points", []))
    return (f"{d.get('model')}, {d.get('batch')}, split at {split or '–'}. Peak: bytes the step allocates "
            "beyond what existed before it (parameters, gradients and receive buffers excluded). Rank 0:\n\n"
            + table(["variant", "micro-batches", "rank", "peak MiB", "micro-batches in flight (planner)", "÷ GPipe"],
                    [row for row in rows if row[2] == 0]) + f"\n\n{DETAIL}\n\n"
            + table(["variant", "micro-batches", "rank", "peak MiB", "micro-batches in flight (planner)", "÷ GPipe"],
                    rows))


def render_meta_planning(d: dict[str, Any], behind: list[str]) -> str:
    """Per cost source: the model's size, planning time and peak host memory, the split and its balance."""
    rows = [[r["cost"], f"{r['parameters'] / 1e9:.2f} B ({r['parameter_bytes'] / 2**30:.1f} GiB)",
             f"{r['layers']} × seq {r['seq_len']}", f"{r['planning_s']:.0f} s",
             f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", ", ".join(f"`{p}`" for p in r["split_points"]),
             f"{r['balance']:.3f}"] for r in d.get("rows", [])]
    return (f"{d.get('model')}, {d.get('stages')} stages, {d.get('schedule')}. Peak host memory: the planning "
            "process's `ru_maxrss` (one fresh process per row). Balance: the heaviest stage's forward+backward "
            "over the lightest's, by the plan's own costs.\n\n"
            + table(["costs", "parameters", "layers", "planning", "peak host memory", "split", "balance"], rows))


def render_meta_model(d: dict[str, Any], behind: list[str]) -> str:
    """Per run and rank: the parameters the rank holds and its memory, as shares of the model's parameter bytes.

    The target (each rank under 60%) is checked on the proportional share of the runs whose
    split is decided by memory or spreads the model over 4 ranks; the run split for time on
    2 ranks shows what the planner does when memory does not bind.
    """
    rows, largest = [], []  # every rank; each run's rank holding the most parameters
    for run in d.get("runs", []):
        checked = run.get("memory") is not None or run["n_ranks"] > 2
        heaviest = max(run["ranks"], key=lambda r: r["held_parameter_bytes"])
        for r in run["ranks"]:
            whole = r["parameter_bytes"]
            pss = r.get("pss_after_construction_bytes")
            rows.append([run.get("name", f"{run['n_ranks']} ranks"), r["rank"],
                         f"{r['held_parameter_bytes'] / whole:.1%}", f"{r['rss_before_bytes'] / 2**30:.2f} GiB",
                         f"{r['rss_after_construction_bytes'] / 2**30:.2f} GiB ({r['rss_after_construction_bytes'] / whole:.1%})",
                         "—" if pss is None else f"{pss / 2**30:.2f} GiB ({pss / whole:.1%})",
                         f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", f"{r['construction_s']:.0f} s"])
            if r is heaviest:
                largest.append(rows[-1])
            if checked and pss is not None and pss / whole > 0.60:
                behind.append(f"meta_model: {run.get('name')}, rank {r['rank']}'s share of resident memory after "
                              f"construction is {pss / whole:.1%} of the parameter bytes (target: under 60%)")
    first = (d.get("runs") or [{}])[0].get("ranks", [{}])[0]
    header = ["run", "rank", "parameters held", "before", "resident after construction", "share after construction",
              "peak", "construction"]
    size = f"{first.get('parameters', 0) / 1e9:.2f} B parameters, {first.get('parameter_bytes', 0) / 2**30:.2f} GiB"
    return (f"{d.get('model')}: {size}; {d.get('schedule')}, {d.get('n_microbatches')} micro-batches, planned once "
            "from counted FLOPs into a plan file that every rank loads, default init. Shares are of the whole "
            "model's parameter bytes. *Resident* is the rank's resident set (`VmRSS`); *share* is its proportional "
            "set size (`Pss`), in which a page several processes map (torch's and transformers' shared libraries, "
            "about 0.11 GiB here) counts a share in each instead of in full; *before* is the process before the "
            "pipeline is built (Python, torch, transformers, the meta model). The target, each rank under 60%, is "
            "checked on the share, for the run whose split memory decides and for 4 ranks; split for time (no "
            "memory limit), the first of 2 stages also holds the embedding, which costs no FLOPs. Each run's "
            "largest rank:\n\n"
            + table(header, largest)
            + f"\n\n{DETAIL}\n\n" + table(header, rows))


def render_trace_profile(d: dict[str, Any], behind: list[str]) -> str:
    """The wall times of tracing and profiling, beside one plain step of the model."""
    rows = [["model", d.get("model")], ["tokens per micro-batch", " × ".join(map(str, d.get("tokens", [])))],
            ["segments", d.get("segments")], ["trace (torch.export + split points)", f"{d.get('trace_s', 0):.2f} s"],
            ["profile every segment", f"{d.get('profile_s', 0):.2f} s ({d.get('warmup')} warm-up + "
                                      f"{d.get('repeats')} timed runs each)"],
            ["one forward+backward of the whole model", f"{ms(d.get('whole_model_step_s'))} ms"],
            ["sum of the segments' forward+backward", f"{ms(d.get('sum_of_segments_s'))} ms"]]
    return table(["", ""], rows)


def render_gpu_one_rank(d: dict[str, Any], behind: list[str]) -> str:
    """Per case: measured and predicted step on one GPU, the error, and the overhead per action it implies."""
    s = d["summary"]
    rows = [[r["model"], r["schedule"], r["m"], ms(r["measured_s"], 2), ms(r["predicted_s"], 2),
             pct(r["predicted_s"] / r["measured_s"] - 1), f"{r['implied_overhead_s'] * 1e6:.0f}"]
            for r in d["rows"]]
    header = ["model", "schedule", "m", "measured ms", "predicted ms", "error", "implied overhead per action µs"]
    err = s["median_abs_error_no_overhead"]
    if err > TARGET_ERROR:
        behind.append(f"one GPU ({s['device']}): the plan's step is off by {err * 100:.0f}% (median |error|, "
                      f"m = {s['check_m']}; target 10%); section 8.")
    return (f"Median |error| at m = {s['check_m']}: {err * 100:.1f}% as planned (no per-action overhead, the CUDA "
            f"default), {s['median_abs_error_fitted'] * 100:.1f}% with one overhead per action fitted on "
            f"m = {s['fit_m']} ({s['overhead_fitted_s'] * 1e6:.0f} µs). At m = {s['check_m']}, 1F1B:\n\n"
            + table(header, [row for row in rows if row[2] == s["check_m"] and row[1] == "1F1B"])
            + f"\n\n{DETAIL}\n\n"
            + table(header, rows))


def render_models(d: dict[str, Any], behind: list[str]) -> str:
    """The counts of benchmarks/models; its table is a page of its own (docs/models.md)."""
    s = d["summary"]
    failing = s.get("failing", [])
    if failing:
        behind.append(f"third-party models: {len(failing)} of {len(d['rows'])} stock models fail a plan, the runtime "
                      f"or the 2-rank step ({', '.join(failing)}); see [models.md](models.md).")
    return (f"{len(d['rows'])} stock models from transformers, diffusers, torchvision and timm at their default "
            f"settings: **{s['works']} work end to end** (every plan at 2 and 4 stages runs; the 2-rank 1F1B step "
            f"matches the unsplit model), {s['fails']} fail somewhere, {s['skipped']} were not run here (package), "
            f"{s['unsupported']} cannot work (torch.export). Model by model: [models.md](models.md).")


def render_generic(d: dict[str, Any], behind: list[str]) -> str:
    """Any other benchmark: its scalar fields, and its rows as a table of their scalar columns."""
    out = []
    scalars = [[k, v] for k, v in d.items() if k not in ("machine", "rows", "benchmark") and isinstance(v, (int, float, str))]
    if scalars:
        out.append(table(["field", "value"], scalars))
    rows = d.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float, str, bool, type(None)))][:10]

        def fmt(v: Any) -> str:
            return f"{v:.4g}" if isinstance(v, float) else str(v)

        out.append(table(keys, [[fmt(r.get(k)) for k in keys] for r in rows]))
    return "\n\n".join(out) or "(no tabular results)"


def render_recompute(d: dict[str, Any], behind: list[str]) -> str:
    """Per variant: split, recomputing stages, micro-batches, predicted and measured step, each against the planner's."""
    rows = [[v["label"], ", ".join(f"`{p}`" for p in v["split_points"]),
             ", ".join(map(str, v["recompute"])) or "none", v["n_microbatches"], ms(v["predicted_step_s"]),
             ms(v["measured_step_s"]), ratio(v.get("predicted_vs_planner")), ratio(v.get("measured_vs_planner"))]
            for v in d.get("variants", [])]
    won = d.get("mixed_beats_both_at_same_m", {})
    if not (won.get("predicted") and won.get("measured")):
        behind.append("recomputation: the planner's mixed choice does not beat both checkpointing every stage and "
                      "the best plan without recomputation at the same micro-batch count, predicted and measured; "
                      "section 11.")
    verdict = {(True, True): "beats both, predicted and measured",
               (True, False): "beats both as predicted, not as measured",
               (False, True): "beats both as measured, not as predicted",
               (False, False): "does not beat both"}[(bool(won.get("predicted")), bool(won.get("measured")))]
    return (f"{d.get('model')}, 2 gloo ranks on CPU, {d.get('schedule')}, costs {d.get('cost', 'measured')}; memory "
            f"{mib(d.get('memory_per_device_bytes'))} MiB per device. At {d.get('n_microbatches')} micro-batches the "
            f"planner's choice {verdict}. Measured: {d.get('measure')}.\n\n"
            + table(["variant", "split", "recomputes", "micro-batches", "predicted ms", "measured ms",
                     "predicted ÷ planner", "measured ÷ planner"], rows))


def render_scale_study(d: dict[str, Any], behind: list[str]) -> str:
    """Per model and GPU count: the pp x dp layout chosen, its step, throughput, memory; then against torchtitan."""
    def gb(x: float | None) -> str:
        return "–" if x is None else f"{x / 1e9:.0f} GB"

    rows = []
    for r in d.get("rows", []):
        tt = (r.get("torchtitan") or {}).get("layout", "–")
        if not r.get("fits", True):
            rows.append([r["model"], r["n_gpus"], "none fits", "", "", "", "", "", f"needs {gb(r['least_memory_bytes'])}",
                         tt])
            continue
        rows.append([r["model"], r["n_gpus"], f"{r['pp']} × {r['dp']} {r['dp_mode'] or ''}", r["schedule"],
                     r["n_microbatches"], f"{len(r.get('recompute_stages', []))} of {r['pp']}",
                     f"{r['step_s']:.2f} s", f"{r['tokens_per_s_per_gpu']:,.0f}",
                     f"{r['peak_bytes'] / 1e9:.1f} / {r['memory_bytes'] / 1e9:.0f} GB", tt])
    models = {m["model"]: m for m in d.get("models", [])}
    sizes = "; ".join(f"{m['model']}: {m['parameters'] / 1e9:.2f} B parameters, {m['segments']} segments, "
                      f"{gb(m.get('act_bytes_per_microbatch'))} of saved activations per 8192-token sequence"
                      for m in models.values() if m["model"] != "tiny")
    header = ["model", "GPUs", "pp × dp", "schedule", "micro-batches", "stages recomputing", "step", "tokens/s/GPU",
              "peak memory", "torchtitan"]
    out = [f"{d.get('machine_simulated')}; FLOP-counted costs, {d.get('seq_per_gpu')} sequences per GPU per step, "
           f"schedule {d.get('schedule')}. Predicted, not measured. {sizes}. The sizes torchtitan reports a layout "
           "for:", table(header, [row for row in rows if row[-1] != "–"])]
    tp_header, tp_rows = _scale_study_layouts(d)
    if tp_rows:
        out += ["With tensor parallelism and per-block checkpointing allowed (`autopipe.layouts`, the shape read "
                "from each model's traced graph; same GPU counts and batch, on torchtitan's own H100 part (96 GB "
                "HBM2e, 500 W) at the shares fitted in benchmark 14, not the flat 40% of an 80 GB H100 above, so the "
                "two tables' throughputs are not comparable), at the sizes torchtitan reports:",
                table(tp_header, [row for row in tp_rows if row[-1] != "–"])]
    against = [_against_torchtitan(r) for r in d.get("rows", []) if r.get("torchtitan")]
    detail = []
    if against:  # every row's page: the reasoning behind each comparison
        detail.append("**Against torchtitan's layouts.** autopipe composes pipeline and data parallelism only: "
                      "a tensor-parallel degree of torchtitan's is matched here by as many pipeline stages. "
                      "autopipe recomputes whole stages (a recomputing stage holds all of one micro-batch's "
                      "activations while it recomputes), where torchtitan checkpoints each Transformer block.\n\n"
                      + "\n".join(f"- {line}" for line in against))
    every = [*detail, table(header, rows)] + ([table(tp_header, tp_rows)] if tp_rows else [])
    return "\n\n".join(out) + f"\n\n{DETAIL}\n\n" + "\n\n".join(every)


def _scale_study_layouts(d: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The tensor-parallel table of the scale study: each GPU count's searched layout beside pp x dp's."""
    header = ["model", "GPUs", "layout (autopipe.layouts)", "tokens/s/GPU", "MFU", "memory", "torchtitan"]
    pp_dp = {(r["model"], r["n_gpus"]): r for r in d.get("rows", [])}
    rows = []
    for r in d.get("layouts", []):
        twin = pp_dp.get((r["model"], r["n_gpus"]), {})
        tt = (twin.get("torchtitan") or {}).get("layout", "–")
        if not r.get("fits"):
            rows.append([r["model"], r["n_gpus"], "none fits", "", "", "", tt])
            continue
        rows.append([r["model"], r["n_gpus"], r["describe"], f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}",
                     f"{r['memory_bytes'] / 1e9:.0f} GB", tt])
    return header, rows


def render_published_layouts(d: dict[str, Any], behind: list[str]) -> str:
    """The held-out error, the fitted shares, then every row: published, predicted, and autopipe's own layout."""
    summary = d.get("summary", {})
    held = summary.get("median_abs_error_held_out")
    worst = summary.get("max_abs_error_held_out")
    ratio = summary.get("interleaved_over_1f1b")
    shares = ", ".join(f"{k} {v:.2f}" for k, v in (summary.get("fitted_shares") or {}).items()) or "the defaults"
    lines = [f"Held out: {summary.get('held_out_rows')} rows, median |error| {apct(held)}, worst {apct(worst)} "
             f"(targets: 10% and 25%). Fitted on {len(summary.get('fit_rows', []))} rows "
             f"({', '.join(summary.get('fit_rows', []))}): {shares}."]
    if ratio:
        lines.append(f"torchtitan's Interleaved 1F1B over 1F1B (Table 5): published {ratio['published']:.2f}, "
                     f"predicted {ratio['predicted']:.2f} ({apct(ratio['predicted'] / ratio['published'] - 1)} off; "
                     "target 10%).")
        if abs(ratio["predicted"] / ratio["published"] - 1) > 0.10:
            behind.append(f"published_layouts: torchtitan's Interleaved/1F1B ratio is predicted "
                          f"{ratio['predicted']:.2f}, published {ratio['published']:.2f}")
    if held is not None and (held > 0.10 or (worst or 0) > 0.25):
        behind.append(f"published_layouts: held-out median |error| {apct(held)}, worst {apct(worst)}")
    header = ["run", "", "published layout", "published", "predicted", "error", "memory error", "autopipe's layout",
              "× published", "what holds the published one back"]
    rows = []
    for r in d.get("rows", []):
        own = r.get("own", {})
        unit = {"iteration_s": "s/step", "tokens_per_s_per_gpu": "tokens/s/GPU",
                "megatron_tflops_per_gpu": "TFLOP/s/GPU", "model_tflops_per_gpu": "model TFLOP/s/GPU"}.get(r["published"]["unit"], r["published"]["unit"])
        rows.append([r["id"], "fit" if r["fit"] else "held out", r["layout"],
                     f"{r['published']['value']:,g} {unit}", f"{r['predicted']:,.4g}", pct(r["error"]),
                     pct(r.get("memory_error")) if r.get("memory_error") is not None else "–",
                     own.get("layout", "–"), ratio_x(own.get("speedup_over_published")),
                     own.get("why_published_is_slower") or "–"])
    sources = sorted({r["source"] for r in d.get("rows", [])})
    families: dict[str, list[dict[str, Any]]] = {}
    for r in d.get("rows", []):
        families.setdefault(r["id"].split("-")[0], []).append(r)
    short = table(["source", "rows (held out)", "median |error| held out", "worst held out",
                   "autopipe's layout × published (median)"],
                  [[name, f"{len(rs)} ({sum(not r['fit'] for r in rs)})",
                    apct(_median([abs(r["error"]) for r in rs if not r["fit"]])),
                    apct(max((abs(r["error"]) for r in rs if not r["fit"]), default=None)),
                    ratio_x(_median([r["own"]["speedup_over_published"] for r in rs if r.get("own")]))]
                   for name, rs in families.items()])
    return ("\n\n".join(lines) + "\n\n" + short + f"\n\n{DETAIL}\n\n" + table(header, rows) + "\n\nSources: "
            + "; ".join(sources) + ". Each row's assumptions are in `benchmarks/published_layouts/rows.json`.")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def render_retrace_memory(d: dict[str, Any], behind: list[str]) -> str:
    """One line: each rank's resident memory and linecache entries after warm-up and at the end."""
    return f"After {d.get('steps')} steps: " + "; ".join(
        f"rank {r['rank']}, resident memory {r['rss_after_warmup_mb']:.1f} MB after warm-up, "
        f"{r['rss_end_mb']:.1f} MB at the end (+{r['growth_after_warmup_mb']:.1f} MB), linecache entries "
        f"{r['linecache_after_warmup']} then {r['linecache_end']}" for r in d.get("summary", [])) + "."


def render_layout_search_speed(d: dict[str, Any], behind: list[str]) -> str:
    """Per case: the phases' seconds, the peak memory and the layout found."""
    rows = [[r["case"], f"{r['gpus']:,}", f"{r['build_s'] + r['trace_s']:.1f} s", f"{r['search_s']:.2f} s",
             f"{r['total_s']:.1f} s", f"{r['peak_rss_bytes'] / 2**30:.2f} GiB", f"{r['layouts_considered']:,}", r["best"]]
            for r in d.get("rows", [])]
    return table(["case", "GPUs", "build and trace", "search", "total", "peak memory", "layouts", "best"], rows)


def render_tensor_parallel(d: dict[str, Any], behind: list[str]) -> str:
    """pp 2 and tp 2: measured and predicted steps; the tensor-parallel collectives, counted and timed."""
    c = d["collectives"]
    steps = "; ".join(f"{name}: {ms(d[key]['measured_s'])} ms measured, {ms(d[key]['predicted_s'])} ms predicted "
                      f"({pct(d[key]['predicted_s'] / d[key]['measured_s'] - 1)})" for name, key in (("pp 2", "pp"),
                                                                                                    ("tp 2", "tp")))
    if d["tp"]["predicted_s"] < 0.75 * d["tp"]["measured_s"]:
        behind.append(f"tensor parallel: a tp 2 step on gloo is predicted {ms(d['tp']['predicted_s'])} ms, measured "
                      f"{ms(d['tp']['measured_s'])} ms (section 16)")
    return (f"{steps}. tp 2 over pp 2: {d['tp_over_pp_measured']:.2f}× measured, {d['tp_over_pp_predicted']:.2f}× "
            f"predicted. Per tp step {sum(c['counted'].values())} all-reduces counted, {c['allreduces_charged']} "
            f"charged; one all-reduce of a block's activation ({c['message_bytes'] / 1024:.0f} KiB) takes "
            f"{c['allreduce_measured_s'] * 1e6:.0f} µs on gloo (median), charged {c['allreduce_charged_s'] * 1e6:.0f} "
            f"µs over the measured link. Left unexplained by compute and the measured all-reduces: "
            f"{ms(d['tp_unexplained_s'])} ms of the tp step." + _sequence_parallel(d))


def _sequence_parallel(d: dict[str, Any]) -> str:
    """The tp 2 step with sequence parallelism and the vocabulary-sharded output, where the run has it."""
    sp = d.get("tp_sp")
    if not sp:
        return ""
    names = {"reduce_scatter_tensor": "reduce-scatters", "all_gather_into_tensor": "all-gathers",
             "all_reduce": "all-reduces"}
    counted = ", ".join(f"{n} {names.get(k, k)}" for k, n in sorted(sp["collectives_counted"].items()))
    return (f" With sequence parallelism and `loss_parallel` (as layouts are charged), tp 2 steps in "
            f"{ms(sp['measured_s'])} ms ({sp['measured_s'] / d['tp']['measured_s']:.2f}× tp 2), counting {counted}.")


def ratio_x(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _against_torchtitan(r: dict[str, Any]) -> str:
    """One line: torchtitan's layout at this size, autopipe's choice, and how autopipe's model rates torchtitan's."""
    tt = r["torchtitan"]
    pp = tt["pp"] * tt["tp"]  # no tensor parallelism in autopipe: its ranks become pipeline stages
    twin = next((a for a in r["alternatives"] if a["pp"] == pp and a["mode"] in ("fsdp", "")), None)
    head = f"{r['model']} on {r['n_gpus']} GPUs: torchtitan runs {tt['layout']} ({tt['source']}); "
    if not r.get("fits", True):
        head += f"no pp × dp layout fits 80 GB in autopipe's model (the least needs {r['least_memory_bytes'] / 1e9:.0f} GB)"
    else:
        head += f"autopipe chose pp={r['pp']} × dp={r['dp']} {r['dp_mode'] or ''} ({r['step_s']:.2f} s)"
    if twin is None:
        return head + "."
    name = f"pp={twin['pp']} × dp={twin['dp']}{' fsdp' if twin['mode'] else ''}"
    if twin["fits"] and r.get("fits", True) and (twin["pp"], twin["dp"]) != (r["pp"], r["dp"]):
        return head + f"; its {name} is predicted {twin['step_s'] / r['step_s'] - 1:.0%} slower ({twin['step_s']:.2f} s)."
    if twin["fits"]:
        return head + f"; the same layout as torchtitan's {name}."
    need = twin.get("min_memory_bytes")
    if need:
        return head + f"; its {name} does not fit: it needs {need / 1e9:.0f} GB per GPU, recomputing whole stages."
    return head + f"; its {name} {twin['reason'][:240].rstrip('.')}."


RENDERERS: dict[str, Callable[[dict[str, Any], list[str]], str]] = {
    "peers": render_peers,
    "real_steps": render_real_steps,
    "frameworks": render_frameworks,
    "precision": render_precision,
    "split_quality": render_split_quality,
    "split_quality_sim": render_split_quality_sim,
    "planner_scaling": render_planner_scaling,
    "runtime_overhead": render_runtime_overhead,
    "prediction_accuracy": render_prediction_accuracy,
    "schedule_memory": render_schedule_memory,
    "trace_profile": render_trace_profile,
    "gpu_one_rank": render_gpu_one_rank,
    "models": render_models,
    "meta_planning": render_meta_planning,
    "meta_model": render_meta_model,
    "recompute": render_recompute,
    "scale_study": render_scale_study,
    "published_layouts": render_published_layouts,
    "layout_search_speed": render_layout_search_speed,
    "tensor_parallel": render_tensor_parallel,
    "retrace_memory": render_retrace_memory,
}


# --------------------------------------------------------------------------- page


def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Benchmark name -> its ``results.json`` (with ``runs.json`` as ``pooled_runs`` where present)."""
    found = {}
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        f = folder / "results.json"
        if not f.exists():
            continue
        try:
            data = json.loads(f.read_text())
            runs = folder / "runs.json"  # several runs pooled (prediction_accuracy/runs.py)
            if runs.exists():
                data["pooled_runs"] = json.loads(runs.read_text())
        except json.JSONDecodeError as e:
            data = {"error": f"unreadable results.json: {e}"}
        found[folder.name] = data
    return found


def render(results_dir: Path) -> tuple[str, dict[str, str]]:
    """The whole page for the results under ``results_dir``, and each benchmark's every-row page by name."""
    results = load_results(results_dir)
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER)
    behind: list[str] = []
    sections = []
    details: dict[str, str] = {}
    for name in names:
        data = results[name]
        about = ABOUT.get(name) or readme_question(results_dir / name) or ""
        readme = f"../benchmarks/{name}/README.md"
        options = RERUN_OPTIONS.get(name, "`--quick` for a short run, `--device cuda` on a GPU")
        body = [f"## {TITLES.get(name, name.replace('_', ' ').capitalize())}", "", about, "",
                f"Rerun: `python benchmarks/{name}/main.py` ({options}); method: "
                f"[{readme.removeprefix('../')}]({readme})."]
        if "error" in data and len(data) == 1:
            body.append(f"\n{data['error']}")
        else:
            body[-1] += " " + machine_line(data)  # one paragraph: how to rerun it, where it ran
            try:
                headline, _, rows = RENDERERS.get(name, render_generic)(data, behind).partition(DETAIL)
                body.append("\n" + headline.rstrip())
                if rows.strip():
                    details[name] = f"{machine_line(data)}\n\n{rows.strip()}\n"
                    body.append(f"\nEvery row: [benchmarks/{name}/RESULTS.md](../benchmarks/{name}/RESULTS.md).")
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a format this renderer does not know
                body.append(f"\n(could not render results.json: {type(e).__name__}: {e})\n\n"
                            + render_generic(data, behind))
        sections.append("\n".join(body))
    missing = [n for n in ORDER if n not in results]
    head = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/render_docs.py` from benchmarks/*/results.json; edit the scripts, "
        "not this page. -->",
        "",
        "Current results of the scripts in `benchmarks/`; each folder's README says what it measures and how. "
        "The scripts never assert on a time: they report medians of interleaved runs and ratios measured within "
        "one run. Each section names the machine it ran on. On a shared machine timings are noisy: compare ratios "
        "within a section, not milliseconds across sections. What these measurements taught about the cost model "
        "is in [design.md](design.md). "
        "`python benchmarks/run_all.py` runs them all, one after another (`--only NAME ...` for some), and "
        "`python benchmarks/render_docs.py` rewrites this page and each benchmark's RESULTS.md (every row of "
        "the tables shown here in part).",
    ]
    if missing:
        head += ["", "Not run yet: " + ", ".join(f"`{n}`" for n in missing) + "."]
    head += ["", "## Where autopipe is behind", ""]
    if behind:
        head += [f"* {b}" for b in behind]
    else:
        head += ["Nowhere in these results: autopipe's split is within 3% of the exhaustive best and no baseline "
                 "beats it by more than 3%, and the median step-time error is under 10%."]
    return "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n", details


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and write the page."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE), help="folder holding <benchmark>/results.json")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args(argv)
    text, details = render(Path(args.results))
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    for name, rows in details.items():
        out = Path(args.results) / name / "RESULTS.md"
        title = TITLES.get(name, name.replace("_", " ").capitalize())
        out.write_text(f"# {title}: every row\n\n<!-- Generated by `python benchmarks/render_docs.py` from "
                       f"results.json beside this file; the headline is in docs/benchmarks.md. -->\n\n{rows}")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
