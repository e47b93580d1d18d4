"""One GPU: the plan's predicted step against torch's pipeline runtime on a single rank.

A machine with one GPU cannot run two NCCL ranks (NCCL refuses two ranks on one device), so
this checks what one GPU can: whether the profile's compute on CUDA adds up to what the
stages take in torch's runtime, and what the runtime costs per action on CUDA beyond that,
which autopipe's CUDA default (``action_overhead_s`` 0) has never measured. For each model
x schedule x micro-batch count:

1. profile the model on the GPU (it lives there, so timed in rounds with the L2 flushed) and
   plan it for one rank: ``1F1B`` with one stage, ``Interleaved1F1B`` with two stages on the
   rank (NCCL lets a rank send to itself; gloo does not);
2. run every plan as an :class:`autopipe.Pipeline` on ``cuda:0`` (an NCCL world of one), all
   side by side in interleaved rounds, and take the median step;
3. read the runtime's cost per action each case implies,
   ``(measured - predicted with no overhead) / actions``, fit one figure on the m = 4 cases
   and predict the m = 8 cases with it (out of sample).

Nothing is asserted; the table and the JSON (``results.json`` here, or ``--out``) are the result.

    python benchmarks/gpu_one_rank/main.py                  # needs CUDA
    python benchmarks/gpu_one_rank/main.py --device cpu     # the same on the CPU (gloo, 1F1B only)
    python benchmarks/gpu_one_rank/main.py --device cpu --smoke --out /tmp/r.json   # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import MODELS, ce_loss, host_info, make_target, stack_microbatches, world_of_one  # noqa: E402

import autopipe  # noqa: E402
from zoo import build  # noqa: E402
from autopipe.planning.profile import profile_segments  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402

# Sizes that give a GPU some work per micro-batch (the CPU benchmarks' sizes take tens of
# microseconds there); the CNN, U-Net and MLP keep the CPU benchmarks' full size, as does
# every model with --device cpu.
GPU_SIZES = {
    "seed_transformer": dict(vocab_size=32000, d_model=512, num_heads=8, d_ff=2048, num_layers=8, batch=8, seq_len=256),
    "gpt2_tied": dict(n_layer=8, n_embd=512, n_head=8, vocab_size=32000, batch=8, seq_len=256),
}
SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))


def _model(name: str, device: torch.device, smoke: bool = False) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    spec = MODELS[name]
    size = spec.smoke if smoke else GPU_SIZES.get(name, spec.full) if device.type == "cuda" else spec.full
    model, args = build(spec.zoo, **size)
    return model.to(device), tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, opts: argparse.Namespace, device: torch.device, log) -> list[dict[str, Any]]:
    model, args = _model(name, device, opts.smoke)
    with torch.no_grad():
        target = make_target(model(*args).float().cpu()).to(device)
    costs = profile_segments(trace(model, args), device=device, warmup=2, repeats=opts.profile_repeats,
                             progress=False)
    whole = asdict(costs.whole) if costs.whole is not None else None
    if whole is not None:
        log(f"  {name}: segments one by one {whole['segments_fwd_s'] * 1e3:.2f} ms forward, "
            f"{whole['segments_bwd_s'] * 1e3:.2f} ms backward; the whole graph {whole['fwd_s'] * 1e3:.2f} ms and "
            f"{whole['bwd_s'] * 1e3:.2f} ms ({'fitted to it' if whole['fitted'] else 'not fitted'})")
    cases = []
    for schedule, v in opts.schedule_list:
        for m in opts.microbatches:
            plan = autopipe.partition(model, 1, args, schedule=schedule, n_microbatches=m, loss_fn=ce_loss,
                                      example_target=target,
                                      planner=autopipe.PlannerOptions(stages_per_rank=v, cost=costs, devices=autopipe.Device(action_overhead_s=0.0), profiling=autopipe.ProfileOptions(device=device, progress=False)))
            pipe = autopipe.Pipeline(model, example_args=args, loss_fn=ce_loss, plan=plan, device=device)
            batch, batch_target = stack_microbatches(args, m), torch.cat([target] * m)
            cases.append(dict(schedule=schedule, stages_per_rank=v, m=m, plan=plan, pipe=pipe,
                              batch=batch, target=batch_target, steps=[]))
    for case in cases:  # warm-up: allocator, NCCL, autotuning
        for _ in range(3):
            case["pipe"].step(*case["batch"], target=case["target"])
        _sync(device)
    for _ in range(opts.rounds):  # interleaved: every case once per round
        for case in cases:
            for p in case["pipe"].parameters():  # as a training loop clears them
                p.grad = None
            _sync(device)
            t0 = time.perf_counter()
            case["pipe"].step(*case["batch"], target=case["target"])
            _sync(device)
            case["steps"].append(time.perf_counter() - t0)
    rows = []
    for case in cases:
        plan, m, v = case["plan"], case["m"], case["stages_per_rank"]
        measured = statistics.median(case["steps"])
        actions = 2 * m * v  # one forward and one backward per micro-batch per stage
        row = dict(model=name, schedule=case["schedule"], stages_per_rank=v, m=m, measured_s=measured, profile_whole=whole,
                   predicted_s=plan.predicted_step_s, implied_overhead_s=(measured - plan.predicted_step_s) / actions,
                   actions=actions, steps_s=case["steps"])
        log(f"  {name:16s} {case['schedule']:15s} x{m}  measured {measured * 1e3:8.2f} ms  predicted "
            f"{plan.predicted_step_s * 1e3:8.2f} ms ({(plan.predicted_step_s / measured - 1) * 100:+6.1f}%)  "
            f"implied overhead {row['implied_overhead_s'] * 1e6:7.1f} us/action")
        rows.append(row)
    for case in cases:
        del case["pipe"]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default; needs one GPU) or cpu (gloo, 1F1B only)")
    ap.add_argument("--models", nargs="*", default=["seed_transformer", "gpt2_tied", "cnn", "unet", "mlp"])
    ap.add_argument("--microbatches", nargs="*", type=int, default=[4, 8])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--profile-repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="the MLP at its smallest, m = 2 and 4, two rounds (for the test suite)")
    ap.add_argument("--out", default=None, help="JSON file (default: results.json beside this script)")
    opts = ap.parse_args(argv)
    if opts.smoke:
        opts.models, opts.microbatches, opts.rounds, opts.profile_repeats = ["mlp"], [2, 4], 2, 1
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --device cpu")
    opts.schedule_list = [s for s in SCHEDULES if device.type == "cuda" or s[1] == 1]
    world_of_one(device)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in opts.models:
        rows += bench_model(name, opts, device, lambda s: print(s, flush=True))
    # One overhead per action, fitted on the m = 4 cases, predicts the m = 8 cases.
    fit_m, check_m = min(opts.microbatches), max(opts.microbatches)
    overhead = statistics.median(r["implied_overhead_s"] for r in rows if r["m"] == fit_m)
    print(f"\nruntime overhead per action on {device.type}, fitted on m={fit_m}: {overhead * 1e6:.1f} us")
    errors_plain, errors_fit = [], []
    for r in rows:
        r["predicted_with_fit_s"] = r["predicted_s"] + overhead * r["actions"]
        if r["m"] == check_m:
            errors_plain.append(r["predicted_s"] / r["measured_s"] - 1)
            errors_fit.append(r["predicted_with_fit_s"] / r["measured_s"] - 1)
            print(f"  {r['model']:16s} {r['schedule']:15s} x{r['m']}  no overhead {errors_plain[-1] * 100:+6.1f}%  "
                  f"with the fitted overhead {errors_fit[-1] * 100:+6.1f}%")
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "overhead_fitted_s": overhead, "fit_m": fit_m, "check_m": check_m,
        "median_abs_error_no_overhead": statistics.median(abs(e) for e in errors_plain),
        "median_abs_error_fitted": statistics.median(abs(e) for e in errors_fit),
        "took_s": time.perf_counter() - started,
    }
    default = " (autopipe's CUDA default)" if device.type == "cuda" else ""
    print(f"m={check_m}: median |error| {summary['median_abs_error_no_overhead'] * 100:.1f}% with no overhead"
          f"{default}, {summary['median_abs_error_fitted'] * 100:.1f}% with the overhead fitted on m={fit_m}")
    out = Path(opts.out) if opts.out else Path(__file__).parent / "results.json"
    write_result(out, {"benchmark": "gpu_one_rank", "host": host_info(), "summary": summary, "rows": rows,
                       "wall_s": summary["took_s"]})
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
