"""Runtime overhead: autopipe.Pipeline vs the same pipeline written by hand with torch.

Both variants run the same model, split, schedule and micro-batches on 2 ranks; the hand
variant is the seed tutorial's code (``pipeline()``, ``build_stage``, torch's schedule
class, inputs on the first rank, targets on the last). They are built side by side in one
world and stepped alternately, one step each per round (A B, B A, A B, ...); the first two
rounds warm up. Each step is timed between two barriers, so a step time is the whole
pipeline's. The overhead is ``median(autopipe) / median(hand) - 1``, and, less sensitive to
the machine's load drifting, the median of the per-round ratios (``paired_overhead_pct``).

    python benchmarks/runtime_overhead/main.py            # full: GPipe, 1F1B, Interleaved1F1B
    python benchmarks/runtime_overhead/main.py --quick    # 1F1B, a small model, a minute or so
    python benchmarks/runtime_overhead/main.py --device cuda   # 2 GPUs, NCCL

Writes results.json (results_quick.json with --quick) beside this file.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402
from _pipebench import host_info, median, run_world  # noqa: E402

from autopipe.models.transformer import SeedTransformer  # noqa: E402
from autopipe.runtime import Pipeline  # noqa: E402
from autopipe.planning.schedules import schedule_class  # noqa: E402
from autopipe import PlannerOptions

SIZES = {  # model and batch per size: (vocab, d_model, heads, d_ff, layers, seq_len, microbatch, n_microbatches)
    "full": (4000, 256, 8, 1024, 4, 128, 4, 8),
    "quick": (1000, 128, 4, 512, 4, 64, 4, 4),
    "smoke": (100, 16, 2, 32, 4, 8, 2, 4),
}
SPLITS = {1: ["layers.2"], 2: ["layers.1", "layers.2", "layers.3"]}  # by stages per rank


def _model(size: str) -> SeedTransformer:
    vocab, d, h, ff, layers, _, _, _ = SIZES[size]
    torch.manual_seed(0)
    return SeedTransformer(vocab, d_model=d, num_heads=h, d_ff=ff, num_layers=layers, max_len=512, dropout=0.0)


class HandWritten:
    """The tutorial's code: pipeline() with a split_spec, build_stage, torch's schedule class."""

    def __init__(self, model: nn.Module, x_mb: torch.Tensor, split_points: list[str], schedule: str,
                 n_microbatches: int, loss_fn: Any, device: torch.device) -> None:
        from torch.distributed.pipelining import SplitPoint, pipeline

        rank, world = dist.get_rank(), dist.get_world_size()
        pipe = pipeline(copy.deepcopy(model), (x_mb,), split_spec={p: SplitPoint.BEGINNING for p in split_points})
        indices = list(range(rank, pipe.num_stages, world))  # looped placement
        self.stages = [pipe.build_stage(i, device) for i in indices]
        cls = schedule_class(schedule)
        first = self.stages[0] if len(self.stages) == 1 else self.stages
        self.schedule = cls(first, n_microbatches, loss_fn=loss_fn)
        self.is_first = 0 in indices
        self.is_last = pipe.num_stages - 1 in indices

    def zero_grad(self) -> None:
        for stage in self.stages:
            stage.submod.zero_grad(set_to_none=True)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        args = (x,) if self.is_first else ()
        losses: list = []
        self.schedule.step(*args, target=y if self.is_last else None, losses=losses if self.is_last else None)


def worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(job["device"], rank) if job["device"] == "cuda" else torch.device("cpu")
    vocab, _, _, _, _, seq, mb, m = SIZES[job["size"]]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (mb * m, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (mb * m, seq), generator=g).to(device)
    rows = []
    for schedule in job["schedules"]:
        spr = 1 if schedule in ("GPipe", "1F1B") else 2
        model = _model(job["size"])
        auto = Pipeline(model, example_args=(x[:mb].cpu(),), loss_fn=loss_fn, split_points=SPLITS[spr],
                        schedule=schedule, n_microbatches=m, device=device,
                        planner=PlannerOptions(stages_per_rank=spr))
        hand = HandWritten(model, x[:mb].cpu(), SPLITS[spr], schedule, m, loss_fn, device)
        variants = {"autopipe": (auto.zero_grad, lambda: auto.step(x, target=y)),
                    "hand": (hand.zero_grad, lambda: hand.step(x, y))}
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round_ in range(job["rounds"] + 2):  # rounds 0 and 1 warm up (each variant goes first once)
            # One step of each per round, the order alternating (A B, B A, ...): a change in the
            # machine's load hits both variants alike, and neither always runs first.
            for name in names if round_ % 2 == 0 else names[::-1]:
                zero_grad, step = variants[name]
                zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                if round_ > 1:
                    times[name].append(time.perf_counter() - t0)
        a, h = median(times["autopipe"]), median(times["hand"])
        paired = median([x / y for x, y in zip(times["autopipe"], times["hand"])])
        rows.append({"schedule": schedule, "stages_per_rank": spr, "autopipe_step_s": a, "hand_step_s": h,
                     "overhead_pct": 100.0 * (a / h - 1.0), "paired_overhead_pct": 100.0 * (paired - 1.0),
                     "steps_each": len(times["autopipe"]),
                     "autopipe_steps_s": times["autopipe"], "hand_steps_s": times["hand"]})
    return {"rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1F1B only, a smaller model (about a minute)")
    ap.add_argument("--smoke", action="store_true", help="a tiny run that only checks the script works")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    ap.add_argument("--schedules", nargs="*", default=None, help="default: GPipe 1F1B Interleaved1F1B")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds, one step of each variant per round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    schedules = args.schedules or (["1F1B"] if args.quick or args.smoke else ["GPipe", "1F1B", "Interleaved1F1B"])
    rounds = args.rounds or {"smoke": 1, "quick": 20, "full": 40}[size]
    job = {"device": args.device, "size": size, "schedules": schedules, "rounds": rounds}
    ranks = run_world(worker, 2, job, device=args.device, timeout_s=3000)
    rows = ranks[0]["rows"]  # every rank times the same barrier-to-barrier steps; rank 0 reports
    vocab, d, h, ff, layers, seq, mb, m = SIZES[size]
    out = args.out or str(Path(__file__).parent / ("results_quick.json" if size != "full" else "results.json"))
    payload = {
        "benchmark": "runtime_overhead",
        "question": "how much slower is a step of autopipe.Pipeline than the same pipeline written by hand?",
        "device": args.device, "ranks": 2, "size": size,
        "model": f"SeedTransformer(vocab={vocab}, d_model={d}, heads={h}, d_ff={ff}, layers={layers})",
        "batch": f"{m} micro-batches x {mb} sequences x {seq} tokens",
        "rounds": rounds, "host": host_info(),
        "rows": rows,
    }
    path = write_result(out, payload)
    for r in rows:
        print(f"{r['schedule']:>16}: autopipe {r['autopipe_step_s'] * 1e3:8.2f} ms  hand {r['hand_step_s'] * 1e3:8.2f} ms"
              f"  overhead {r['overhead_pct']:+.1f}% (paired {r['paired_overhead_pct']:+.1f}%, {r['steps_each']} steps each)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
