"""Render every benchmark's JSON results into ``docs/benchmarks.md``.

Reads ``<results>/<benchmark>/results.json`` for each benchmark folder (the full runs;
``results_quick.json`` is used, and labelled, only where no full run exists), and writes
one Markdown page: how to rerun each benchmark, the machine each ran on, the tables, and -
computed from the numbers, not written by hand - where autopipe is behind a baseline or
misses a target. Unknown benchmarks (a folder with a results.json this script has no
renderer for) are shown generically, so a new benchmark appears without editing this file.

    python benchmarks/render_docs.py                  # benchmarks/*/results.json -> docs/benchmarks.md
    python benchmarks/render_docs.py --results DIR --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the checkout's autopipe, for its defaults

# Order of the page; anything else found is appended.
ORDER = ("split_quality", "split_quality_sim", "planner_scaling", "runtime_overhead", "prediction_accuracy",
         "schedule_memory", "trace_profile", "gpu_one_rank", "models")
TITLES = {
    "split_quality": "1. Split quality, measured (2 stages, real pipelines)",
    "split_quality_sim": "2. Split quality at scale, simulated from measured segment costs",
    "planner_scaling": "3. Planner scaling",
    "runtime_overhead": "4. Runtime overhead of autopipe.Pipeline",
    "prediction_accuracy": "5. Prediction accuracy: predicted vs measured step time and memory",
    "schedule_memory": "6. Schedule memory",
    "trace_profile": "7. Trace and profile time",
    "gpu_one_rank": "8. One GPU: the plan's step against torch's runtime on a single rank",
    "models": "9. Third-party models: plans, runtime and 2-rank pipelines",
}
RERUN_OPTIONS = {"gpu_one_rank": "needs one GPU; `--device cpu` runs it on the CPU",
                 "models": "renders docs/models.md too; `--quick` skips the 2-rank pipelines"}
BASELINES = ("equal_layers", "balanced_params", "block_partition")
BEHIND_TOL = 0.03  # a ratio within 3% counts as a tie: the target and about the run-to-run noise


# --------------------------------------------------------------------------- formatting


def ms(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x * 1e3:.{digits}f}"


def ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1%}"


def mib(x: float | None) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    host = data.get("host_end") or data.get("host_start") or data.get("host") or {}
    cpu = host.get("cpu_model") or m.get("cpu")
    parts = [f"{cpu}, {m.get('cores')} cores" if m.get("cores") else str(cpu),
             f"CUDA: {m['cuda']}" if m.get("cuda") else "no GPU",
             f"torch {m.get('torch')}", f"Python {m.get('python')}",
             f"{data.get('threads_per_process', data.get('threads', m.get('torch_threads')))} torch thread(s) per process"]
    if parts[-1].startswith("None "):  # not recorded
        parts.pop()
    loads = [h.get("load_avg") for h in (data.get("host_start"), data.get("host_end"), data.get("host"))
             if isinstance(h, dict) and h.get("load_avg")]
    if loads:
        parts.append("load average (1/5/15 min) " + " → ".join("/".join(f"{x:.1f}" for x in la) for la in loads))
    par = data.get("parallel_efficiency")
    if isinstance(par, dict) and par.get("together_over_alone"):
        parts.append(f"two processes computing at once each took {par['together_over_alone']:.2f}× as long as one "
                     "alone (1.00 = truly parallel)")
    parts.append(f"run {m.get('date')}")
    if data.get("wall_s"):
        parts.append(f"took {data['wall_s']:.0f} s")
    return "*Machine:* " + "; ".join(parts) + "."


# --------------------------------------------------------------------------- renderers


def render_split_quality(d: dict[str, Any], behind: list[str]) -> str:
    out = []
    sched = f"{d['schedule']} × {d['n_microbatches']} micro-batches"
    scan = "every legal split point" if d.get("exhaustive") else \
        f"every legal split point, walking out from autopipe's (a side stops once its growing stage exceeds {d.get('prune_slack')}× the best three times running)"
    out.append(f"2 stages, {sched}. Stage times: each stage's forward + backward measured in one process "
               f"(median of interleaved repeats); the exhaustive best is the lowest measured bottleneck over {scan}. "
               "Step: median of a real 2-rank `autopipe.Pipeline` step (gloo, 127.0.0.1), all splits of a model "
               "interleaved in rounds. Ratios > 1 mean slower than the reference.")
    header = ["model", "autopipe cut", "exhaustive best cut", "bottleneck ÷ best", "step ÷ best's step"] + \
             [f"{b} step ÷ autopipe's" for b in BASELINES] + ["within 3%?"]
    rows = []
    for r in d["rows"]:
        m = r["methods"]
        a = m["autopipe"]
        cells = [r["model"], f"`{a['split_point']}`", f"`{m['exhaustive_best']['split_point']}`",
                 ratio(a["bottleneck_vs_best"]), ratio(a.get("step_vs_best"))]
        for b in BASELINES:
            cells.append(ratio(m[b]["step_s"] / a["step_s"]) if b in m and "step_s" in m[b] and "step_s" in a else "–")
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
        for b in BASELINES:
            if b in m and "step_s" in m[b] and "step_s" in a and m[b]["step_s"] < a["step_s"] / (1 + BEHIND_TOL):
                behind.append(f"split quality, {r['model']}: {b} (`{m[b]['split_point']}`) stepped "
                              f"{a['step_s'] / m[b]['step_s']:.3f}× faster than autopipe (`{a['split_point']}`) "
                              "in the real 2-rank run.")
            if b in m and m[b]["bottleneck_s"] < a["bottleneck_s"] / (1 + BEHIND_TOL):
                behind.append(f"split quality, {r['model']}: {b}'s measured bottleneck is "
                              f"{a['bottleneck_s'] / m[b]['bottleneck_s']:.3f}× lighter than autopipe's.")
    out.append(table(header, rows))
    for r in d["rows"]:
        detail = [[k, f"`{m['split_point']}`", ms(m.get("predicted_bottleneck_s"), 2), ms(m["stage_s"][0], 2),
                   ms(m["stage_s"][1], 2), ratio(m["bottleneck_vs_best"]), ms(m.get("step_s")),
                   ratio(m.get("step_vs_best"))] for k, m in r["methods"].items()]
        out.append(f"<details><summary>{r['model']}: {r['why']}; {r['candidates']} legal split points, "
                   f"{r['measured_candidates']} measured</summary>\n\n"
                   + table(["method", "split point", "predicted bottleneck ms", "stage 0 ms", "stage 1 ms",
                            "bottleneck ÷ best", "step ms", "step ÷ best"], detail) + "\n\n</details>")
    return "\n\n".join(out)


def render_split_quality_sim(d: dict[str, Any], behind: list[str]) -> str:
    out = [f"{d['schedule']} with {d['microbatch_factor']}·p micro-batches, segment costs measured once on "
           f"{d['device']}; every figure below is the cost model's (simulated) prediction. *step ÷ bound*: autopipe's "
           "simulated step over the plan's step lower bound; *bottleneck ÷ bound*: its heaviest stage over "
           "max(total compute / p, heaviest segment). Baseline columns: baseline's simulated step ÷ autopipe's "
           "(> 1: autopipe faster; – : the baseline cannot make p stages)."]
    for r in d["rows"]:
        rows = []
        for e in r["by_stages"]:
            if "autopipe" not in e:
                rows.append([e["stages"], "–", "–", "–", "–", *("–" for _ in BASELINES)])
                continue
            a = e["autopipe"]
            cells = [e["stages"], ms(a["step_s"], 2), ms(e.get("step_lower_bound_s"), 2), ratio(a.get("step_vs_lower_bound")),
                     ratio(a["bottleneck_vs_lower_bound"])]
            for b in BASELINES:
                x = e["baselines"].get(b, {}).get("step_vs_autopipe")
                cells.append(ratio(x))
                if x is not None and x < 1 - BEHIND_TOL:
                    behind.append(f"simulated, {r['model']} p={e['stages']}: {b}'s predicted step is {x:.3f}× autopipe's.")
            rows.append(cells)
        out.append(f"**{r['model']}** ({r['segments']} segments)\n\n" + table(
            ["p", "autopipe step ms", "step bound ms", "step ÷ bound", "bottleneck ÷ bound",
             *(f"{b} ÷ autopipe" for b in BASELINES)], rows))
    return "\n\n".join(out)


def render_planner_scaling(d: dict[str, Any], behind: list[str]) -> str:
    stages = sorted({r["stages"] for r in d["rows"]})
    segs = sorted({r["segments"] for r in d["rows"]})
    cell = {(r["segments"], r["stages"]): r["median_s"] for r in d["rows"]}
    rows = [[f"{n:,}", *(ms(cell.get((n, p)), 1) if (n, p) in cell else "–" for p in stages)] for n in segs]
    return (f"Median of {d.get('repeats')} runs of `solve_bottleneck` (exact min-max search with communication and "
            "memory), in milliseconds.\n\n" + table(["segments", *(f"{p} stages" for p in stages)], rows))


def render_trace_profile(d: dict[str, Any], behind: list[str]) -> str:
    rows = [["model", d.get("model")], ["tokens per micro-batch", " × ".join(map(str, d.get("tokens", [])))],
            ["segments", d.get("segments")], ["trace (torch.export + split points)", f"{d.get('trace_s', 0):.2f} s"],
            ["profile every segment", f"{d.get('profile_s', 0):.2f} s ({d.get('warmup')} warm-up + {d.get('repeats')} timed runs each)"],
            ["one forward+backward of the whole model", f"{ms(d.get('whole_model_step_s'))} ms"],
            ["sum of the segments' forward+backward", f"{ms(d.get('sum_of_segments_s'))} ms"]]
    return table(["", ""], rows)


def render_prediction_runs(runs: dict[str, Any], shown_is_one: bool) -> str:
    """The prediction benchmark over several runs (``prediction_accuracy/runs.py``'s ``runs.json``);
    ``shown_is_one``: the single run rendered above is one of them."""
    shown = ("predicted_step_s", "parent_profile_step_s", "in_ranks_step_s", "same_time_step_s", "in_run_step_s")
    def cells(columns: dict[str, Any]) -> list[str]:
        return [f"{pct(columns[c]['median_abs_error']).lstrip('+')} ({pct(columns[c]['median_signed_error'])})"
                if c in columns else "–" for c in shown]

    rows = [[r["label"], str(r["run"]), *cells(r["columns"]),
             pct(r.get("median_abs_memory_error")).lstrip("+")] for r in runs["runs"]]
    pooled = runs["pooled"]
    rows.append([f"**all {pooled['runs']} runs pooled**", str(pooled["columns"]["predicted_step_s"]["cases"]),
                 *cells(pooled["columns"]), ""])
    return (f"**Over {pooled['runs']} full runs** with the same code (`python benchmarks/prediction_accuracy/runs.py "
            f"RESULTS...`; the table above is {'one of them' if shown_is_one else 'not among them'}): median |error| "
            f"(median signed error) of the plan's own "
            f"prediction and of the columns that locate its error. On this shared host the speed drifts between a "
            f"model's profile and its steps, and all eight plans of a model share that drift, so one run's median "
            f"moves by several points with nothing changed; the pooled figure is the typical error. Runs under the "
            f"10% target: {pooled['runs_under_target']} of {pooled['runs']}.\n\n"
            + table(["run", "cases", *(c.replace("_step_s", "") for c in shown), "memory"], rows))


def render_prediction_accuracy(d: dict[str, Any], behind: list[str]) -> str:
    s = d["summary"]
    cols = list(s.get("columns", {}))
    out = ["Signed error = (predicted − measured) ÷ measured; negative means the plan promised a faster step "
           "than the real pipeline delivered. Columns, each adding one measurement to the plan's own prediction:\n\n"
           + "\n".join(f"* **{c.replace('_step_s', '')}**: {s['columns'][c]}" for c in cols)]
    summary_rows = [[c.replace("_step_s", ""), f"{s[f'median_abs_error:{c}']:.1%}" if s.get(f"median_abs_error:{c}") is not None else "–",
                     f"{s[f'max_abs_error:{c}']:.1%}" if s.get(f"max_abs_error:{c}") is not None else "–"] for c in cols]
    out.append(f"**{s['run']} of {s['cases']} cases ran.** Median |error| of each prediction:\n\n"
               + table(["prediction", "median |error|", "max |error|"], summary_rows))
    if s.get("median_abs_memory_error") is not None:
        out.append(f"Peak memory per rank: median |error| {s['median_abs_memory_error']:.1%} over every rank of every case "
                   "(predicted `plan.extras['rank_peak_bytes']`; measured: parameters, buffers and Adam state alive "
                   "before a steady-state step + the high-water mark of tensor storage the step allocates).")
    diag = [
        ("stage forward + backward timed alone in one process ÷ the profile's", s.get("median_measured_stage_over_profile")),
        ("… forward only", s.get("median_stage_fwd_over_profile")),
        ("… backward only", s.get("median_stage_bwd_over_profile")),
        ("the same stages running generated code instead of the fx Interpreter ÷ the profile's",
         s.get("median_codegen_stage_over_profile")),
        ("stage compute inside the running pipeline (`Pipeline.measure_stage_times`) ÷ timed alone",
         s.get("median_contention_factor")),
    ]
    if any(v is not None for _, v in diag):
        out.append("Where the time goes (medians over the cases):\n\n"
                   + table(["ratio", "median"], [[k, ratio(v)] for k, v in diag]))
    runs = d.get("pooled_runs")
    if runs is not None:
        shown = [r["errors"] for r in d["rows"] if "errors" in r]
        out.append(render_prediction_runs(runs, shown_is_one=any(
            [c["errors"] for c in run["cases_errors"]] == shown for run in runs["runs"])))
        pooled = runs["pooled"]
        head = pooled["columns"]["predicted_step_s"]["median_abs_error"]
        over = pooled["runs"] - pooled["runs_under_target"]
        if head > 0.10 or over:
            behind.append(f"prediction accuracy: the median |error| of the step-time prediction is {head:.1%} over "
                          f"every case of {pooled['runs']} full runs (target: under 10%); {over} of those runs "
                          f"had their own median above 10% (section 5).")
    else:
        head = s.get("median_abs_error:predicted_step_s")
        if head is not None and head > 0.10:
            behind.append(f"prediction accuracy: the median |error| of the step-time prediction is {head:.1%} "
                          f"(target: under 10%) over {s['run']} real 2-rank runs; median signed error "
                          f"{s.get('median_signed_error', 0):+.1%}.")
    rows = []
    for r in d["rows"]:
        if "errors" not in r:
            rows.append([r["model"], r["schedule"], r["n_microbatches"], ms(r["predicted_step_s"]), "not run: "
                         + r.get("not_run", "?")[:80], *("" for _ in cols[1:]), "", "", ""])
            continue
        e = r["errors"]
        rows.append([r["model"], r["schedule"], r["n_microbatches"], ms(r["predicted_step_s"]), ms(r["measured_step_s"]),
                     *(pct(e.get(c)) for c in cols),
                     " / ".join(mib(x) for x in r.get("predicted_peak_bytes", [])),
                     " / ".join(mib(x) for x in r.get("measured_peak_bytes", [])),
                     " / ".join(pct(x) for x in r.get("memory_error", []))])
    out.append("Every case:\n\n" + table(
        ["model", "schedule", "m", "predicted ms", "measured ms", *(f"error: {c.replace('_step_s', '')}" for c in cols),
         "predicted peak MiB (rank 0 / 1)", "measured peak MiB", "memory error"], rows))
    machine = d.get("measured_machine") or {}
    if machine:
        link, ov = machine["link"], machine["overhead"]
        per = [[k, ms(v, 2), ms(ov["step_s"][k], 1)] for k, v in ov["per_schedule_s"].items()]
        out.append(
            f"The machine, measured once before the runs (what `python -m autopipe.machine.measure --overhead` prints): link "
            f"{link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, {link['latency_s'] * 1e6:.0f} µs per message; ranks "
            f"computing at once take {ov['concurrent_slowdown']:.2f}× as long as alone; runtime overhead per action "
            f"{ov['action_overhead_s'] * 1e3:.2f} ms (median over the schedules below, fitted to a tiny model's "
            f"{ov['n_microbatches']}-micro-batch steps):\n\n"
            + table(["schedule-stages per rank", "ms per action", "probe step ms"], per))
    links = d.get("links") or {}
    if links:
        def one_way(v: dict[str, Any], n: int) -> str:
            t = v.get("by_size", {}).get(str(n))
            return "–" if t is None else f"{t * 1e6:.0f}"

        rows = [[k, one_way(v, 1 << 10), one_way(v, 1 << 20), one_way(v, 1 << 23),
                 "–" if v.get("latency_s") is None else f"{v['latency_s'] * 1e6:.0f}",
                 "–" if v.get("bandwidth_bytes_per_s") is None else f"{v['bandwidth_bytes_per_s'] / 1e9:.2f}"]
                for k, v in links.items() if v]
        from autopipe.machine.device import default_link

        bw, lat = default_link("cpu")
        out.append("Link measured between the two ranks after each model's run (isend/irecv ping-pong, median "
                   "one-way time; the fit is `autopipe.machine.measure.fit_link`, – where the times did not grow with size). "
                   f"The planner's CPU default is {lat * 1e6:.0f} µs + bytes / ({bw / 1e9:.0f} GB/s), i.e. "
                   f"{(lat + 2**10 / bw) * 1e6:.0f} µs, {(lat + 2**20 / bw) * 1e3:.2f} ms and "
                   f"{(lat + 2**23 / bw) * 1e3:.1f} ms:\n\n"
                   + table(["model run", "1 KiB µs", "1 MiB µs", "8 MiB µs", "fitted latency µs", "fitted GB/s"], rows))
    return "\n\n".join(out)


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


def render_gpu_one_rank(d: dict[str, Any], behind: list[str]) -> str:
    """Per case: measured and predicted step on one GPU, the error, and the overhead per action it implies."""
    s = d["summary"]
    rows = [[r["model"], r["schedule"], r["m"], ms(r["measured_s"], 2), ms(r["predicted_s"], 2),
             pct(r["predicted_s"] / r["measured_s"] - 1), f"{r['implied_overhead_s'] * 1e6:.0f} us"]
            for r in d["rows"]]
    err = s["median_abs_error_no_overhead"]
    if err > 0.10:
        behind.append(f"one GPU ({s['device']}): the plan's step is off by {err * 100:.0f}% (median |error|, "
                      f"m = {s['check_m']}; target 10%); section 8.")
    sign = " (negative: the profile's compute is already too long)" if s["overhead_fitted_s"] < 0 else ""
    parts = [
        table(["model", "schedule", "m", "measured", "predicted", "error", "implied overhead per action"], rows),
        f"Median |error| at m = {s['check_m']}: {err * 100:.1f}% as planned (CUDA's default overhead, 0), "
        f"{s['median_abs_error_fitted'] * 100:.1f}% with one overhead per action fitted on m = {s['fit_m']} "
        f"({s['overhead_fitted_s'] * 1e6:.0f} us{sign}).",
    ]
    wholes = {r["model"]: r["profile_whole"] for r in d["rows"] if r.get("profile_whole")}
    if wholes:  # runs since the profile times the whole graph beside its segments
        parts.append("The profile's segments timed one by one against the whole graph (forward / backward, "
                     "per micro-batch; the segments are scaled to the whole when fitted):\n\n" + table(
                         ["model", "segments", "whole graph", "scales", "fitted"],
                         [[m, f"{ms(w['segments_fwd_s'], 2)} / {ms(w['segments_bwd_s'], 2)}",
                           f"{ms(w['fwd_s'], 2)} / {ms(w['bwd_s'], 2)}",
                           " / ".join(f"{x:.2f}" for x in w["scales"][:2]), "yes" if w["fitted"] else "no"]
                          for m, w in wholes.items()]))
    return "\n\n".join(parts)


def render_runtime_overhead(d: dict[str, Any], behind: list[str]) -> str:
    """The runtime engineer's table, plus a 'behind' line wherever autopipe.Pipeline is slower than by hand."""
    for r in d.get("rows", []):
        # The paired figure (each autopipe step against the hand-written step next to it) is
        # the one the benchmark trusts; the ratio of medians is the fallback.
        key = "paired_overhead_pct" if isinstance(r.get("paired_overhead_pct"), (int, float)) else "overhead_pct"
        pct_over = r.get(key)
        if isinstance(pct_over, (int, float)) and pct_over > 100 * BEHIND_TOL:
            behind.append(f"runtime overhead, {r.get('schedule')}: a step through autopipe.Pipeline took "
                          f"{pct_over:.1f}% longer ({key}) than the same pipeline written by hand with "
                          "torch.distributed.pipelining.")
    return render_generic(d, behind)


def render_codegen_experiment(name: str, base: dict[str, Any], exp: dict[str, Any], fname: str) -> str:
    """Side by side: the same benchmark with torch's stage modules running generated code (``--codegen-stages``)."""
    intro = (f"**Experiment: stage modules as generated code** (`{fname}`, run with `--codegen-stages`). "
             "torch's `pipeline()` rebuilds each stage's modules as `InterpreterModule`s that execute their graph "
             "node by node through `torch.fx.Interpreter`; autopipe's profiler runs each segment as generated "
             "code and never sees that Python cost. Here every stage module was switched to generated code "
             "(`_run_with_interpreter = False`), in the stage timing and in the real runs. Separate runs, so "
             "compare ratios, not milliseconds across the two.")
    if name == "split_quality":
        by_model = {r["model"]: r for r in exp.get("rows", [])}
        rows = []
        for r in base.get("rows", []):
            e = by_model.get(r["model"])
            if e is None:
                continue
            a, ea = r["methods"]["autopipe"], e["methods"]["autopipe"]
            rows.append([r["model"], f"`{a['split_point']}` / `{ea['split_point']}`",
                         f"{ratio(a['bottleneck_vs_best'])} / {ratio(ea['bottleneck_vs_best'])}",
                         f"{ratio(a.get('step_vs_best'))} / {ratio(ea.get('step_vs_best'))}",
                         f"{ms(a.get('step_s'))} / {ms(ea.get('step_s'))}"])
        return intro + "\n\n" + table(["model", "autopipe cut (Interpreter / codegen)", "bottleneck ÷ best",
                                        "step ÷ best", "autopipe step ms"], rows)
    if name == "prediction_accuracy":
        sb, se = base.get("summary", {}), exp.get("summary", {})
        keys = [k for k in sb.get("columns", {}) if f"median_abs_error:{k}" in se]
        rows = [[k.replace("_step_s", ""), pct(sb.get(f"median_abs_error:{k}")).lstrip("+"),
                 pct(se.get(f"median_abs_error:{k}")).lstrip("+")] for k in keys]
        rows.append(["stage compute ÷ profile", ratio(sb.get("median_measured_stage_over_profile")),
                     ratio(se.get("median_measured_stage_over_profile"))])
        return intro + "\n\n" + table(["median |error|", "Interpreter (as shipped)", "generated code"], rows)
    return ""


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


RENDERERS: dict[str, Callable[[dict[str, Any], list[str]], str]] = {
    "models": render_models,
    "runtime_overhead": render_runtime_overhead,
    "split_quality": render_split_quality,
    "split_quality_sim": render_split_quality_sim,
    "planner_scaling": render_planner_scaling,
    "trace_profile": render_trace_profile,
    "prediction_accuracy": render_prediction_accuracy,
    "gpu_one_rank": render_gpu_one_rank,
}


# --------------------------------------------------------------------------- page


def load_results(results_dir: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """benchmark name -> (data, file name) for every folder with results (full run preferred)."""
    found = {}
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        for fname in ("results.json", "results_quick.json"):
            f = folder / fname
            if f.exists():
                try:
                    data = json.loads(f.read_text())
                    runs = folder / "runs.json"  # several runs pooled (prediction_accuracy/runs.py)
                    if runs.exists():
                        data["pooled_runs"] = json.loads(runs.read_text())
                    found[folder.name] = (data, fname)
                except json.JSONDecodeError as e:
                    found[folder.name] = ({"error": f"unreadable {fname}: {e}"}, fname)
                break
    return found


def render(results_dir: Path) -> str:
    results = load_results(results_dir)
    names = [n for n in ORDER if n in results] + sorted(n for n in results if n not in ORDER)
    behind: list[str] = []
    sections = []
    for name in names:
        data, fname = results[name]
        title = TITLES.get(name, name.replace("_", " ").capitalize())
        body = [f"## {title}", ""]
        readme = f"../benchmarks/{name}/README.md"
        options = RERUN_OPTIONS.get(name, "`--quick` for a short run, `--device cuda` on a GPU")
        body.append(f"What it measures and how: [{readme.removeprefix('../')}]({readme}). Rerun: "
                    f"`python benchmarks/{name}/main.py` ({options}).")
        if fname != "results.json":
            body.append(f"\n> These are **`--quick`** results ({fname}); no full run has been recorded yet.")
        if "error" in data and len(data) == 1:
            body.append(f"\n{data['error']}")
        else:
            body.append("\n" + machine_line(data))
            try:
                body.append("\n" + RENDERERS.get(name, render_generic)(data, behind))
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a format this renderer does not know
                body.append(f"\n(could not render {fname}: {type(e).__name__}: {e})\n\n" + render_generic(data, behind))
        for extra in ("results_codegen.json", "results_codegen_quick.json"):
            path = results_dir / name / extra
            if path.exists() and "error" not in data:
                try:
                    text = render_codegen_experiment(name, data, json.loads(path.read_text()), extra)
                except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
                    text = f"(could not render {extra}: {e})"
                if text:
                    body.append("\n" + text)
                break
        sections.append("\n".join(body))
    missing = [n for n in ORDER if n not in results]
    head = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python benchmarks/render_docs.py` from benchmarks/*/results.json; edit the scripts, "
        "not this page. -->",
        "",
        "Every figure on this page comes from a script in `benchmarks/` that anyone can rerun; each folder's "
        "README says what it measures and how. The scripts never assert on a time: they report medians of "
        "interleaved runs and ratios measured within one run. Each section names the machine it ran on and how "
        "busy it was — timings on a shared 2-core machine are noisy, and ratios are more trustworthy than "
        "absolute milliseconds.",
        "",
        "```bash",
        *(f"python benchmarks/{n}/main.py" for n in names),
        "python benchmarks/render_docs.py   # rewrites this page",
        "```",
    ]
    if missing:
        head += ["", "Not run yet: " + ", ".join(f"`{n}`" for n in missing) + "."]
    head += ["", "## Where autopipe is behind", ""]
    if behind:
        head += [f"* {b}" for b in behind]
    else:
        head += ["Nowhere in these results: autopipe's split is within 3% of the exhaustive best and no baseline "
                 "beats it by more than 3%, and the median step-time error is under 10%."]
    notes = results_dir / "NOTES.md"
    if notes.exists():
        head += ["", notes.read_text().strip()]
    return "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE), help="folder holding <benchmark>/results.json")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args(argv)
    text = render(Path(args.results))
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
