"""Schedule memory: peak activation memory per rank under GPipe vs 1F1B, same plan, measured.

GPipe runs every forward before any backward, so each stage holds the activations of all
``m`` micro-batches at its peak; 1F1B starts backwards early, so stage ``s`` of ``p``
holds at most ``min(m, p - s)``. This script measures it: one 2-rank world builds
``autopipe.Pipeline`` with the same split and micro-batches under GPipe, 1F1B and 1F1B
with activation checkpointing, warms each up (so gradients and torch's receive buffers
exist), then records the peak bytes one training step allocates on each rank:

* CPU: ``_pipebench.LiveBytes``, a dispatch mode counting every tensor storage an
  operator allocates inside the step and uncounting it when freed;
* CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step.

Beside each figure: the micro-batches in flight that autopipe's simulator predicts
(``autopipe.simulate``), which is what the planner charges memory for.

    python benchmarks/schedule_memory/main.py             # full size
    python benchmarks/schedule_memory/main.py --quick     # smaller model, under a minute
    python benchmarks/schedule_memory/main.py --device cuda

Writes results.json (results_quick.json with --quick) beside this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402
from _pipebench import LiveBytes, host_info, run_world  # noqa: E402

from autopipe.models.transformer import SeedTransformer  # noqa: E402
from autopipe.runtime import Pipeline  # noqa: E402
from autopipe.planning.simulator import simulate  # noqa: E402
from autopipe import PlannerOptions

SIZES = {  # (vocab, d_model, heads, d_ff, layers, seq_len, microbatch, n_microbatches)
    "full": (2000, 256, 8, 1024, 4, 256, 4, 8),
    "quick": (1000, 128, 4, 512, 4, 128, 4, 8),
    "smoke": (100, 16, 2, 32, 2, 8, 2, 4),
}
SPLIT = ["layers.2"]
# (label, schedule, activation checkpointing, micro-batches as a multiple of m). The last one
# checks that a 1F1B step's memory does not grow with the micro-batch count: a training step
# keeps no outputs, so the last stage holds one micro-batch in flight however many there are.
VARIANTS = (("GPipe", "GPipe", False, 1), ("1F1B", "1F1B", False, 1), ("1F1B+checkpointing", "1F1B", True, 1),
            ("1F1B, 4x micro-batches", "1F1B", False, 4))


def worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(job["device"], rank) if job["device"] == "cuda" else torch.device("cpu")
    vocab, d, h, ff, layers, seq, mb, m = SIZES[job["size"]]
    split = SPLIT if layers > 2 else ["layers.1"]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

    g = torch.Generator().manual_seed(1)
    most = max(factor for *_, factor in VARIANTS)
    x = torch.randint(0, vocab, (mb * m * most, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (mb * m * most, seq), generator=g).to(device)
    torch.manual_seed(0)
    model = SeedTransformer(vocab, d_model=d, num_heads=h, d_ff=ff, num_layers=layers, max_len=512, dropout=0.0)
    result: dict[str, Any] = {}
    for label, schedule, checkpointing, factor in VARIANTS:
        pipe = Pipeline(model, example_args=(x[:mb].cpu(),), loss_fn=loss_fn, split_points=split, schedule=schedule,
                        n_microbatches=m * factor, device=device,
                        planner=PlannerOptions(recompute=checkpointing))
        xb, yb = x[:mb * m * factor], y[:mb * m * factor]
        pipe.step(xb, target=yb)  # warm-up: gradients and receive buffers now exist
        pipe.zero_grad(set_to_none=False)  # keep the gradient tensors: they are not activations
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            pipe.step(xb, target=yb)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            with LiveBytes() as counter:
                pipe.step(xb, target=yb)
            peak = counter.peak
        dist.barrier()
        result[label] = {"peak_step_bytes": int(peak)}
        del pipe
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model (under a minute)")
    ap.add_argument("--smoke", action="store_true", help="a tiny run that only checks the script works")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    vocab, d, h, ff, layers, seq, mb, m = SIZES[size]
    ranks = run_world(worker, 2, {"device": args.device, "size": size}, device=args.device, timeout_s=3000)
    rows = []
    for label, schedule, checkpointing, factor in VARIANTS:
        # Equal stage times suffice: the in-flight count depends on the order, not the durations.
        inflight = simulate([1.0, 1.0], [2.0, 2.0], schedule=schedule, n_microbatches=m * factor).peak_inflight
        for rank, measured in enumerate(ranks):
            rows.append({"variant": label, "rank": rank, "n_microbatches": m * factor,
                         "peak_step_bytes": measured[label]["peak_step_bytes"],
                         "predicted_inflight_microbatches": inflight[rank],
                         "vs_gpipe": measured[label]["peak_step_bytes"] / measured["GPipe"]["peak_step_bytes"]})
    out = args.out or str(Path(__file__).parent / ("results_quick.json" if size != "full" else "results.json"))
    payload = {
        "benchmark": "schedule_memory",
        "question": "how much activation memory does 1F1B save over GPipe for the same plan, measured per rank?",
        "device": args.device, "ranks": 2, "size": size, "split_points": SPLIT if layers > 2 else ["layers.1"],
        "model": f"SeedTransformer(vocab={vocab}, d_model={d}, heads={h}, d_ff={ff}, layers={layers})",
        "batch": f"{m} micro-batches x {mb} sequences x {seq} tokens",
        "measure": "LiveBytes (CPU) / max_memory_allocated (CUDA): bytes allocated during one step beyond "
                   "what existed before it (parameters, gradients, receive buffers excluded)",
        "host": host_info(), "rows": rows,
    }
    path = write_result(out, payload)
    for r in rows:
        print(f"{r['variant']:>20} rank {r['rank']}: {r['peak_step_bytes'] / 2**20:8.2f} MiB"
              f"  ({r['vs_gpipe']:.2f}x GPipe; predicted {r['predicted_inflight_microbatches']} micro-batches in flight)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
