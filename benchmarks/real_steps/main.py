"""Real steps of every layer-level split of stock decoder LMs: measured, predicted, and what autopipe chose.

For each Hugging Face decoder LM below (the library's own class, its default config with
only the sizes made small, token ids in, logits out) this script

1. plans 2 stages with ``autopipe.partition(model, 2, example_args)`` as a user would
   (1F1B, 4 micro-batches, measured costs, the token cross-entropy the planner assumes for
   a language model), and reads from the plan its predicted step for every split below
   (:meth:`autopipe.Plan.split_step_s`: the same cost model and simulator);
2. lists every **layer-level** split: each boundary between the layers a framework sees
   (the embedding, each decoder layer, the final norm, the head:
   :func:`autopipe.planning.baselines.layer_units`), plus autopipe's own split where it is
   not one of them;
3. runs all of them as real 2-rank :class:`autopipe.Pipeline` training steps (gloo on
   127.0.0.1, one thread per rank), built side by side and stepped in interleaved rounds
   (A B C A B C ...); a split's step is the median over the rounds of the slower rank's
   step time. Inside the same world each split's stages are also timed in running steps
   (:meth:`autopipe.Pipeline.measure_stage_times`);
4. runs :func:`autopipe.tune` on the plan in the same world (its best three splits, measured
   on the ranks) and records the split it keeps; the plan, calibrated to the step tune
   measured for that split, predicts every split once more.

It reports, per model: autopipe's measured step over the fastest measured split's, and
every split's predicted step against its measured one. Nothing is asserted; the results go
to ``results.json`` beside this file, which ``benchmarks/render_docs.py`` renders into
``docs/benchmarks.md``. Hold the machine for it (``flock``): other work on the cores
turns a fast split into a slow one.

    python benchmarks/real_steps/main.py                      # 6 models x 5 worlds, about 15 minutes on 2 cores
    python benchmarks/real_steps/main.py --models llama gpt2  # a subset
    python benchmarks/real_steps/main.py --quick              # 2 models, fewer rounds
    python benchmarks/real_steps/main.py --smoke              # one tiny model: checks the script
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import (fastest_paired, host_info, median, paired_ratio_interval, run_world,  # noqa: E402
                        segment_times, stack_microbatches)

#: Model sizes. "full": 4 decoder layers of width 128 and an 8k-token vocabulary, so the head
#: costs about as much as two layers (as in a real LM, where vocabulary x width is large);
#: "smoke": the smallest that still has every layer kind, for the test suite.
SIZES = {"full": dict(width=128, layers=4, heads=4, vocab=8000, batch=2, seq=32),
         "smoke": dict(width=32, layers=2, heads=2, vocab=300, batch=2, seq=8)}
#: name -> (transformers model class, config class)
MODELS: dict[str, tuple[str, str]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config"),
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config"),
}


def config_sizes(name: str, size: str) -> dict[str, Any]:
    """The config fields that make model ``name`` the size ``size``; every other field keeps its default."""
    z = SIZES[size]
    if name == "gpt2":
        return dict(n_layer=z["layers"], n_embd=z["width"], n_head=z["heads"], vocab_size=z["vocab"], n_positions=256)
    fields = dict(hidden_size=z["width"], num_hidden_layers=z["layers"], num_attention_heads=z["heads"],
                  num_key_value_heads=z["heads"], intermediate_size=4 * z["width"], vocab_size=z["vocab"],
                  max_position_embeddings=256)
    if name == "qwen3":
        fields["head_dim"] = z["width"] // z["heads"]
    if name == "phi3":
        fields["original_max_position_embeddings"] = 256
    return fields


QUICK_MODELS = ("llama", "gpt2")
N_MICROBATCHES = 4


def build(name: str, size: str = "full") -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor]:
    """Model ``name`` (seeded weights, no dropout), one micro-batch of token ids, and its next-token target."""
    from zoo.thirdparty import _hf_config, _hf_model, _no_dropout_modules

    model_class, config_class = MODELS[name]
    config = _hf_config(config_class, False, **config_sizes(name, size), use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _no_dropout_modules(_hf_model(model_class, config))
    z = SIZES[size]
    ids = torch.randint(0, z["vocab"], (z["batch"], z["seq"] + 1), generator=torch.Generator().manual_seed(1))
    return model, (ids[:, :-1].contiguous(),), ids[:, 1:].contiguous()


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy on the model's logits (what the planner assumes when given no loss)."""
    logits = output.logits if hasattr(output, "logits") else output
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())


def layer_splits(model: torch.nn.Module, args: tuple) -> list[list[str]]:
    """Every 2-stage split at a boundary between the layers a framework sees, in model order."""
    from autopipe.planning.baselines import layer_units
    from autopipe.planning.tracing import trace

    traced = trace(model, args)
    units = layer_units(traced)
    return [[traced.segments[c].name] for c in units.segment_cuts(list(range(len(units.names) + 1)))]


def step_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Build a Pipeline per split, step them in interleaved rounds; this rank's step times and stage times."""
    from autopipe import Pipeline

    model, args, target_mb = build(job["model"], job["size"])
    m = N_MICROBATCHES
    batch, target = stack_microbatches(args, m), torch.cat([target_mb] * m)
    # The Pipeline planning for itself, as a user constructs it (profiled in every rank at once).
    planned, in_ranks = [], {}
    for _ in range(job.get("pipeline_plans", 0)):
        auto = Pipeline(model, example_args=args, loss_fn=lm_loss, schedule="1F1B", n_microbatches=m,
                        device=torch.device("cpu"))
        planned.append(list(auto.plan.split_points))
        # Its plan's prediction of every split: a profile the ranks took together, just before the steps.
        in_ranks = {label: auto.plan.split_step_s(split) for label, split in job["splits"].items()}
        del auto
    pipes = {}
    for label, split in job["splits"].items():
        pipes[label] = Pipeline(model, example_args=args, loss_fn=lm_loss, schedule="1F1B", n_microbatches=m,
                                split_points=split, device=torch.device("cpu"))
        for _ in range(2):  # the first steps set up buffers and communication
            pipes[label].zero_grad()
            pipes[label].step(*batch, target=target)
    amid: list[dict[str, list[float]]] = []
    from autopipe.planning.profile import profile_segments
    from autopipe.planning.tracing import trace

    traced = trace(model, args) if job.get("profile_amid") and rank == 0 else None

    def profile_amid() -> None:  # rank 0 profiles the model as partition() does; rank 1 waits
        if traced is not None:
            costs = profile_segments(traced, device=torch.device("cpu"), warmup=1, repeats=3, progress=False)
            amid.append(segment_times(costs))
    times = interleaved_steps(pipes, batch, target, rounds=job["rounds"], steps=job["steps"],
                              between=profile_amid if job.get("profile_amid") else None)
    if not job.get("measure_more", True):  # a further world: its steps only
        return {"times": times, "amid": amid}
    in_run = {label: pipe.measure_stage_times(*batch, target=target, steps=3) for label, pipe in pipes.items()}
    del pipes
    # autopipe.tune as a user would call it: the plan's best few splits, measured on the ranks.
    from autopipe import Plan, tune

    tuned = tune(model, *batch, target=target, plan=Plan.from_dict(job["plan"]), candidates=3, rounds=job["rounds"],
                 loss_fn=lm_loss, example_args=args, device=torch.device("cpu"))
    record = tuned.plan.tuning
    # The plan calibrated to the step tune measured for the split it kept: real steps, taken in this
    # world after the rounds, setting the level of the prediction of every split.
    after_tune = {}
    if tuned.plan.predicted_step_s > 0:
        try:
            level_set = tuned.plan.calibrate({"step_s": record.measured_step_s[record.chosen]})
            after_tune = {label: level_set.split_step_s(split) for label, split in job["splits"].items()}
        except ValueError:  # a step under what the plan charges beyond compute: no level to set
            pass
    return {"times": times, "amid": amid, "in_run": in_run, "pipeline_plans": planned, "predicted_in_ranks_s": in_ranks,
            "predicted_after_tune_s": after_tune,
            "tuned": {"split_points": record.split_points, "measured_step_s": record.measured_step_s,
                      "predicted_step_s": record.predicted_step_s, "chosen": record.chosen}}


def interleaved_steps(pipes: dict[str, Any], batch: tuple, target: torch.Tensor, *, rounds: int,
                      steps: int, between: Any = None) -> dict[str, list[float]]:
    """Each pipeline's step times over ``rounds`` interleaved rounds of ``steps`` steps (A B C A B C ...).

    ``between``, when given, runs after the first round and every other one from there (untimed),
    the ranks meeting after it.
    """
    import torch.distributed as dist

    times: dict[str, list[float]] = {label: [] for label in pipes}
    for r in range(rounds):
        for label, pipe in pipes.items():
            for _ in range(steps):
                pipe.zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(*batch, target=target)
                times[label].append(time.perf_counter() - t0)
        if between is not None and r % 2 == 0:
            between()
            dist.barrier()
    return times


def run_model(name: str, *, size: str, rounds: int, steps: int, plans: int, worlds: int, log) -> dict[str, Any]:
    """Plan (``plans`` times, to see whether the split holds), list the splits, run them; one model's row.

    The splits run in ``worlds`` fresh 2-rank worlds one after another; a split's step is the
    median over all of them, since which of two close splits wins moves with the host's
    state from one world to the next.
    """
    import autopipe

    model, args, _ = build(name, size)
    host_start = host_info()
    t0 = time.perf_counter()
    plan = autopipe.partition(model, 2, args, schedule="1F1B", n_microbatches=N_MICROBATCHES)
    planner_s = time.perf_counter() - t0
    # The same call again, each with a fresh profile: a stable planner gives the same split every time.
    replans = [autopipe.partition(model, 2, args, schedule="1F1B", n_microbatches=N_MICROBATCHES)
               for _ in range(plans - 1)]
    splits = {"+".join(s): s for s in layer_splits(model, args)}
    layer_level = set(splits)
    chosen = "+".join(plan.split_points)
    splits.setdefault(chosen, list(plan.split_points))
    flops = plan.baseline("flops_dp")
    log(f"  {name}: autopipe chose {chosen} (planned in {planner_s:.1f} s); running {len(splits)} splits")
    job = {"model": name, "size": size, "splits": splits, "rounds": rounds, "steps": steps, "plan": plan.to_dict(),
           "pipeline_plans": 1 if plans > 1 else 0, "profile_amid": True}
    results = run_world(step_worker, 2, job, timeout_s=900.0)
    further = [run_world(step_worker, 2, {**job, "pipeline_plans": 0, "measure_more": False}, timeout_s=900.0)
               for _ in range(worlds - 1)]
    # A step ends when its slower rank ends: pair the ranks' times step by step, per world.
    per_world = [{label: [max(a, b) for a, b in zip(w[0]["times"][label], w[1]["times"][label])] for label in splits}
                 for w in [results, *further]]
    pooled = {label: [t for w in per_world for t in w[label]] for label in splits}
    amid_plan = _profiled_amid(plan, [p for w in [results, *further] for p in w[0]["amid"]])
    rows = {}
    for label, split in splits.items():
        rows[label] = {"split": split, "layer_level": label in layer_level, "measured_step_s": median(pooled[label]),
                       "world_steps_s": [median(w[label]) for w in per_world],
                       "predicted_step_s": plan.split_step_s(split),
                       "predicted_in_ranks_s": results[0]["predicted_in_ranks_s"].get(label),
                       "predicted_amid_s": amid_plan.split_step_s(split) if amid_plan is not None else None,
                       "predicted_after_tune_s": results[0].get("predicted_after_tune_s", {}).get(label),
                       "in_run": results[0]["in_run"][label], "planned_stage_s": _planned_stage_times(plan, split)}
    # Every split's steps over the fastest's, paired round by round (the splits were interleaved,
    # so each pair saw the same state of the host; it drifts between rounds and worlds).
    fastest, vs_fastest = fastest_paired(pooled)
    for label, r in rows.items():
        r["vs_fastest"] = vs_fastest[label]
        r["prediction_error"] = r["predicted_step_s"] / r["measured_step_s"] - 1.0
        if r["predicted_in_ranks_s"] is not None:
            r["in_ranks_error"] = r["predicted_in_ranks_s"] / r["measured_step_s"] - 1.0
        if r["predicted_amid_s"] is not None:
            r["amid_error"] = r["predicted_amid_s"] / r["measured_step_s"] - 1.0
        if r["predicted_after_tune_s"] is not None:
            r["after_tune_error"] = r["predicted_after_tune_s"] / r["measured_step_s"] - 1.0
    tuned = results[0]["tuned"]
    tuned_label = "+".join(tuned["split_points"][tuned["chosen"]])
    flops_label = "+".join(flops.split_points) if flops.split_points else None
    return {"model": name, "class": MODELS[name][0], "size": size, "planner_s": planner_s, "chosen": chosen,
            "flops_dp": flops_label, "fastest": fastest, "chosen_vs_fastest": rows[chosen]["vs_fastest"],
            "flops_dp_vs_fastest": rows[flops_label]["vs_fastest"] if flops_label in rows else None,
            "tuned": {**tuned, "label": tuned_label,
                      "vs_fastest": rows[tuned_label]["vs_fastest"] if tuned_label in rows else None},
            "splits": rows, "plan_notes": list(plan.notes), "worlds": worlds,
            "host_start": host_start, "host_end": host_info(),
            "chosen_vs_fastest_per_world": [fastest_paired(w)[1][chosen] for w in per_world],
            "chosen_vs_fastest_interval": paired_ratio_interval(pooled[chosen], pooled[fastest]),
            "partition_splits": ["+".join(p.split_points) for p in [plan, *replans]],
            # Each call's prediction of the first call's split: how far one profile's level moves from the next's.
            "partition_predicted_s": [p.split_step_s(list(plan.split_points)) for p in [plan, *replans]],
            "pipeline_splits": ["+".join(x) for x in results[0]["pipeline_plans"]]}


def _profiled_amid(plan: Any, profiles: list[dict[str, list[float]]]) -> Any:
    """``plan`` with its segments' times replaced by the mean of ``profiles``, taken between rounds of steps.

    The same cost model on profiles taken over the same minutes as the steps: a drift of the
    host between a profile and the steps does not explain what is left of its error.
    None without profiles.
    """
    if not profiles:
        return None
    if any(len(p["fwd_s"]) != len(plan.segments) for p in profiles):
        raise RuntimeError("a profile taken between the rounds has another number of segments than the plan")
    mean = {k: [statistics.fmean(p[k][i] for p in profiles) for i in range(len(plan.segments))]
            for k in ("fwd_s", "bwd_s", "accum_s")}
    amid = copy.copy(plan)
    amid.segments = [replace(seg, fwd_s=mean["fwd_s"][i], bwd_s=mean["bwd_s"][i], accum_s=mean["accum_s"][i])
                     for i, seg in enumerate(plan.segments)]
    return amid


def _planned_stage_times(plan: Any, split: list[str]) -> dict[str, list[float]]:
    """The plan's own forward and backward seconds per stage of ``split`` (per micro-batch)."""
    from autopipe.planning.costmodel import stage_times_s

    fwd, bwd = stage_times_s(plan.segments, plan.segment_cuts(split), plan.n_microbatches)
    return {"fwd_s": fwd, "bwd_s": bwd}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), help="a subset of the models")
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)} only, fewer rounds")
    ap.add_argument("--smoke", action="store_true", help="one tiny model, one round: checks the script")
    ap.add_argument("--plans", type=int, default=5, help="partition() calls per model, each with a fresh profile, "
                    "to see whether the split holds (default 5; 1 skips it and the Pipeline's own plan)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per world (default 5, --quick 3)")
    ap.add_argument("--worlds", type=int, default=None, help="fresh 2-rank worlds per model, their steps pooled "
                    "(default 5, --quick and --smoke 1)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each rank runs: the profile sees what a rank sees
    os.environ.setdefault("AUTOPIPE_PROGRESS", "0")
    names = a.models or (["gpt2"] if a.smoke else list(QUICK_MODELS) if a.quick else list(MODELS))
    rounds = a.rounds or (1 if a.smoke else 3 if a.quick else 5)
    worlds = a.worlds or (1 if a.smoke or a.quick else 5)
    size = "smoke" if a.smoke else "full"
    start, t0 = host_info(), time.perf_counter()
    rows = []
    for name in names:
        rows.append(run_model(name, size=size, rounds=rounds, steps=1 if a.smoke else 2, plans=1 if a.smoke else a.plans,
                              worlds=worlds, log=print))
        r = rows[-1]
        print(f"    chosen {r['chosen']}: {r['chosen_vs_fastest']:.3f}x the fastest ({r['fastest']}; per world "
              f"{', '.join(f'{x:.3f}' for x in r['chosen_vs_fastest_per_world'])}); "
              f"tune kept {r['tuned']['label']}; partition() x{len(r['partition_splits'])}: "
              f"{sorted(set(r['partition_splits']))}; Pipeline: {r['pipeline_splits']}")
        for label, s in r["splits"].items():
            print(f"      {label:40s} measured {s['measured_step_s'] * 1e3:6.1f} ms  predicted "
                  f"{s['predicted_step_s'] * 1e3:6.1f} ms  ({s['prediction_error']:+.1%}; profiled in the ranks "
                  f"{s.get('in_ranks_error', float('nan')):+.1%}; amid the steps {s.get('amid_error', float('nan')):+.1%})")
    payload = {"benchmark": "real_steps", "ratios": "paired", "schedule": "1F1B", "n_microbatches": N_MICROBATCHES, "stages": 2,
               "threads_per_process": 1, "rounds": rounds, "worlds": worlds, "steps_per_round": 1 if a.smoke else 2, "quick": a.quick,
               "size": size, "sizes": SIZES[size],
               "host_start": start, "host_end": host_info(), "rows": rows, "wall_s": time.perf_counter() - t0}
    print(f"wrote {write_result(a.out, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
