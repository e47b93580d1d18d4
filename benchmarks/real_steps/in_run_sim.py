"""Every split of ``results.json`` simulated from its stages as timed inside the real steps.

``main.py`` records, per split, the measured step, the plan's predicted step and each
stage's forward and backward timed inside running steps (``Pipeline.measure_stage_times``).
This script puts those in-run stage times through the planner's simulator (1F1B, the cut
times and per-action overhead of a plan of the same model on this host type, the step
tail) and prints them beside the measured steps. Where the simulated order of two splits
differs from the measured one, the difference lies outside the stages' compute: in what a
step spends between and around its actions. Nothing is timed here; it reads results.json.

    python benchmarks/real_steps/in_run_sim.py               # every model in results.json
    python benchmarks/real_steps/in_run_sim.py --models gpt2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]


def main(argv: list[str] | None = None) -> None:
    """Print, per model, each split's measured step and its in-run simulation, fastest measured first."""
    import autopipe
    from autopipe.planning import costmodel
    from main import N_MICROBATCHES, build  # this folder's main.py

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE / "results.json"))
    ap.add_argument("--models", nargs="*")
    a = ap.parse_args(argv)
    data = json.loads(Path(a.results).read_text())
    for row in data["rows"]:
        if a.models and row["model"] not in a.models:
            continue
        model, args, _ = build(row["model"], row["size"])
        # A counted plan of the same model: the machine model (cut times, per-action overhead) and step tail
        # that the measured plan charges too; the stage times come from the steps.
        plan = autopipe.partition(model, 2, args, schedule="1F1B", n_microbatches=N_MICROBATCHES,
                                  planner=autopipe.PlannerOptions(cost="flops", profiling=autopipe.ProfileOptions(
                                      progress=False, measure_link=False)))
        print(f"{row['model']} (chosen {row['chosen']}):")
        for label, split in sorted(row["splits"].items(), key=lambda kv: kv[1]["measured_step_s"]):
            timed = split["in_run"]
            simulated = costmodel.predicted_step_s(timed["fwd_s"], timed["bwd_s"], plan.cut_comm_s(split["split"]),
                                                   **plan.simulation_options(), tail=plan.step_tail)
            print(f"  {label:45s} measured {split['measured_step_s'] * 1e3:6.2f} ms  predicted "
                  f"{split['predicted_step_s'] * 1e3:6.2f}  in-run simulated {simulated * 1e3:6.2f} "
                  f"({simulated / split['measured_step_s'] - 1:+.1%})")


if __name__ == "__main__":
    main()
