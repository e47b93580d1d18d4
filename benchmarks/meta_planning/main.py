"""Plan a Llama-style model of over a billion parameters built on the meta device, on this host.

The model is built under ``torch.device("meta")`` (shapes, no values) and planned into 4
stages twice: from measured costs (each segment copied to the CPU with stand-in values,
timed, and freed before the next) and from counted FLOPs. For each it records the planning
time, the planning process's peak resident memory (``ru_maxrss``, which is the whole
process's peak: the run is one fresh process per cost source), the split and how evenly it
balances the segment times (its own: measured, or counted).

    python benchmarks/meta_planning/main.py            # both cost sources, writes results.json
    python benchmarks/meta_planning/main.py --layers 4 --seq 64   # a quick look
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/_common
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the test models (tests/zoo)
from autopipe import PlannerOptions  # noqa: E402
RESULTS = HERE / "results.json"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                vocab_size=32000, max_position_embeddings=2048)


def plan_once(cost: str, layers: int, seq: int, n_microbatches: int) -> dict:
    """Build the model on meta and plan it; runs in its own process, so ru_maxrss is this plan's."""
    import torch

    import autopipe
    from zoo.hf import llama_from_config
    from autopipe.planning.costmodel import stage_times_s

    with torch.device("meta"):
        model, args = llama_from_config(num_hidden_layers=layers, batch=1, seq_len=seq, **LLAMA_1B)
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    plan = autopipe.partition(model, 4, args, schedule="1F1B", n_microbatches=n_microbatches,
                              planner=PlannerOptions(cost=cost, profiling=autopipe.ProfileOptions(warmup=1, repeats=2, progress=True)))
    planning_s = time.perf_counter() - start
    stage_s = [f + b for f, b in zip(*stage_times_s(plan.segments, plan.segment_cuts(plan.split_points), 1))]
    return {
        "cost": cost, "layers": layers, "seq_len": seq, "n_microbatches": n_microbatches,
        "parameters": n_params, "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "planning_s": planning_s,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "plan_planning_peak_rss_bytes": plan.planning_peak_rss_bytes,  # as the plan reports it
        "split_points": plan.split_points,
        "stage_compute_s": stage_s,
        "balance": max(stage_s) / min(stage_s),
        "predicted_step_s": plan.predicted_step_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--costs", nargs="+", default=["measured", "flops"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: plan once, print JSON
    a = parser.parse_args()
    if a.one:
        print("RESULT " + json.dumps(plan_once(a.one, a.layers, a.seq, a.microbatches)))
        return
    from _common import write_result

    start = time.perf_counter()
    rows = []
    for cost in a.costs:
        out = subprocess.run([sys.executable, __file__, "--one", cost, "--layers", str(a.layers), "--seq",
                              str(a.seq), "--microbatches", str(a.microbatches)],
                             check=True, capture_output=True, text=True, timeout=3600).stdout
        row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        rows.append(row)
        print(f"{cost}: {row['parameters'] / 1e9:.2f}B parameters, planned in {row['planning_s']:.0f} s, "
              f"peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB (the plan says "
              f"{row['plan_planning_peak_rss_bytes'] / 2**30:.2f} GiB), split {row['split_points']}, "
              f"stage compute max/min {row['balance']:.3f}")
    write_result(RESULTS, {"model": "HF Llama (hidden 2048, 32 heads, 4 kv heads, vocab 32000), built on meta",
                           "stages": 4, "schedule": "1F1B", "rows": rows, "wall_s": time.perf_counter() - start})
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
