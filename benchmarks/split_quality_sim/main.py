"""Split quality at scale, simulated from measured segment costs: p = 2 ... 32 stages.

Real pipelines of 32 ranks need 32 devices; this benchmark instead measures every segment
of each model once (``profile_segments``: forward and backward timed, activation bytes
counted) and then, for p = 2, 4, 8, 16, 32, plans the model with
``autopipe.partition(..., planner=PlannerOptions(cost=profile))`` and reads the plan's figures:

* autopipe's predicted step time (the simulated 1F1B step, ``4p`` micro-batches) and its
  bottleneck stage (compute + communication per micro-batch);
* the same two figures for each peer tool's split (``plan.baselines``: DeepSpeed 0.19.8
  ``parameters`` and ``uniform``, torchtitan 0.3.0's default, torchgpipe 0.0.7
  ``balance_by_time``, torchpippy 0.2.0 ``split_into_equal_size``, the FLOPs DP of torchtitan
  PR #2113) - costed by the same model and simulated under the same schedule;
* the ideal lower bounds beside them: ``lower_bound_s`` = max(total compute / p, heaviest
  segment) for the bottleneck, and the plan's ``step_lower_bound_s`` for the step.

Everything here is the cost model's prediction; ``benchmarks/split_quality`` and
``benchmarks/prediction_accuracy`` check the model against real runs. The models are
deeper than in those benchmarks (16-32 blocks) so 32 stages are possible; a peer whose rule
gives no split for a model or stage count (``plan.baselines[i].reason``) is reported as missing.

    python benchmarks/split_quality_sim/main.py            # 7 models, p = 2 ... 32
    python benchmarks/split_quality_sim/main.py --quick    # 3 models, p = 2, 4, 8
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
from _pipebench import host_info  # noqa: E402

import autopipe  # noqa: E402
from zoo import build  # noqa: E402
from autopipe.planning.profile import profile_segments  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402

# Deep versions of the zoo models: enough blocks (and legal split points) for 32 stages.
DEEP: dict[str, dict[str, Any]] = {
    "seed_transformer": dict(zoo="seed_transformer", vocab_size=16000, d_model=64, num_heads=4, d_ff=256,
                             num_layers=32, batch=2, seq_len=32),
    "gpt2_untied": dict(zoo="gpt2_untied", n_layer=32, n_embd=64, n_head=4, vocab_size=16000, batch=2, seq_len=32),
    "gpt2_tied": dict(zoo="gpt2_tied", n_layer=32, n_embd=64, n_head=4, vocab_size=16000, batch=2, seq_len=32),
    "llama": dict(zoo="llama", num_hidden_layers=32, hidden_size=64, num_attention_heads=4, vocab_size=16000,
                  batch=2, seq_len=32),
    "cnn": dict(zoo="cnn", image_size=128, widths=(16, 24, 32, 48, 64, 96, 128), batch=4),
    "unet": dict(zoo="unet", base_width=8, depth=5, image_size=64, batch=2),
    "mlp": dict(zoo="mlp", widths=(256, 2560, 256, 1280, 128, 1024, 256, 2560, 128, 512, 256, 2560, 256,
                                   1024, 128, 1280, 256, 2560, 256, 1024, 128, 512, 256, 2560, 256, 1280, 128,
                                   1024, 256, 2560, 256, 512, 256), batch=32),
}
QUICK: dict[str, dict[str, Any]] = {
    "seed_transformer": dict(zoo="seed_transformer", vocab_size=16000, d_model=64, num_heads=4, d_ff=256,
                             num_layers=8, batch=2, seq_len=32),
    "cnn": dict(zoo="cnn", image_size=64, widths=(16, 32, 64, 128, 256), batch=4),
    "mlp": dict(zoo="mlp", batch=32),
}
SMOKE = {"mlp": dict(zoo="mlp", widths=(16, 160, 16, 64, 16, 128, 16), batch=4)}
BASELINE_ORDER = ("deepspeed_parameters", "deepspeed_uniform", "torchtitan_default", "torchgpipe_time",
                  "pippy_equal_size", "flops_dp")


def bench_model(name: str, config: dict[str, Any], stages: list[int], opts: argparse.Namespace, log) -> dict[str, Any]:
    t0 = time.perf_counter()
    cfg = dict(config)
    model, args = build(cfg.pop("zoo"), **cfg)
    traced = trace(model, args)
    costs = profile_segments(traced, device=opts.device, warmup=1, repeats=opts.repeats, progress=False)
    row: dict[str, Any] = {"model": name, "config": config, "segments": traced.num_segments,
                           "params": sum(p.numel() for p in model.parameters()),
                           "total_compute_s": sum(c.fwd_s + c.bwd_s for c in costs),
                           "heaviest_segment_s": max(c.fwd_s + c.bwd_s for c in costs), "by_stages": []}
    for p in stages:
        if p > traced.num_segments:
            row["by_stages"].append({"stages": p, "note": f"only {traced.num_segments} segments"})
            continue
        m = opts.microbatch_factor * p
        plan = autopipe.partition(model, p, example_args=args, schedule=opts.schedule, n_microbatches=m,
                                  planner=autopipe.PlannerOptions(cost=costs, profiling=autopipe.ProfileOptions(device=opts.device, progress=False)))
        entry: dict[str, Any] = {
            "stages": p, "n_microbatches": m,
            "autopipe": {"bottleneck_s": plan.bottleneck_s, "step_s": plan.predicted_step_s},
            "lower_bound_s": plan.lower_bound_s, "step_lower_bound_s": plan.search.step_lower_bound_s if plan.search else None,
            "baselines": {},
        }
        applicable = [b for b in plan.baselines if not b.reason]  # a peer whose rule gives no split here is left out
        for b in sorted(applicable, key=lambda b: BASELINE_ORDER.index(b.name) if b.name in BASELINE_ORDER else 9):
            entry["baselines"][b.name] = {"bottleneck_s": b.bottleneck_s, "step_s": b.predicted_step_s,
                                          "step_vs_autopipe": b.predicted_step_s / plan.predicted_step_s}
        entry["autopipe"]["bottleneck_vs_lower_bound"] = plan.bottleneck_s / plan.lower_bound_s
        if entry["step_lower_bound_s"]:
            entry["autopipe"]["step_vs_lower_bound"] = plan.predicted_step_s / entry["step_lower_bound_s"]
        row["by_stages"].append(entry)
        vs = "  ".join(f"{k} x{v['step_vs_autopipe']:.3f}" for k, v in entry["baselines"].items())
        log(f"  {name:16s} p={p:2d}  autopipe step {plan.predicted_step_s * 1e3:8.2f} ms "
            f"(x{entry['autopipe'].get('step_vs_lower_bound', float('nan')):.3f} of its bound; bottleneck "
            f"x{entry['autopipe']['bottleneck_vs_lower_bound']:.3f})  baselines: {vs or 'none can split'}")
    row["wall_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 shallower models, p = 2, 4, 8")
    ap.add_argument("--smoke", action="store_true", help="one tiny model, p = 2, 4 (for the test suite)")
    ap.add_argument("--device", default="cpu", help="where segments are profiled: cpu (default) or cuda")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {list(DEEP)}")
    ap.add_argument("--stages", nargs="*", type=int, default=None)
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--microbatch-factor", type=int, default=4, help="micro-batches = factor x stages")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while profiling (CPU)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args(argv)
    size = "smoke" if opts.smoke else "quick" if opts.quick else "full"
    configs = {"smoke": SMOKE, "quick": QUICK, "full": DEEP}[size]
    if opts.models:
        configs = {k: configs.get(k, DEEP[k]) for k in opts.models}
    stages = opts.stages or {"smoke": [2, 4], "quick": [2, 4, 8], "full": [2, 4, 8, 16, 32]}[size]
    opts.repeats = opts.repeats or {"smoke": 1, "quick": 3, "full": 5}[size]
    out = opts.out or str(Path(__file__).parent / ("results.json" if size == "full" else f"results_{size}.json"))
    if opts.device == "cpu":
        torch.set_num_threads(opts.threads)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0, host_start = time.perf_counter(), host_info()
    log(f"split quality (simulated): {list(configs)} x p={stages}, {opts.schedule} with {opts.microbatch_factor}p "
        f"micro-batches, profiled on {opts.device}")
    rows = [bench_model(n, c, stages, opts, log) for n, c in configs.items()]
    payload = {"benchmark": "split_quality_sim", "size": size, "device": opts.device, "schedule": opts.schedule,
               "microbatch_factor": opts.microbatch_factor, "threads": opts.threads, "repeats": opts.repeats,
               "host_start": host_start, "host_end": host_info(), "rows": rows, "wall_s": time.perf_counter() - t0}
    path = write_result(out, payload)
    log(f"wrote {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
