"""How far one profile's level moves with the host's speed, on the models of ``main.py``.

A plan predicts every split of a model from one profile, which takes about a second. On a
shared host the speed of a core moves in phases of a few seconds, so the profile catches one
phase, and every split of that model shares it. This script shows both:

1. the host's speed over ``--trace-s`` seconds: a fixed piece of work (40 float32 matmuls of
   256 x 256, one thread) timed every 50 ms, printed as the median of each second;
2. ``--plans`` calls of ``autopipe.partition`` one after another, as ``main.py`` makes them,
   each with the same fixed work timed just before and after: the plan's predicted step, and
   how closely it follows the reference (their correlation, and the spread of the predictions
   before and after dividing by the reference).

``--repeats 5 40`` alternates plans profiled in 5 and in 40 rounds: whether a longer profile
averages the phases out. ``--cores`` first traces each core of the host on its own (the same
work pinned to one core after the other, the other cores idle, as in a profile), then every
core at once (one process pinned to each, all busy, as in steps whose ranks all compute):
whether the cores run at one speed, and whether it is the same speed when they all work (Linux). Nothing is asserted. Hold the machine while it runs (``flock``), as
for ``main.py``.

    python benchmarks/real_steps/profile_phases.py --models llama mistral
    python benchmarks/real_steps/profile_phases.py --models llama --plans 6 --trace-s 5 --repeats 5 40
    python benchmarks/real_steps/profile_phases.py --cores --trace-s 40 --plans 2 --models
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]


def reference_ms(a: torch.Tensor, b: torch.Tensor, repeats: int = 3) -> float:
    """The median over ``repeats`` of 40 matmuls ``a @ b``, in milliseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(40):
            a @ b
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def each_second(seconds: float, samples: dict[int, Any], pause_s: float) -> dict[int, list[float]]:
    """Call every one of ``samples`` (key -> a function giving ms) in turn, then pause ``pause_s``, for
    ``seconds``: per key, the median of each second."""
    per_second: dict[int, dict[int, list[float]]] = {k: {} for k in samples}
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < seconds:
        for k, sample in samples.items():
            per_second[k].setdefault(int(now), []).append(sample())
        if pause_s:
            time.sleep(pause_s)
    return {k: [statistics.median(v) for _, v in sorted(d.items())] for k, d in per_second.items()}


def speed_trace(a: torch.Tensor, b: torch.Tensor, seconds: float) -> list[float]:
    """The fixed work's time every 50 ms for ``seconds``: the median of each second, in ms."""
    return each_second(seconds, {0: lambda: reference_ms(a, b, repeats=1)}, 0.05)[0]


def core_trace(a: torch.Tensor, b: torch.Tensor, seconds: float, cores: list[int]) -> dict[int, list[float]]:
    """The fixed work pinned to each core in turn, every 50 ms for ``seconds``: per core, the median of each second."""
    def on(core: int) -> Any:
        def sample() -> float:
            os.sched_setaffinity(0, {core})
            return reference_ms(a, b, repeats=1)
        return sample

    mask = os.sched_getaffinity(0)
    try:
        return each_second(seconds, {c: on(c) for c in cores}, 0.05)
    finally:
        os.sched_setaffinity(0, mask)


def _busy_core(core: int, seconds: float, out: Any) -> None:
    """Child process: the fixed work back to back on ``core`` for ``seconds``; (core, per-second medians) to ``out``."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out.put((core, each_second(seconds, {core: lambda: reference_ms(a, b, repeats=1)}, 0.0)[core]))


def busy_cores_trace(seconds: float, cores: list[int]) -> dict[int, list[float]]:
    """Every core busy at once (a process pinned to each): per core, the fixed work's median of each second."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_busy_core, args=(c, seconds, out)) for c in cores]
    for p in procs:
        p.start()
    try:
        traces = dict(out.get(timeout=seconds + 60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return traces


def print_cores(label: str, traces: dict[int, list[float]]) -> None:
    """Per core, each second's median; how far apart the cores ran in a second, the median and the largest."""
    cores = sorted(traces)
    n = min(len(t) for t in traces.values())
    for c in cores:
        print(f"{label}, core {c} (ms): {' '.join(f'{t:.1f}' for t in traces[c][:n])}")
    apart = [max(traces[c][i] for c in cores) / min(traces[c][i] for c in cores) - 1 for i in range(n)]
    print(f"  {label}: the cores' medians {statistics.median([t for c in cores for t in traces[c][:n]]):.1f} ms; "
          f"apart by a median {statistics.median(apart):.1%} of a second, at most {max(apart):.1%}")


def plan_level(model: torch.nn.Module, args: tuple, a: torch.Tensor, b: torch.Tensor,
               repeats: int) -> tuple[float, float]:
    """One plan of ``model``, its profile timing ``repeats`` rounds: (reference around the call in ms, predicted step in ms)."""
    import autopipe
    from main import N_MICROBATCHES  # this folder's main.py

    before = reference_ms(a, b)
    plan = autopipe.partition(model, 2, args, schedule="1F1B", n_microbatches=N_MICROBATCHES,
                              planner=autopipe.PlannerOptions(profiling=autopipe.ProfileOptions(repeats=repeats)))
    return (before + reference_ms(a, b)) / 2, plan.predicted_step_s * 1e3


def spread(xs: list[float]) -> float:
    """How far the largest of ``xs`` lies above the smallest, as a share of the smallest."""
    return max(xs) / min(xs) - 1.0


def main(argv: list[str] | None = None) -> None:
    """Print the host's speed trace, then each model's predicted steps against the reference."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["llama"])
    ap.add_argument("--plans", type=int, default=12)
    ap.add_argument("--trace-s", type=float, default=40.0)
    ap.add_argument("--repeats", type=int, nargs="*", default=[5],
                    help="profile rounds per plan; several values alternate plan by plan (default 5, the library's)")
    ap.add_argument("--cores", action="store_true", help="first trace each core alone, then all cores at once (Linux)")
    a = ap.parse_args(argv)
    if a.plans < 2:
        ap.error(f"--plans {a.plans}: need at least 2 plans to compare")
    if not a.repeats or min(a.repeats) < 1:
        ap.error(f"--repeats {a.repeats}: give one or more counts >= 1")
    if a.cores and not hasattr(os, "sched_setaffinity"):
        ap.error("--cores: this platform cannot pin a process to a core (os.sched_setaffinity)")
    torch.set_num_threads(1)  # as each rank runs
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    if a.cores:
        cores = sorted(os.sched_getaffinity(0))
        print_cores("one core at a time", core_trace(x, y, a.trace_s, cores))
        print_cores("every core at once", busy_cores_trace(a.trace_s, cores))
    trace_ms = speed_trace(x, y, a.trace_s)
    print(f"fixed work, median of each second (ms): {' '.join(f'{t:.1f}' for t in trace_ms)}")
    print(f"  typical {statistics.median(trace_ms):.1f} ms, slowest second {max(trace_ms):.1f} ms")
    from main import build  # this folder's main.py

    for name in a.models:
        model, args, _ = build(name)
        by_repeats: dict[int, list[tuple[float, float]]] = {r: [] for r in a.repeats}
        for _ in range(a.plans):  # the repeat counts alternate, so each sees the host's phases alike
            for r in a.repeats:
                by_repeats[r].append(plan_level(model, args, x, y, r))
        for r, rows in by_repeats.items():
            refs, preds = [ref for ref, _ in rows], [p for _, p in rows]
            corr = torch.corrcoef(torch.tensor([refs, preds], dtype=torch.float64))[0, 1].item()
            for ref, p in rows:
                print(f"  {name}, {r} rounds: reference {ref:5.1f} ms  predicted step {p:6.1f} ms")
            print(f"{name}, profiles of {r} rounds: {a.plans} plans, predicted step {min(preds):.1f}-{max(preds):.1f} ms "
                  f"({spread(preds):.1%} apart); correlation with the reference {corr:.2f}; "
                  f"divided by it, {spread([p / ref for ref, p in rows]):.1%} apart")


if __name__ == "__main__":
    main()
