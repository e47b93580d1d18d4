"""What autopipe does with models nobody in this project wrote: plans, runtime, 2-rank pipelines.

For every model of :data:`zoo.thirdparty.REGISTRY` (stock transformers,
diffusers, torchvision and timm classes at their default settings, tiny sizes, random
weights, nothing downloaded) this script

1. plans 2 and 4 stages with ``autopipe.partition``, from FLOP estimates and from measured
   costs (the 4-stage plans reuse the 2-stage plans' per-segment costs, which do not depend
   on the stage count), and records the split points or the first line of the error;
2. builds each distinct split with the runtime's own stage builder and runs the stages in
   order in one process (:func:`zoo.thirdparty_checks.check_split`), recording the
   largest |difference| from the unsplit model's output or the error;
3. for the representative subset (entries with a ``pipeline_split``), steps a real 2-rank
   gloo :class:`autopipe.Pipeline` under 1F1B and compares its loss and every gradient with
   the unsplit model's (:func:`zoo.thirdparty_checks.pipeline_step_vs_unsplit`);
4. for models ``torch.export`` cannot capture, re-checks that exporting still fails;

then writes ``results.json`` beside this file and renders ``docs/models.md`` from it.
Models whose package cannot be imported here are listed with the reason. Nothing is
asserted: ``tests/thirdparty`` asserts the same checks.

    python benchmarks/models/main.py                    # every model (~4-6 min on 2 cores)
    python benchmarks/models/main.py --quick            # no 2-rank pipelines: results_quick.json
    python benchmarks/models/main.py --models gpt2 t5   # some models (the page is not rewritten)
    python benchmarks/models/main.py --render           # docs/models.md again from results.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402

from zoo.thirdparty import REGISTRY, ThirdPartyModel, package_missing  # noqa: E402
from zoo.thirdparty_checks import (  # noqa: E402
    TOLERANCE, check_split, first_line, pipeline_step_vs_unsplit, summarize_ranks,
)

# Raised inside torch.distributed.pipelining whenever it deep-copies a graph (as pytest's
# configuration also filters); not ours, and it would bury the log.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

HERE = Path(__file__).resolve().parent
DOCS = ROOT / "docs" / "models.md"
COMMAND = "python benchmarks/models/main.py"
STAGES = (2, 4)
COSTS = ("flops", "measured")
PACKAGES = ("torch", "transformers", "diffusers", "torchvision", "timm")


# --------------------------------------------------------------------------- running


def plan_and_check(entry: ThirdPartyModel, opts: argparse.Namespace, log) -> dict[str, Any]:
    """Steps 1 and 2 for one model: ``{"2": {"flops": {...}, "measured": {...}}, "4": {...}}``.

    Each record holds ``split_points`` (or ``error``), ``partition_s`` and ``runtime``:
    ``{"max_diff": x}`` or ``{"error": "..."}``; splits repeated across records are built once.
    """
    import autopipe

    built = entry.build()
    plans: dict[str, dict[str, Any]] = {}
    made: dict[tuple[int, str], Any] = {}
    checked: dict[tuple[str, ...], dict[str, Any]] = {}
    for n in STAGES:
        for cost in COSTS:
            options: dict[str, Any] = {"cost": cost}
            profiling = autopipe.ProfileOptions(progress=False)
            if cost == "measured":
                profiling = autopipe.ProfileOptions(warmup=opts.warmup, repeats=opts.repeats, progress=False)
            if n != STAGES[0] and (STAGES[0], cost) in made:  # the costs do not depend on the stage count
                options["cost"] = made[(STAGES[0], cost)].segment_costs()
            t0 = time.perf_counter()
            try:
                plan = autopipe.partition(built.model, n, example_args=built.example_args,
                                          example_kwargs=built.example_kwargs,
                                          planner=autopipe.PlannerOptions(profiling=profiling, **options))
            except Exception as e:  # noqa: BLE001 - recorded, the next plan still runs
                plans.setdefault(str(n), {})[cost] = {"error": first_line(e), "partition_s": time.perf_counter() - t0}
                log(f"    {n} stages, {cost}: partition fails: {first_line(e)}")
                continue
            made[(n, cost)] = plan
            record: dict[str, Any] = {"split_points": list(plan.split_points), "partition_s": time.perf_counter() - t0,
                                      "predicted_step_s": plan.predicted_step_s}
            key = tuple(plan.split_points)
            if key not in checked:
                try:
                    checked[key] = {"max_diff": check_split(built, plan.split_points)}
                except Exception as e:  # noqa: BLE001
                    checked[key] = {"error": first_line(e)}
            record["runtime"] = checked[key]
            plans.setdefault(str(n), {})[cost] = record
            outcome = checked[key].get("error") or f"runs, max |diff| {checked[key]['max_diff']:.2g}"
            log(f"    {n} stages, {cost}: {list(plan.split_points)}: {outcome}")
    return plans


def two_rank_step(entry: ThirdPartyModel, opts: argparse.Namespace) -> dict[str, Any]:
    """Step 3: a 2-rank 1F1B step against the unsplit model, summarised, or the first error line."""
    from _pipebench import WorldFailed, run_world

    results = run_world(pipeline_step_vs_unsplit, 2, entry.name, threads=opts.threads,
                        timeout_s=opts.world_timeout, allow_errors=True)
    failed = [r for r in results if isinstance(r, WorldFailed)]
    if failed:
        return {"split": entry.pipeline_split, "error": first_line(str(failed[0]))}
    return {"split": entry.pipeline_split, **summarize_ranks(results)}


def export_still_fails(entry: ThirdPartyModel) -> str | None:
    """Step 4: the first line of ``torch.export``'s error now (KV cache off), or None if it exports."""
    import torch

    from autopipe.planning import hf_compat

    built = entry.build()
    try:
        with hf_compat.training_config(built.model):
            kwargs = hf_compat.training_kwargs(built.model, built.example_kwargs)[0]
            torch.export.export(built.model, built.example_args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - the failure is what is recorded
        return first_line(e)
    return None


def run_model(entry: ThirdPartyModel, opts: argparse.Namespace, log) -> dict[str, Any]:
    """Everything recorded about one registry entry (see the module docstring)."""
    row: dict[str, Any] = {"name": entry.name, "family": entry.family, "package": entry.package,
                           "source": entry.source, "features": entry.features, "pipeline_split": entry.pipeline_split}
    t0 = time.perf_counter()
    if entry.unsupported is not None:
        row.update(status="unsupported", reason=entry.unsupported)
        missing = package_missing(entry.package)
        row["export_now"] = f"not checked: {missing}" if missing else (export_still_fails(entry) or "exports now")
        log(f"  {entry.name}: cannot work: {entry.unsupported} (export now: {row['export_now']})")
        return row
    missing = package_missing(entry.package)
    if missing is not None:
        row.update(status="skipped", reason=missing)
        log(f"  {entry.name}: skipped: {missing}")
        return row
    log(f"  {entry.name} ({entry.family}, {entry.package})")
    row["status"] = "ran"
    try:
        row["plans"] = plan_and_check(entry, opts, log)
    except Exception as e:  # noqa: BLE001 - the model did not even build
        row["error"] = first_line(e)
        log(f"    fails: {row['error']}")
    if entry.pipeline_split and not opts.no_pipeline and "error" not in row:
        row["pipeline"] = two_rank_step(entry, opts)
        p = row["pipeline"]
        log(f"    2-rank 1F1B at {entry.pipeline_split!r}: " + (p.get("error") or
            f"|dloss| {p['max_loss_diff']:.2g}, |dgrad| {p['max_grad_diff']:.2g}"))
    row["wall_s"] = time.perf_counter() - t0
    return row


def verdict(row: dict[str, Any]) -> str:
    """``works``, ``fails``, ``skipped`` or ``unsupported``: works = every plan made and ran within
    tolerance, and the 2-rank step (where run) matched.

    Example:
        >>> verdict({"status": "ran", "plans": {"2": {"flops": {"split_points": ["a"], "runtime": {"max_diff": 0.0}}}}})
        'works'
    """
    if row.get("status") != "ran":
        return row.get("status", "fails")
    if "error" in row:
        return "fails"
    for by_cost in row.get("plans", {}).values():
        for record in by_cost.values():
            runtime = record.get("runtime", {})
            if "error" in record or "error" in runtime or runtime.get("max_diff", float("inf")) > TOLERANCE:
                return "fails"
    p = row.get("pipeline")
    if p is not None and ("error" in p or p["missing"] or p["max_loss_diff"] > TOLERANCE
                          or p["max_grad_diff"] > TOLERANCE):
        return "fails"
    return "works"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How many models work, fail, were skipped or cannot work, and which fail (for docs/benchmarks.md).

    Example:
        >>> summary([{"name": "m", "status": "skipped"}])
        {'works': 0, 'fails': 0, 'skipped': 1, 'unsupported': 0, 'failing': []}
    """
    verdicts = [verdict(r) for r in rows]
    counts: dict[str, Any] = {k: verdicts.count(k) for k in ("works", "fails", "skipped", "unsupported")}
    counts["failing"] = [r["name"] for r, v in zip(rows, verdicts) if v == "fails"]
    return counts


# --------------------------------------------------------------------------- rendering


def _code(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "(none)"


def _plan_cell(by_cost: dict[str, Any] | None) -> str:
    if not by_cost:
        return "–"
    parts = []
    for cost in COSTS:
        record = by_cost.get(cost)
        if record is None:
            parts.append("–")
        elif "error" in record:
            parts.append("fails (see below)")
        else:
            parts.append(_code(record["split_points"]))
    return " · ".join(parts)


def _runtime_cell(row: dict[str, Any]) -> str:
    records = [r for by_cost in row.get("plans", {}).values() for r in by_cost.values() if "split_points" in r]
    if not records:
        return "–"
    distinct = {tuple(r["split_points"]): r["runtime"] for r in records}
    ok = [v for v in distinct.values() if "error" not in v and v["max_diff"] <= TOLERANCE]
    worst = max((v["max_diff"] for v in distinct.values() if "max_diff" in v), default=None)
    text = f"{len(ok)} of {len(distinct)} splits"
    if worst is not None:
        text += f", max abs Δ {worst:.1g}"
    errors = sorted({v["error"] for v in distinct.values() if "error" in v})
    if len(ok) < len(distinct) and not errors:
        text = f"**{text}** (above {TOLERANCE:g})"
    return text + ("; **fails** (see below)" if errors else "")


def _pipeline_cell(row: dict[str, Any]) -> str:
    p = row.get("pipeline")
    if p is None:
        return "– (not in the subset)" if not row.get("pipeline_split") else "not run (--quick)"
    if "error" in p:
        return f"**fails** at `{p['split']}` (see below)"
    text = f"`{p['split']}`: {p['max_loss_diff']:.1g} / {p['max_grad_diff']:.1g}"
    if p["missing"]:
        text += f"; **no rank holds** {_code(p['missing'])}"
    if p["max_loss_diff"] > TOLERANCE or p["max_grad_diff"] > TOLERANCE:
        text = f"**{text}** (worst gradient `{p['worst_param']}`)"
    return text


def _failures(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each distinct failure line -> where it happened (``model: what``)."""
    found: dict[str, list[str]] = {}
    for row in rows:
        if "error" in row:
            found.setdefault(row["error"], []).append(f"{row['name']}: building the model")
        for n, by_cost in row.get("plans", {}).items():
            for cost, record in by_cost.items():
                if "error" in record:
                    found.setdefault(record["error"], []).append(f"{row['name']}: partition, {n} stages, {cost}")
                elif "error" in record.get("runtime", {}):
                    found.setdefault(record["runtime"]["error"], []).append(
                        f"{row['name']}: runtime, {n} stages, {cost} split")
        p = row.get("pipeline") or {}
        if "error" in p:
            found.setdefault(p["error"], []).append(f"{row['name']}: 2-rank step")
    return found


def render(data: dict[str, Any], results_name: str = "benchmarks/models/results.json") -> str:
    """``docs/models.md`` from a results file's contents."""
    rows = data["rows"]
    m = data.get("machine", {})
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items() if v)
    counts = summary(rows)
    out = [
        "# Third-party models",
        "",
        f"<!-- Generated by `{COMMAND}` from {results_name}; edit the script, not this page. -->",
        "",
        f"Produced by `{data.get('command', COMMAND)}` on {m.get('date', '?')} ({versions}; "
        f"{m.get('cores', '?')} cores, {'CUDA ' + m['cuda'] if m.get('cuda') else 'CPU'}; "
        f"took {data.get('wall_s', 0):.0f} s).",
        "",
        "Stock classes from Hugging Face transformers, diffusers, torchvision and timm, built from their own "
        "configs or constructors with their **default settings** except the sizes (width 32, 2 layers, "
        "vocabulary 64, 2 heads, 32×32 images, micro-batch 2) and random weights — nothing downloaded, nothing "
        "patched: a Hugging Face model keeps its `ModelOutput` and its KV cache. The registry is "
        "`tests/zoo/thirdparty.py`; `tests/thirdparty/` asserts what this page records.",
        "",
        f"**{len(rows)} models: {counts['works']} work end to end, {counts['fails']} fail somewhere, "
        f"{counts['skipped']} could not be run here (package), {counts['unsupported']} cannot work "
        "(torch.export).**",
        "",
        "* *2 / 4 stages*: the split points `autopipe.partition(model, n, planner=PlannerOptions(cost=...))` chose from FLOP estimates · "
        f"from measured costs (warm-up {data.get('warmup')}, {data.get('repeats')} timed runs); the 4-stage "
        "plans reuse the 2-stage plans' per-segment costs, which do not depend on the stage count.",
        "* *runtime runs the plans*: each distinct split built by the runtime's own stage builder "
        "(`autopipe.runtime.stages.split_model`, as `autopipe.Pipeline` builds it) and run stage after stage in one "
        f"process; it passes when the output is within {TOLERANCE:g} of the unsplit model's (same RNG seed).",
        "* *2-rank 1F1B step*: for one model of each family, a real `autopipe.Pipeline` on 2 gloo processes cut "
        "at the block boundary shown, one 1F1B step of 4 micro-batches, with dropout off; max |Δloss| / max "
        f"|Δgradient| over every parameter against the unsplit model (passes within {TOLERANCE:g}).",
        "",
    ]
    header = ["model", "family", "package", "2 stages: flops · measured", "4 stages: flops · measured",
              "runtime runs the plans", "2-rank 1F1B step: Δloss / Δgrad"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        model = f"**{row['name']}** (`{row['source']}`)"
        if row["status"] == "unsupported":
            cells = ["–", "–", "**cannot work** (torch.export; the reason is below)", ""]
        elif row["status"] == "skipped":
            cells = ["–", "–", "not run here (package, see below)", ""]
        elif "error" in row:
            cells = ["–", "–", f"**fails**: {row['error']}", ""]
        else:
            plans = row.get("plans", {})
            cells = [_plan_cell(plans.get("2")), _plan_cell(plans.get("4")), _runtime_cell(row), _pipeline_cell(row)]
        lines.append("| " + " | ".join([model, row["family"], row["package"], *cells]) + " |")
    out.append("\n".join(lines))

    failures = _failures(rows)
    if failures:
        out += ["", "## Failures, by first line", ""]
        for line, where in sorted(failures.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            out.append(f"* `{line}` — {'; '.join(where)}")
    unsupported = [r for r in rows if r["status"] == "unsupported"]
    if unsupported:
        out += ["", "## Models that cannot work (torch.export)", ""]
        for r in unsupported:
            out.append(f"* **{r['name']}** (`{r['source']}`): {r['reason']}. Export in this run: {r['export_now']}.")
    skipped = [r for r in rows if r["status"] == "skipped"]
    if skipped:
        out += ["", "## Not run here", ""]
        by_reason: dict[str, list[str]] = {}
        for r in skipped:
            by_reason.setdefault(r["reason"], []).append(r["name"])
        for reason, names in by_reason.items():
            out.append(f"* {', '.join(f'**{n}**' for n in names)}: {reason}.")
    features = [r for r in rows if r.get("features")]
    if features:
        out += ["", "## What each model exercises", "",
                table_lines(["model", "what it brings"], [[r["name"], r["features"]] for r in features])]
    return "\n".join(out) + "\n"


def table_lines(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# --------------------------------------------------------------------------- main


def _shown(path: Path) -> str:
    """How the page names its results file: relative to the checkout when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _versions() -> dict[str, str | None]:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the 2-rank pipelines; writes results_quick.json")
    ap.add_argument("--models", nargs="*", default=None, help=f"some of {list(REGISTRY)}")
    ap.add_argument("--device", default="cpu", help="where the measured costs are profiled (cpu)")
    ap.add_argument("--no-pipeline", action="store_true", help="skip the 2-rank pipelines")
    ap.add_argument("--warmup", type=int, default=1, help="profile warm-up runs per segment")
    ap.add_argument("--repeats", type=int, default=2, help="profile timed runs per segment")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank of the 2-rank pipelines")
    ap.add_argument("--world-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None, help="results file (default: results.json, or results_quick.json)")
    ap.add_argument("--docs", default=None,
                    help=f"page to render (default: {DOCS.relative_to(ROOT)} after a full run of every model)")
    ap.add_argument("--render", action="store_true", help="only render the page from --results")
    ap.add_argument("--results", default=str(HERE / "results.json"), help="results file --render reads")
    opts = ap.parse_args(argv)

    if opts.render:
        data = json.loads(Path(opts.results).read_text())
        docs = Path(opts.docs or DOCS)
        docs.write_text(render(data, _shown(Path(opts.results))))
        print(f"wrote {docs}")
        return data

    unknown = sorted(set(opts.models or ()) - set(REGISTRY))
    if unknown:
        raise SystemExit(f"unknown models {unknown}; the registry has {list(REGISTRY)}")
    opts.no_pipeline = opts.no_pipeline or opts.quick
    if opts.device != "cpu":
        raise SystemExit("the runtime checks and the 2-rank pipelines run on the CPU (gloo); use --device cpu")
    names = opts.models or list(REGISTRY)
    full = opts.models is None and not opts.no_pipeline

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    log(f"third-party models: {len(names)} of {len(REGISTRY)}")
    rows = [run_model(REGISTRY[n], opts, log) for n in names]
    command = " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])])
    payload = {"benchmark": "models", "command": command, "versions": _versions(), "warmup": opts.warmup,
               "repeats": opts.repeats, "tolerance": TOLERANCE, "rows": rows,
               "summary": summary(rows),
               "wall_s": time.perf_counter() - t0}
    out = Path(opts.out or HERE / ("results.json" if not opts.quick else "results_quick.json"))
    path = write_result(out, payload)
    log(f"wrote {path} ({payload['wall_s']:.0f} s): {payload['summary']}")
    docs = opts.docs or (DOCS if full and opts.out is None else None)
    if docs:
        data = json.loads(path.read_text())
        Path(docs).write_text(render(data, _shown(path)))
        log(f"wrote {docs}")
    return payload


if __name__ == "__main__":
    main()
