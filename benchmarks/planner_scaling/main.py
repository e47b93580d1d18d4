"""How long the exact partition search takes: 100 ... 100,000 segments into 2 ... 128 stages.

Synthetic problems with the features real ones have: uneven segment times (log-normal),
communication on every cut, parameter and activation memory with a capacity that binds
(1.5x the even share plus two of the heaviest segments), and 1F1B's in-flight counts. Times are the median of ``--repeats``
runs of ``solve_bottleneck``; nothing is asserted.

    python benchmarks/planner_scaling/main.py            # full grid, ~1 minute
    python benchmarks/planner_scaling/main.py --quick    # a few cells, seconds
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import median, write_result  # noqa: E402

from autopipe.planning.partitioner import PartitionProblem, solve_bottleneck  # noqa: E402


def make_problem(n: int, p: int, seed: int = 0) -> PartitionProblem:
    rng = np.random.default_rng(seed)
    compute = rng.lognormal(mean=-6.0, sigma=1.0, size=n)  # ~2.5 ms median, heavy tail
    static = rng.lognormal(mean=14.0, sigma=1.0, size=n)  # ~1 MiB of params/grads/state
    act = rng.lognormal(mean=13.0, sigma=1.0, size=n)
    cut = rng.lognormal(mean=13.0, sigma=0.5, size=n + 1)
    inflight = np.array([min(2 * p, p - s) for s in range(p)], dtype=float)
    even_share = (static.sum() + inflight.max() * act.sum()) / p
    heaviest = (static + inflight.max() * act).max()  # so every problem has a feasible split
    return PartitionProblem(
        compute_s=compute, static_bytes=static, act_bytes=act,
        cut_fwd_bytes=cut, cut_bwd_bytes=cut, num_stages=p,
        speed=np.ones(p), bandwidth=np.full(p - 1, 10e9), latency_s=np.full(p - 1, 20e-6),
        inflight=inflight, capacity_bytes=np.full(p, 1.5 * even_share + 2 * heaviest),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few cells only (under a minute)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="accepted for symmetry; the search runs on the CPU")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
    args = ap.parse_args(argv)
    segments = [100, 1000] if args.quick else [100, 1000, 10000, 100000]
    stages = [2, 8, 32] if args.quick else [2, 4, 8, 16, 32, 64, 128]
    rows = []
    for n in segments:
        for p in stages:
            if p > n // 10 or (n == 100000 and p < 32):  # a stage of under ten segments; the largest: deep only
                continue
            problem = make_problem(n, p)
            times, iters = [], 0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                result = solve_bottleneck(problem)
                times.append(time.perf_counter() - t0)
                iters = result.searched["iterations"]
            row = {"segments": n, "stages": p, "median_s": median(times), "bisection_steps": iters,
                   "bottleneck_over_lower_bound": result.bottleneck_s / (problem.compute_s.sum() / p)}
            rows.append(row)
            print(f"{n:6d} segments  {p:3d} stages  {row['median_s'] * 1e3:9.1f} ms  ({iters} steps)", flush=True)
    path = write_result(args.out, {"benchmark": "planner_scaling", "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
