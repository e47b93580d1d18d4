"""Reproduce every figure in docs/images/: the concept pictures of docs/guide.md and the demo's charts.

    python docs/images/make_images.py            # concept pictures + the demo (trains on 2 CPU processes)
    python docs/images/make_images.py --no-demo  # concept pictures only (seconds)

Concept pictures are simulated (no model, no timing), so they are the same on every machine.
The demo's charts come from ``autopipe demo``: its numbers are measured on the machine that
runs this script.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from autopipe.planning.plan import Plan
from autopipe.reporting.charts import timeline_figure
from autopipe.reporting.data import timeline_data
from autopipe.reporting.timeline import cut_comm_s, split_timeline
from autopipe.planning.simulator import simulate

HERE = Path(__file__).resolve().parent


def concept_pictures() -> list[Path]:
    """GPipe vs 1F1B on four equal stages, and what one heavy stage does to a step."""
    out = []
    equal = dict(fwd_s=[1.0] * 4, bwd_s=[2.0] * 4, n_microbatches=8)
    for schedule, name in (("GPipe", "concept_gpipe.png"), ("1F1B", "concept_1f1b.png")):
        t = simulate(equal["fwd_s"], equal["bwd_s"], schedule=schedule, n_microbatches=equal["n_microbatches"])
        fig = timeline_figure(timeline_data(t), title=(
            f"{schedule}: 4 equal stages, 8 micro-batches - step {t.step_s:.0f} time units, "
            f"bubble {t.bubble_fraction:.0%} (idle = white)"))
        fig.axes[0].set_xlabel("time, in units of one stage's forward; labels: micro-batch")
        fig.savefig(HERE / name, dpi=100)
        out.append(HERE / name)
    # Same total work, one stage twice as heavy: every rank waits for it.
    t = simulate([0.8, 0.8, 0.8, 1.6], [1.6, 1.6, 1.6, 3.2], schedule="1F1B", n_microbatches=8)
    fig = timeline_figure(timeline_data(t), title=(
        f"1F1B, same total work but stage 3 twice as heavy: step {t.step_s:.1f} time units (was 33), "
        f"bubble {t.bubble_fraction:.0%}"))
    fig.axes[0].set_xlabel("time, in units of one (light) stage's forward; labels: micro-batch")
    fig.savefig(HERE / "concept_unbalanced.png", dpi=100)
    out.append(HERE / "concept_unbalanced.png")
    return out


def demo_pictures() -> list[Path]:
    """Run the demo and keep its charts, plus the hand split's timeline beside autopipe's."""
    from autopipe.cli.demo import run_demo

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        run_demo(out_dir=tmp, steps=8)
        for png in sorted((Path(tmp) / "report_files").glob("*.png")):
            target = HERE / f"demo_{png.name}"
            shutil.copy(png, target)
            out.append(target)
        plan = Plan.load(Path(tmp) / "plan.json")
    assert cut_comm_s(plan)  # the plan carries its links, so both timelines charge the same comm
    hand = split_timeline(plan, ["layers.2"])
    fig = timeline_figure(timeline_data(hand), title=(
        f"Hand split (layers.2, half the blocks per rank): simulated 1F1B step {hand.step_s * 1e3:.0f} ms, "
        f"bubble {hand.bubble_fraction:.0%}"))
    fig.savefig(HERE / "demo_timeline_hand_split.png", dpi=110)
    out.append(HERE / "demo_timeline_hand_split.png")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-demo", action="store_true", help="concept pictures only")
    args = parser.parse_args()
    written = concept_pictures() + ([] if args.no_demo else demo_pictures())
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
