"""autopipe against the real peers: the split each tool picks, measured, at 2 and 4 stages.

For each benchmark model and stage count this script

1. plans with ``autopipe.partition(model, p, example_args)`` as a user would call it
   (1F1B, 2p micro-batches, measured costs, no ``loss_fn``: the planner assumes a language
   model's token cross-entropy), which also reports the split of every peer that applies
   (``plan.baselines``: DeepSpeed ``parameters`` and ``uniform``, torchtitan's default,
   torchgpipe's ``balance_by_time``, PiPPy's equal sizes, the FLOPs DP of torchtitan PR
   #2113), each reproduced on the layer list that tool would be given;
2. measures every layer of that list alone (one stage per layer,
   :class:`_pipebench.StageChain`) and ranks every layer-level split by the slowest stage
   those times add up to; the best few are the *layer-level finalists*;
3. re-measures every method's split and the finalists side by side, interleaved
   (A B C A B C ...), medians of ``--rounds``: each split's **compute-only bottleneck** is its
   slowest stage's forward + backward (the loss on the last stage, no communication). The
   best layer-level split is the finalist with the lowest re-measured bottleneck; every
   method is reported as its bottleneck over that best (autopipe may cut inside a layer, so it
   can come out below 1);
4. at 2 stages, runs every distinct split as a real 2-rank ``autopipe.Pipeline`` (gloo on
   127.0.0.1, one thread per rank), interleaved in rounds, in 3 fresh worlds one after
   another, and reports the median step over all of them against the best layer-level
   split's (and each world's ratio: which of two close splits wins moves with the host's
   state from one world to the next).

Nothing is asserted; everything goes to ``results.json`` beside this file, which
``benchmarks/render_docs.py`` renders into ``docs/benchmarks.md``.

    python benchmarks/peers/main.py              # 7 models x 2 and 4 stages (about 6 minutes on 2 cores)
    python benchmarks/peers/main.py --quick      # 3 models, fewer rounds
    python benchmarks/peers/main.py --models unet --stages 4 --no-real
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import (  # noqa: E402
    MODELS, StageChain, host_info, make_model, make_target, median, paired_ratio, paired_ratio_interval,
    pooled_steps,
)

import autopipe  # noqa: E402
from autopipe.planning.baselines import layer_units  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402

QUICK_MODELS = ("seed_transformer", "unet", "mlp")
BEST = "best_layer_split"


def remeasure(model: torch.nn.Module, args: tuple, target: torch.Tensor, splits: list[tuple[str, ...]], *,
              rounds: int) -> dict[tuple[str, ...], dict[str, Any]]:
    """Per-stage forward + backward of each split, one micro-batch at a time, interleaved; medians."""
    chains = {s: StageChain(model, args, list(s)) for s in splits}
    for c in chains.values():
        c.run_once(target)
    runs: dict[tuple[str, ...], list] = {s: [] for s in splits}
    for _ in range(rounds):
        for s, c in chains.items():
            runs[s].append(c.run_once(target))
    out = {}
    for s, rs in runs.items():
        n = len(s) + 1
        stage = [median([r[0][k] + r[1][k] for r in rs]) for k in range(n)]
        out[s] = {"stage_s": stage, "bottleneck_s": max(stage)}
    return out


def layer_finalists(layer_s: list[float], names: list[str], p: int, keep: int) -> list[tuple[str, ...]]:
    """The ``keep`` layer-level splits into ``p`` stages whose summed layer times have the smallest maximum."""
    n = len(names)
    if n < p:
        return []
    prefix = [0.0]
    for t in layer_s:
        prefix.append(prefix[-1] + t)
    scored = []
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0, *cuts, n)
        scored.append((max(prefix[edges[k + 1]] - prefix[edges[k]] for k in range(p)), cuts))
    scored.sort()
    return [tuple(names[c] for c in cuts) for _, cuts in scored[:keep]]


def bench_model(name: str, size: str, opts: argparse.Namespace, log) -> dict[str, Any]:
    t_start = time.perf_counter()
    model, args = make_model(name, size)
    with torch.no_grad():
        target = make_target(model(*args))
    units = layer_units(trace(model, args))
    # Every layer alone: one stage per layer of the list the peers are given.
    chain = StageChain(model, args, units.names[1:])
    fwd, bwd = chain.time(target, warmup=1, repeats=opts.layer_repeats)
    layer_s = [f + b for f, b in zip(fwd, bwd)]
    log(f"  {name}: {len(units.names)} layers ({', '.join(units.names)})")
    row: dict[str, Any] = {"model": name, "why": MODELS[name].why, "size": getattr(MODELS[name], size),
                           "params": sum(p.numel() for p in model.parameters()), "layers": units.names,
                           "layer_s": layer_s, "stages": {}}
    for p in opts.stages:
        row["stages"][str(p)] = bench_stages(model, args, target, name, size, p, units.names, layer_s, opts, log)
    row["wall_s"] = time.perf_counter() - t_start
    return row


def bench_stages(model, args, target, name: str, size: str, p: int, layer_names: list[str], layer_s: list[float],
                 opts: argparse.Namespace, log) -> dict[str, Any]:
    plan = autopipe.partition(model, p, args, schedule="1F1B", n_microbatches=2 * p,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(progress=False, warmup=1, repeats=opts.profile_repeats)))
    methods: dict[str, dict[str, Any]] = {"autopipe": {"split": tuple(plan.split_points)}}
    for b in plan.baselines:
        if getattr(b, "split_points", None):
            methods[b.name] = {"split": tuple(b.split_points)}
        else:
            methods[b.name] = {"split": None, "not_applicable": getattr(b, "reason", None) or "no split"}
    finalists = layer_finalists(layer_s, layer_names, p, opts.finalists)
    splits = list(dict.fromkeys([*(m["split"] for m in methods.values() if m["split"]), *finalists]))
    again = remeasure(model, args, target, splits, rounds=opts.rounds)
    layer_level = [s for s in splits if all(c in layer_names for c in s)]
    best = min(layer_level, key=lambda s: again[s]["bottleneck_s"])
    methods[BEST] = {"split": best}
    for m in methods.values():
        if m["split"] is None:
            continue
        m.update(again[m["split"]])
        m["bottleneck_vs_best"] = m["bottleneck_s"] / again[best]["bottleneck_s"]
    out: dict[str, Any] = {"plan_notes": list(plan.notes), "methods": methods,
                           "finalists": [list(s) for s in finalists], "real": {"ran": False}}
    if p == 2 and not opts.no_real:
        out["real"] = real_steps(name, size, [s for s in splits if s in {m["split"] for m in methods.values()}],
                                 methods, opts, log)
    for k, m in methods.items():
        if m["split"] is None:
            log(f"    p={p} {k:22s} {m['not_applicable']}")
        else:
            step = f" step {m['step_vs_best']:.3f}" if "step_vs_best" in m else ""
            log(f"    p={p} {k:22s} {','.join(m['split']):50s} bottleneck {m['bottleneck_vs_best']:.3f}{step}")
    for m in methods.values():
        if m["split"] is not None:
            m["split"] = list(m["split"])
    return out


def real_steps(name: str, size: str, splits: list[tuple[str, ...]], methods: dict[str, dict[str, Any]],
               opts: argparse.Namespace, log) -> dict[str, Any]:
    """Every split as a real 2-rank pipeline, interleaved in rounds, in ``opts.real_worlds`` fresh worlds.

    Which of two splits within a few percent wins moves with the host's state from one world
    to the next, so one world alone can rank them either way: a split's step over the best's
    is the median of their steps' ratios paired round by round over every world
    (:func:`autopipe.machine.timing.paired_ratio`), with its 95% bootstrap interval over those
    pairs, and each world's own ratio is kept beside it.
    """
    labels = {s: ",".join(s) for s in splits}
    job = {"model": name, "size": size, "device": "cpu", "codegen": False, "rounds": opts.real_rounds,
           "steps": opts.steps, "warmup_steps": 1,
           "variants": [{"label": labels[s], "split_points": list(s), "schedule": "1F1B", "n_microbatches": 4,
                         "stages_per_rank": 1} for s in splits]}
    pooled, per_world, failed = pooled_steps(job, opts.real_worlds, threads=1, timeout_s=opts.world_timeout,
                                             log=log)
    best = methods[BEST]["split"]
    b = labels.get(best)
    for m in methods.values():
        s = m["split"] and labels.get(m["split"])
        if s in pooled:
            m["step_s"] = median(pooled[s])
            m["world_steps_s"] = [median(w[s]) for w in per_world if s in w]
            if b in pooled:  # paired round by round: the host's drift between rounds cancels
                m["step_vs_best"] = paired_ratio(pooled[s], pooled[b])
                m["step_vs_best_interval"] = paired_ratio_interval(pooled[s], pooled[b])
                m["step_vs_best_per_world"] = [paired_ratio(w[s], w[b]) for w in per_world if s in w and b in w]
    return {"ran": bool(per_world), "rounds": opts.real_rounds, "steps_per_round": opts.steps,
            "worlds": len(per_world), "not_run": failed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)} at smaller sizes, fewer rounds")
    ap.add_argument("--smoke", action="store_true", help="one tiny model, minimal repeats (for the test suite)")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {list(MODELS)}")
    ap.add_argument("--stages", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--finalists", type=int, default=3, help="best layer-level splits re-measured beside the methods'")
    ap.add_argument("--profile-repeats", type=int, default=None)
    ap.add_argument("--layer-repeats", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds of the compute-only re-measurement")
    ap.add_argument("--real-rounds", type=int, default=None, help="interleaved rounds of the real 2-rank pipelines")
    ap.add_argument("--steps", type=int, default=None, help="steps per split per round")
    ap.add_argument("--real-worlds", type=int, default=None, help="fresh 2-rank worlds the real steps are pooled over "
                    "(default 3, --quick and --smoke 1)")
    ap.add_argument("--no-real", action="store_true", help="skip the real 2-rank pipelines")
    ap.add_argument("--world-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args(argv)
    size = "smoke" if opts.smoke else "quick" if opts.quick else "full"
    defaults = {"smoke": (1, 1, 1, 1, 1, 1), "quick": (3, 3, 5, 3, 1, 1), "full": (5, 5, 11, 7, 2, 3)}[size]
    for attr, d in zip(("profile_repeats", "layer_repeats", "rounds", "real_rounds", "steps", "real_worlds"), defaults):
        if getattr(opts, attr) is None:
            setattr(opts, attr, d)
    unknown = [m for m in opts.models or () if m not in MODELS]
    if unknown:
        ap.error(f"--models {unknown}: not benchmark models; choose from {list(MODELS)}")
    if any(p < 2 for p in opts.stages):
        ap.error(f"--stages {opts.stages}: every stage count must be >= 2")
    names = opts.models or (["mlp"] if opts.smoke else list(QUICK_MODELS) if opts.quick else list(MODELS))
    out = opts.out or str(Path(__file__).parent / ("results.json" if size == "full" else f"results_{size}.json"))
    torch.set_num_threads(1)  # as each rank runs: two ranks share this host's two cores

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0, host_start = time.perf_counter(), host_info()
    log(f"peers: {len(names)} models, {size} sizes, stages {opts.stages}")
    rows = [bench_model(n, size, opts, log) for n in names]
    payload = {
        "benchmark": "peers", "size": size, "stages": opts.stages, "schedule": "1F1B", "threads_per_process": 1,
        "repeats": {k: getattr(opts, k) for k in ("profile_repeats", "layer_repeats", "rounds", "real_rounds", "steps",
                                                  "real_worlds")},
        "host_start": host_start, "host_end": host_info(), "rows": rows, "wall_s": time.perf_counter() - t0,
    }
    path = write_result(out, payload)
    log(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
