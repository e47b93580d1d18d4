"""Eager fp32, bf16 autocast, compiled stages and another sequence length: real 2-rank steps against the plan.

For one model (the Hugging Face Llama of ``benchmarks/_pipebench.MODELS``) this script

1. plans a 2-stage 1F1B pipeline three times from measured profiles (one thread, as each
   rank runs): fp32 eager, ``PlannerOptions(mixed_precision="bf16")`` (the segments timed
   under autocast, the cuts counted in the dtypes autocast gives them) and
   ``PlannerOptions(compile=True)`` (torch.compile's default backend; the planner costs eager
   segments and says so);
2. builds the three pipelines side by side on 2 gloo ranks (127.0.0.1, one thread per rank)
   and steps them in interleaved rounds (A B C D A B C D ...), the fourth variant being the
   fp32 pipeline given batches of twice the traced sequence length (its stages traced again
   at that length on the first such call);
3. times every stage inside running steps (``Pipeline.measure_stage_times``) at the traced
   length and folds the times into each plan (``Plan.calibrate``).

A variant's step is the median over the rounds of the slower rank's step. Reported per
variant: the measured step, the plan's prediction (``predicted_step_s``; for the longer
length ``Plan.predict_at``) and the calibrated prediction, with their errors. Nothing is
asserted; the results go to ``results.json`` beside this file, which
``benchmarks/render_docs.py`` renders into ``docs/benchmarks.md``. Hold the machine for it
(``flock``).

    python benchmarks/precision/main.py            # about 4 minutes on 2 cores
    python benchmarks/precision/main.py --smoke    # a tiny model, two rounds: checks the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT.parent), str(ROOT)]
from _common import write_result  # noqa: E402
from _pipebench import ce_loss, host_info, make_model, make_target, median, run_world, stack_microbatches  # noqa: E402

MODEL = "llama"
N_MICROBATCHES = 4
#: label -> the PlannerOptions fields of its plan and pipeline, and the length factor of its batches.
VARIANTS = {"fp32 eager": ({}, 1), "bf16 autocast": ({"mixed_precision": "bf16"}, 1),
            "fp32 compiled": ({"compile": True}, 1), "fp32 eager, 2x length": ({}, 2)}


def plan_all(size: str) -> dict[str, Any]:
    """One plan per precision / compilation (the longer-length variant reuses fp32's)."""
    import autopipe

    torch.set_num_threads(1)  # profiled as each rank runs
    model, args = make_model(MODEL, size)
    with torch.no_grad():
        target = make_target(model(*args))
    plans = {}
    for label, (options, factor) in VARIANTS.items():
        if factor != 1:
            continue
        plans[label] = autopipe.partition(
            model, 2, args, loss_fn=ce_loss, example_target=target, schedule="1F1B", n_microbatches=N_MICROBATCHES,
            planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(progress=False), **options))
    return plans


def longer(args: tuple, factor: int) -> tuple:
    """The micro-batch with every token sequence ``factor`` times as long (dimension 1 repeated)."""
    return tuple(torch.cat([a] * factor, dim=1) if isinstance(a, torch.Tensor) and a.dim() >= 2 else a for a in args)


def step_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Build every variant's pipeline; step them in interleaved rounds; this rank's step times and stage times."""
    import torch.distributed as dist

    from autopipe import Pipeline, Plan, PlannerOptions

    model, args = make_model(MODEL, job["size"])
    with torch.no_grad():
        target_mb = make_target(model(*longer(args, 2)))
    pipes, built_s = {}, {}
    for label, (options, factor) in VARIANTS.items():
        plan_label = next(k for k, (o, f) in VARIANTS.items() if o == options and f == 1)
        mb = longer(args, factor)
        batch = stack_microbatches(mb, N_MICROBATCHES)
        target = torch.cat([target_mb[:, : mb[0].shape[1]]] * N_MICROBATCHES)
        t0 = time.perf_counter()
        if factor != 1:  # the same pipeline, given longer batches
            pipe = pipes[plan_label][0]
        else:
            pipe = Pipeline(model, example_args=args, loss_fn=ce_loss, plan=Plan.from_dict(job["plans"][plan_label]),
                            planner=PlannerOptions(**{k: v for k, v in options.items() if k == "compile"}))
        for _ in range(2):  # the first steps compile, trace another length, set up buffers
            pipe.zero_grad()
            pipe.step(*batch, target=target)
        built_s[label] = time.perf_counter() - t0
        pipes[label] = (pipe, batch, target)
    times: dict[str, list[float]] = {label: [] for label in pipes}
    for _ in range(job["rounds"]):
        for label, (pipe, batch, target) in pipes.items():
            for _ in range(job["steps"]):
                pipe.zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(*batch, target=target)
                times[label].append(time.perf_counter() - t0)
    in_run = {label: pipe.measure_stage_times(*batch, target=target, steps=job["steps"])
              for label, (pipe, batch, target) in pipes.items() if VARIANTS[label][1] == 1}
    dist.barrier()
    return {"times": times, "in_run": in_run, "built_s": built_s}


def main(argv: list[str] | None = None) -> None:
    """Plan, measure, write results.json."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and two rounds: checks the script")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    a = ap.parse_args(argv)
    size, rounds, steps = ("smoke", 2, 1) if a.smoke else ("full", a.rounds, 2)
    before, started = host_info(), time.perf_counter()
    plans = plan_all(size)
    print("planned:", {k: (p.split_points, round(p.predicted_step_s * 1e3, 1)) for k, p in plans.items()})
    job = {"size": size, "rounds": rounds, "steps": steps, "plans": {k: p.to_dict() for k, p in plans.items()}}
    results = run_world(step_worker, 2, job, threads=1, timeout_s=1200)
    model, args = make_model(MODEL, size)
    rows = []
    for label, (options, factor) in VARIANTS.items():
        plan = plans[next(k for k, (o, f) in VARIANTS.items() if o == options and f == 1)]
        slower = [max(steps_) for steps_ in zip(*(r["times"][label] for r in results))]
        measured = median(slower)
        length = plan.sequence_length * factor
        predicted = plan.predict_at(length) if factor != 1 else plan.predicted_step_s
        row = {"variant": label, "length": length, "split_points": plan.split_points,
               "measured_s": measured, "predicted_s": predicted, "predicted_error": predicted / measured - 1,
               "built_s": max(r["built_s"][label] for r in results), "notes": plan.notes}
        in_run = results[0]["in_run"].get(label)
        if in_run is not None:
            calibrated = plan.calibrate(in_run)
            row["calibrated_s"] = calibrated.predicted_step_s
            row["calibrated_error"] = calibrated.predicted_step_s / measured - 1
        rows.append(row)
        print(f"{label:24s} measured {measured * 1e3:7.1f} ms  predicted {predicted * 1e3:7.1f} ms "
              f"({row['predicted_error']:+.1%})" + (f"  calibrated {row['calibrated_s'] * 1e3:7.1f} ms "
                                                    f"({row['calibrated_error']:+.1%})" if "calibrated_s" in row else ""))
    write_result(a.out, {"model": MODEL, "size": size, "schedule": "1F1B", "n_microbatches": N_MICROBATCHES,
                         "microbatch_shape": list(args[0].shape), "rounds": rounds, "steps_per_round": steps,
                         "rows": rows, "threads_per_process": 1, "host_start": before, "host_end": host_info(),
                         "wall_s": time.perf_counter() - started})


if __name__ == "__main__":
    main()
