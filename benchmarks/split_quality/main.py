"""Split quality, measured: autopipe's 2-stage split vs the baselines and the exhaustive best.

For each zoo model with uneven layers this script

1. plans a 2-stage pipeline with ``autopipe.partition`` (1F1B, 4 micro-batches by default),
   which also reports the split each peer tool would choose (``plan.baselines``: DeepSpeed
   0.19.8 ``parameters`` and ``uniform``, torchtitan 0.3.0's default, torchgpipe 0.0.7
   ``balance_by_time``, torchpippy 0.2.0, the FLOPs DP of torchtitan PR #2113), where it applies;
2. **scans every legal split point** (``trace(...).split_point_names``): builds the two
   stages with ``torch.distributed.pipelining.pipeline()`` and times each stage's forward +
   backward in one process (stage 0's output feeds stage 1; stage 1's input gradient flows
   back). The measured bottleneck of a split is the slower stage. The scan starts at
   autopipe's split and walks outwards; a side is abandoned once the stage that grows in
   that direction alone measured more than ``--prune-slack`` (1.5) x the best bottleneck so
   far on three split points running (it only grows further, so nothing beyond can win). ``--exhaustive``
   measures every candidate instead;
3. **re-measures** the finalists (autopipe, each baseline, the scan's best three)
   interleaved (A B C A B C ...), so the minimum of a noisy scan does not flatter the best;
4. **runs each contender as a real 2-rank pipeline** (:class:`autopipe.Pipeline`, gloo on
   127.0.0.1, one process per rank), interleaved in rounds, in 3 fresh worlds one after
   another (``--worlds``); a split's step over the best's is the median of their steps'
   ratios paired round by round (which of two close splits wins moves with the host's state).

One thread per rank (and for profiling, planning and stage timing) on CPU, so what the
planner measured is what each rank sees. Nothing is asserted; everything is written to
JSON beside this file.

    python benchmarks/split_quality/main.py            # 7 models, about 7 minutes on 2 cores
    python benchmarks/split_quality/main.py --quick    # 3 smaller models, under 2 minutes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import (  # noqa: E402
    MODELS, StageChain, host_info, make_model, make_target, median, paired_ratio, parallel_efficiency, pooled_steps,
)

import autopipe  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402

BASELINE_ORDER = ("deepspeed_parameters", "deepspeed_uniform", "torchtitan_default", "torchgpipe_time",
                  "pippy_equal_size", "flops_dp")
QUICK_MODELS = ("seed_transformer", "cnn", "mlp")


def scan_splits(model: torch.nn.Module, args: tuple, target: torch.Tensor, candidates: list[str], start: str, *,
                device: str, repeats: int, prune_slack: float | None, log, codegen: bool = False
                ) -> dict[str, dict[str, Any]]:
    """Measured stage times of 2-stage splits at ``candidates``, walking outwards from ``start``.

    Returns ``{split point: {"stage_s": [s0, s1], "fwd_s": [...], "bwd_s": [...], "bottleneck_s": max}}``.
    With ``prune_slack`` a side stops once its growing stage exceeded slack x the best
    bottleneck on three candidates in a row (stage 0 only grows to the right, stage 1 to the left).
    """
    table: dict[str, dict[str, Any]] = {}
    best = float("inf")

    def measure(name: str) -> dict[str, Any]:
        nonlocal best
        chain = StageChain(model, args, [name], device=device, codegen=codegen)
        fwd, bwd = chain.time(target, warmup=1, repeats=repeats)
        stage = [f + b for f, b in zip(fwd, bwd)]
        row = {"fwd_s": fwd, "bwd_s": bwd, "stage_s": stage, "bottleneck_s": max(stage)}
        table[name] = row
        best = min(best, row["bottleneck_s"])
        return row

    i0 = candidates.index(start)
    measure(start)
    # (direction, index of the stage that grows as we walk that way)
    for step, growing in ((-1, 1), (1, 0)):
        over = 0
        i = i0 + step
        while 0 <= i < len(candidates):
            row = measure(candidates[i])
            if prune_slack is not None:
                over = over + 1 if row["stage_s"][growing] > prune_slack * best else 0
                if over >= 3:  # three in a row: one noisy measurement cannot end the search
                    break
            i += step
    log(f"    scanned {len(table)}/{len(candidates)} split points")
    return table


def remeasure(model, args, target, splits: list[str], *, device: str, rounds: int, codegen: bool = False
              ) -> dict[str, dict[str, Any]]:
    """Stage times of ``splits`` measured interleaved (one forward+backward of each per round), medians."""
    chains = {s: StageChain(model, args, [s], device=device, codegen=codegen) for s in splits}
    t = target.to(device)
    for c in chains.values():
        c.run_once(t)
    runs: dict[str, list] = {s: [] for s in splits}
    for _ in range(rounds):
        for s, c in chains.items():
            runs[s].append(c.run_once(t))
    out = {}
    for s, rs in runs.items():
        fwd = [median([r[0][k] for r in rs]) for k in range(2)]
        bwd = [median([r[1][k] for r in rs]) for k in range(2)]
        stage = [f + b for f, b in zip(fwd, bwd)]
        out[s] = {"fwd_s": fwd, "bwd_s": bwd, "stage_s": stage, "bottleneck_s": max(stage)}
    return out


def bench_model(name: str, size: str, opts: argparse.Namespace, log) -> dict[str, Any]:
    t_start = time.perf_counter()
    model, args = make_model(name, size)
    with torch.no_grad():
        target = make_target(model(*args))
    device = opts.device
    plan = autopipe.partition(model, 2, example_args=args, schedule=opts.schedule, n_microbatches=opts.microbatches, planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(device=device, progress=False, warmup=1,
                                                                repeats=opts.profile_repeats)))
    candidates = trace(model, args).split_point_names
    methods: dict[str, dict[str, Any]] = {
        "autopipe": {"split_point": plan.split_points[0], "predicted_bottleneck_s": plan.bottleneck_s,
                     "predicted_step_s": plan.predicted_step_s},
    }
    applicable = [b for b in plan.baselines if not b.reason]  # a peer whose rule gives no split here is left out
    for b in sorted(applicable, key=lambda b: BASELINE_ORDER.index(b.name) if b.name in BASELINE_ORDER else 9):
        methods[b.name] = {"split_point": b.split_points[0], "predicted_bottleneck_s": b.bottleneck_s,
                           "predicted_step_s": b.predicted_step_s}
    log(f"  {name}: {len(candidates)} split points; autopipe cuts at {plan.split_points[0]!r}, baselines at "
        + ", ".join(f"{k}={v['split_point']!r}" for k, v in methods.items() if k != "autopipe"))

    scan = scan_splits(model, args, target, candidates, plan.split_points[0], device=device,
                       repeats=opts.scan_repeats, prune_slack=None if opts.exhaustive else opts.prune_slack, log=log,
                       codegen=opts.codegen_stages)
    # Finalists: the scan's best few and every method's split, re-measured side by side; the
    # exhaustive best is the finalist with the lowest re-measured bottleneck (the minimum of
    # a noisy scan alone would be flattered by noise).
    finalists = sorted(scan, key=lambda s: scan[s]["bottleneck_s"])[: opts.finalists]
    finalists = list(dict.fromkeys([*(m["split_point"] for m in methods.values()), *finalists]))
    again = remeasure(model, args, target, finalists, device=device, rounds=opts.remeasure_rounds,
                      codegen=opts.codegen_stages)
    best_split = min(finalists, key=lambda s: again[s]["bottleneck_s"])
    methods["exhaustive_best"] = {"split_point": best_split}
    contenders = list(dict.fromkeys(m["split_point"] for m in methods.values()))
    for m in methods.values():
        s = m["split_point"]
        m["scan_bottleneck_s"] = scan[s]["bottleneck_s"] if s in scan else None
        m["stage_s"] = again[s]["stage_s"]
        m["bottleneck_s"] = again[s]["bottleneck_s"]

    real: dict[str, Any] = {"ran": False}
    n_gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    if device.startswith("cuda") and n_gpus < 2:
        real["note"] = f"a real 2-rank pipeline on CUDA needs 2 GPUs; this machine has {n_gpus}"
    elif not opts.no_real:
        job = {"model": name, "size": size, "device": device, "codegen": opts.codegen_stages,
               "rounds": opts.rounds, "steps": opts.steps,
               "warmup_steps": 1,
               "variants": [{"label": s, "split_points": [s], "schedule": opts.schedule,
                             "n_microbatches": opts.microbatches, "stages_per_rank": 1} for s in contenders]}
        pooled, per_world, failed = pooled_steps(job, opts.worlds, device=device, threads=opts.threads,
                                                 timeout_s=opts.world_timeout, log=log)
        for m in methods.values():
            s = m["split_point"]
            if s in failed:
                m["not_run"] = failed[s]
            elif s in pooled:
                m["step_s"] = median(pooled[s])
                m["step_samples"] = pooled[s]
                m["world_steps_s"] = [median(w[s]) for w in per_world if s in w]
        real = {"ran": bool(per_world), "rounds": opts.rounds, "steps_per_round": opts.steps,
                "worlds": len(per_world), "not_run": failed}
    best = methods["exhaustive_best"]
    for m in methods.values():
        m["bottleneck_vs_best"] = m["bottleneck_s"] / best["bottleneck_s"]
        if "step_s" in m and "step_s" in best:
            # Paired round by round (the variants were interleaved): the host's drift cancels.
            m["step_vs_best"] = paired_ratio(m["step_samples"], best["step_samples"])
        if "step_s" in m and "step_s" in methods["autopipe"]:
            m["step_vs_autopipe"] = paired_ratio(m["step_samples"], methods["autopipe"]["step_samples"])
    row = {
        "model": name, "why": MODELS[name].why, "size": getattr(MODELS[name], size),
        "params": sum(p.numel() for p in model.parameters()),
        "candidates": len(candidates), "measured_candidates": len(scan), "exhaustive": opts.exhaustive,
        "scan": {s: scan[s]["stage_s"] for s in candidates if s in scan},
        "finalists": {s: again[s]["stage_s"] for s in finalists},
        "methods": methods, "real": real, "wall_s": time.perf_counter() - t_start,
    }
    _print_row(row, log)
    return row


def _print_row(row: dict[str, Any], log) -> None:
    log(f"  {'method':16s} {'split point':34s} {'stage0 ms':>9s} {'stage1 ms':>9s} {'vs best':>8s} {'step ms':>8s} {'vs best':>8s}")
    for k, m in row["methods"].items():
        step = f"{m['step_s'] * 1e3:8.1f} {m['step_vs_best']:8.3f}" if "step_s" in m else ""
        log(f"  {k:16s} {m['split_point']:34s} {m['stage_s'][0] * 1e3:9.2f} {m['stage_s'][1] * 1e3:9.2f} "
            f"{m['bottleneck_vs_best']:8.3f} {step}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)} at smaller sizes, fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="one tiny model, minimal repeats (for the test suite)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (real runs need 2 GPUs)")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {list(MODELS)}")
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    ap.add_argument("--codegen-stages", action="store_true",
                    help="experiment: run torch's stage modules as generated code, not through the fx Interpreter")
    ap.add_argument("--exhaustive", action="store_true", help="measure every split point (no pruning)")
    ap.add_argument("--prune-slack", type=float, default=1.5)
    ap.add_argument("--finalists", type=int, default=3, help="best scanned splits re-measured with the methods' splits")
    ap.add_argument("--profile-repeats", type=int, default=None)
    ap.add_argument("--scan-repeats", type=int, default=None)
    ap.add_argument("--remeasure-rounds", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the real pipelines")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant per round")
    ap.add_argument("--worlds", type=int, default=None, help="fresh 2-rank worlds the real steps are pooled over "
                    "(default 3, --quick and --smoke 1)")
    ap.add_argument("--no-real", action="store_true", help="skip the real 2-rank pipelines")
    ap.add_argument("--world-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args(argv)
    size = "smoke" if opts.smoke else "quick" if opts.quick else "full"
    defaults = {"smoke": (1, 1, 1, 1, 1, 1), "quick": (3, 3, 5, 3, 1, 1), "full": (5, 3, 9, 5, 2, 3)}[size]
    for attr, d in zip(("profile_repeats", "scan_repeats", "remeasure_rounds", "rounds", "steps", "worlds"), defaults):
        if getattr(opts, attr) is None:
            setattr(opts, attr, d)
    names = opts.models or (["mlp"] if opts.smoke else list(QUICK_MODELS) if opts.quick else list(MODELS))
    out = opts.out or str(Path(__file__).parent / ("results.json" if size == "full" else f"results_{size}.json"))
    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0, host_start = time.perf_counter(), host_info()
    # How much two ranks computing at once slow each other down here (1.0 = truly parallel).
    parallel = parallel_efficiency(threads=opts.threads) if opts.device == "cpu" else None
    if parallel:
        log(f"two processes computing at once take {parallel['together_over_alone']:.2f}x as long as one alone")
    log(f"split quality: {len(names)} models, {size} sizes, {opts.schedule} x{opts.microbatches}, device {opts.device}, "
        f"{opts.threads} thread(s) per process")
    rows = [bench_model(n, size, opts, log) for n in names]
    payload = {
        "benchmark": "split_quality", "size": size, "device": opts.device, "schedule": opts.schedule,
        "n_microbatches": opts.microbatches, "threads_per_process": opts.threads, "exhaustive": opts.exhaustive,
        "codegen_stages": opts.codegen_stages,
        "prune_slack": None if opts.exhaustive else opts.prune_slack,
        "repeats": {k: getattr(opts, k) for k in ("profile_repeats", "scan_repeats", "remeasure_rounds", "rounds", "steps",
                                                  "worlds")},
        "host_start": host_start, "host_end": host_info(), "parallel_efficiency": parallel, "rows": rows, "wall_s": time.perf_counter() - t0,
    }
    path = write_result(out, payload)
    log(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
