"""Three questions asked of several committed runs of ``main.py`` at once, not of one run alone.

One run of ``main.py`` on a shared host can place two close splits in either order, so
these read ``results.json`` as committed at several revisions (``git show``) and pool them:

1. **Is a cut inside a block worth choosing?** Per model and run, the measured step of the
   cut inside a block that autopipe chose, and of the layer-level split its plan predicts
   fastest (what it would run were such cuts barred), each over the fastest split measured
   (ratios of median steps): the rule in ``autopipe.planning.split_candidates``
   (``INSIDE_BLOCK_MARGIN``) is judged by which of the two is more often the fastest.
2. **Level or shape?** Per model and run, the level of its predictions (the median over its
   splits of predicted ÷ measured, which the profile shares with every split) and its worst
   split's error once the level is taken out (how the cost model places the splits against
   each other): ``render_docs.prediction_level``; beside it, the most that one world moved a
   split's step against its model's other splits (``render_docs.world_movement``), the
   resolution of the measured steps.
3. **Does a contention term help?** Each split's step re-simulated from the plan's stage
   times (1F1B, 1 ms per cut, the CPU per-action overhead, lazy sends) with every action
   slowed by ``k`` times the share of its time the other rank computes (iterated to a fixed
   point), as a scale on the prediction the run recorded; per ``k``, the median and worst
   error over the run's splits. Nothing is timed here.

    python benchmarks/real_steps/across_runs.py             # the last 5 revisions that changed results.json
    python benchmarks/real_steps/across_runs.py --revs e1de2d1 bc0ded9
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE.parent)]
RESULTS = "benchmarks/real_steps/results.json"


def committed_runs(revs: list[str] | None, count: int) -> list[tuple[str, dict[str, Any]]]:
    """``(revision, results)`` for ``revs``, or for the last ``count`` revisions that changed results.json."""
    git = ["git", "-C", str(ROOT)]
    if not revs:
        revs = subprocess.run([*git, "log", "--format=%h", f"-n{count}", "--", RESULTS],
                              capture_output=True, text=True, check=True).stdout.split()
    return [(r, json.loads(subprocess.run([*git, "show", f"{r}:{RESULTS}"], capture_output=True, text=True,
                                          check=True).stdout)) for r in revs]


def inside_against_layer_level(runs: list[tuple[str, dict[str, Any]]]) -> None:
    """Question 1: the chosen cut inside a block, and the predicted-best layer-level split, over the fastest."""
    print("1. measured step over the fastest split's: the cut inside a block | the plan's best layer-level split")
    inside_all, layer_all = [], []
    for rev, data in runs:
        cells = []
        for row in data["rows"]:
            splits = row["splits"]
            inside = [v for v in splits.values() if not v.get("layer_level", True)]
            layer = {k: v for k, v in splits.items() if v.get("layer_level", True)}
            if not inside or not layer:
                continue
            fastest = min(v["measured_step_s"] for v in splits.values())
            best = min(layer, key=lambda k: layer[k]["predicted_step_s"])
            a, b = inside[0]["measured_step_s"] / fastest, layer[best]["measured_step_s"] / fastest
            inside_all.append(a)
            layer_all.append(b)
            cells.append(f"{row['model']} {a:.3f} | {b:.3f} ({best})")
        print(f"  {rev}: " + "; ".join(cells))
    for name, xs in (("inside a block", inside_all), ("layer-level", layer_all)):
        if xs:
            print(f"  {name}: median {statistics.median(xs):.3f}, mean {statistics.fmean(xs):.3f}, "
                  f"worst {max(xs):.3f}, over 1.03 in {sum(x > 1.03 for x in xs)} of {len(xs)}")


def level_and_shape(runs: list[tuple[str, dict[str, Any]]]) -> None:
    """Question 2: per run, each model's level and its worst error without it."""
    from render_docs import prediction_level, world_movement

    print("2. each model's level (median predicted / measured - 1) and its worst split's error without it; "
          "the most one world moved a split against the model's others")
    noise_and_error = []
    for rev, data in runs:
        pairs = {row["model"]: prediction_level(list(row["splits"].values())) for row in data["rows"]}
        moved = [m for row in data["rows"] if (m := world_movement(list(row["splits"].values())))]
        cells = [f"{m} {lvl:+.1%} / {shape:.1%}" for m, (lvl, shape) in pairs.items()]
        worst = max(shape for _, shape in pairs.values())
        if moved:
            error = max(abs(s["prediction_error"]) for row in data["rows"] for s in row["splits"].values())
            noise_and_error.append((max(x[1] for x in moved), error))
        print(f"  {rev}: worst without the level {worst:.1%}"
              + (f"; world to world up to {max(x[1] for x in moved):.1%}" if moved else "") + "; " + "; ".join(cells))
    if len(noise_and_error) > 2:  # does a run predict worse where its own steps moved more?
        print(f"  over the runs, the most a world moved a split against the worst |error|: correlation "
              f"{statistics.correlation(*zip(*noise_and_error)):.2f} ({len(noise_and_error)} runs)")


def contention_scale(fwd: list[float], bwd: list[float], k: float) -> float:
    """How much slower the simulated step runs with every action slowed by ``k`` x the other rank's busy share."""
    from _pipebench import busy_share_by_stage
    from autopipe.machine.device import default_action_overhead_s
    from autopipe.planning.simulator import simulate

    def step(f: list[float], b: list[float]) -> Any:
        return simulate(f, b, schedule="1F1B", n_microbatches=4, comm_s=1e-3,
                        action_overhead_s=default_action_overhead_s("cpu"), lazy_sends=True)

    base = step(fwd, bwd)
    timeline = base
    for _ in range(4):
        share_f, share_b = busy_share_by_stage(timeline, len(fwd))
        timeline = step([x * (1 + k * u) for x, u in zip(fwd, share_f)], [x * (1 + k * u) for x, u in zip(bwd, share_b)])
    return timeline.step_s / base.step_s


def contention_term(runs: list[tuple[str, dict[str, Any]]], ks: list[float]) -> None:
    """Question 3: per run and per ``k``, the median and worst |error| of the re-simulated predictions."""
    print("3. |error| of every split's predicted step, the busy-share contention term at each k: median / worst")
    for rev, data in runs:
        splits = [s for row in data["rows"] for s in row["splits"].values() if s.get("planned_stage_s")]
        cells = []
        for k in ks:
            errs = [abs(s["predicted_step_s"] * contention_scale(s["planned_stage_s"]["fwd_s"],
                                                                 s["planned_stage_s"]["bwd_s"], k)
                        / s["measured_step_s"] - 1) for s in splits]
            cells.append(f"k={k:g} {statistics.median(errs):.1%} / {max(errs):.1%}" if errs else f"k={k:g} -")
        print(f"  {rev}: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> None:
    """Print the three answers over the chosen revisions."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs="*", help="git revisions whose results.json to read (default: the last --count)")
    ap.add_argument("--count", type=int, default=5, help="how many revisions that changed results.json")
    ap.add_argument("--k", type=float, nargs="*", default=[0.0, 0.1, 0.2], help="contention factors to try")
    a = ap.parse_args(argv)
    if a.count < 1:
        ap.error(f"--count {a.count}: need at least 1 revision")
    runs = committed_runs(a.revs, a.count)
    inside_against_layer_level(runs)
    level_and_shape(runs)
    contention_term(runs, a.k)


if __name__ == "__main__":
    main()
