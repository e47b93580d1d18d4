"""torchtitan's own Llama3 and Qwen3: autopipe's torchtitan-granularity plan against torchtitan's default split.

For each model (torchtitan 0.3.0's own ``llama3`` and ``qwen3`` definitions, built small:
width 128, 8 decoder layers, an 8000-token vocabulary so the head weighs about what two
layers do, causal SDPA) this script

1. profiles the model once (measured, one thread, as each rank runs) and plans 2, 4 and 8
   stages from that one profile with ``PlannerOptions(target="torchtitan")`` (1F1B,
   8 micro-batches of 2 sequences of 32 tokens);
2. takes torchtitan's default split from torchtitan itself
   (``_generate_llm_fqn_per_model_part``: the embedding and the norm + head each weighted
   as one layer, layers spread evenly);
3. simulated, at every stage count: the plan's predicted step for its own split and for
   torchtitan's (:meth:`autopipe.Plan.split_step_s`, the same costs and simulator);
4. measured, at 2 stages: both splits built by torchtitan's ``_pipeline_module_split`` from
   their ``module_fqns_per_model_part`` on 2 gloo ranks (127.0.0.1, one thread per rank),
   stepped by torch's ``Schedule1F1B`` in interleaved rounds (A B A B ...); a split's step is
   the median over the rounds of the slower rank's step.

Nothing is asserted; the results go to ``results.json`` beside this file, which
``benchmarks/render_docs.py`` renders into ``docs/benchmarks.md``. Needs torchtitan
(``pip install torchtitan==0.3.0 triton`` next to torch). Hold the machine for it
(``flock``): other work on the cores turns a fast split into a slow one.

    python benchmarks/frameworks/main.py            # both models, about 5 minutes on 2 cores
    python benchmarks/frameworks/main.py --smoke    # one tiny model, one round: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from _common import write_result  # noqa: E402
from _pipebench import host_info, median, run_world  # noqa: E402

SIZES = {"full": dict(dim=128, layers=8, vocab=8000, rows=2, seq=32, n_microbatches=8, stages=[2, 4, 8]),
         "smoke": dict(dim=32, layers=4, vocab=64, rows=2, seq=8, n_microbatches=4, stages=[2, 4])}
FAMILIES = ("llama3", "qwen3")


def build(family: str, size: dict[str, Any]) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model and one micro-batch of token ids."""
    from _frameworks_workers import titan_model

    model = titan_model(family, layers=size["layers"], dim=size["dim"], vocab=size["vocab"])
    tokens = torch.randint(0, size["vocab"], (size["rows"], size["seq"]), generator=torch.Generator().manual_seed(1))
    return model, tokens


def default_parts(n_stages: int, layers: int) -> list[list[str]]:
    """torchtitan's own default ``module_fqns_per_model_part``."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    return _generate_llm_fqn_per_model_part(n_stages, layers)


def split_points(parts: list[list[str]]) -> list[str]:
    """The split points of a part list: where each part after the first begins."""
    return [part[0] for part in parts[1:]]


def step_worker(rank: int, world: int, job: dict[str, Any]) -> dict[str, list[float]]:
    """Build every variant's stages with torchtitan's splitter; step them in interleaved rounds; this rank's times."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B
    from torchtitan.distributed.pipeline_parallel import _pipeline_module_split

    from _frameworks_workers import lm_loss

    size = job["size"]
    model, _ = build(job["family"], size)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    m = size["n_microbatches"]
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, size["vocab"], (size["rows"] * m, size["seq"]), generator=g)
    labels = torch.randint(0, size["vocab"], (size["rows"] * m, size["seq"]), generator=g)
    schedules = {}
    for label, parts in job["variants"].items():
        stages, chunks = _pipeline_module_split(model, mesh, "1F1B", torch.device("cpu"), parts)
        schedules[label] = (Schedule1F1B(stages[0], n_microbatches=m, loss_fn=lm_loss), chunks[0], stages[0])

    def step(label: str) -> None:
        schedule, chunk, stage = schedules[label]
        chunk.zero_grad()
        schedule.step(*((tokens,) if stage.is_first else ()), target=labels if stage.is_last else None)

    for label in schedules:  # the first steps set up buffers and communication
        for _ in range(2):
            step(label)
    times: dict[str, list[float]] = {label: [] for label in schedules}
    for _ in range(job["rounds"]):
        for label in schedules:
            for _ in range(job["steps"]):
                dist.barrier()
                t0 = time.perf_counter()
                step(label)
                times[label].append(time.perf_counter() - t0)
    return times


def run_family(family: str, size: dict[str, Any], *, rounds: int, steps: int, log) -> dict[str, Any]:
    import autopipe
    from autopipe.planning import profile_segments, trace

    model, tokens = build(family, size)
    t0 = time.perf_counter()
    profile = profile_segments(trace(model, (tokens,)), progress=False)
    profile_s = time.perf_counter() - t0
    rows = []
    for n in size["stages"]:
        plan = autopipe.partition(profile, n, schedule="1F1B", n_microbatches=size["n_microbatches"],
                                  planner=autopipe.PlannerOptions(target="torchtitan"))
        parts = default_parts(n, size["layers"])
        default = split_points(parts)
        baseline = plan.baseline("torchtitan_default")
        rows.append({"stages": n, "autopipe_parts": plan.to_torchtitan()["parallelism"]["module_fqns_per_model_part"],
                     "default_parts": parts, "autopipe_split": list(plan.split_points), "default_split": default,
                     "autopipe_predicted_s": plan.predicted_step_s, "default_predicted_s": plan.split_step_s(default),
                     "report_baseline_split": list(baseline.split_points),
                     "report_line": next((line for line in plan.report().splitlines()
                                          if "torchtitan's default split" in line), None)})
        r = rows[-1]
        log(f"  {family} {n} stages: autopipe {r['autopipe_split']} predicted {r['autopipe_predicted_s'] * 1e3:.1f} ms;"
            f" torchtitan {default} predicted {r['default_predicted_s'] * 1e3:.1f} ms")
    two = rows[0]
    variants = {"autopipe": two["autopipe_parts"], "torchtitan_default": two["default_parts"]}
    if two["autopipe_parts"] == two["default_parts"]:
        variants = {"autopipe": two["autopipe_parts"]}  # the same split: one measurement serves both
    results = run_world(step_worker, 2, {"family": family, "size": size, "variants": variants, "rounds": rounds,
                                         "steps": steps}, timeout_s=900.0)
    steps_s = {label: [max(a, b) for a, b in zip(results[0][label], results[1][label])] for label in variants}
    measured = {label: median(v) for label, v in steps_s.items()}
    measured.setdefault("torchtitan_default", measured["autopipe"])
    two.update(autopipe_measured_s=measured["autopipe"], default_measured_s=measured["torchtitan_default"],
               same_split=len(variants) == 1)
    log(f"  {family} 2 stages measured: autopipe {measured['autopipe'] * 1e3:.1f} ms, torchtitan's default "
        f"{measured['torchtitan_default'] * 1e3:.1f} ms")
    return {"family": family, "profile_s": profile_s, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one tiny model, one round: checks the script")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9, --smoke 1)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each rank runs: the profile sees what a rank sees
    os.environ.setdefault("AUTOPIPE_PROGRESS", "0")
    size = SIZES["smoke" if a.smoke else "full"]
    rounds, steps = a.rounds or (1 if a.smoke else 9), 1 if a.smoke else 2
    start, t0 = host_info(), time.perf_counter()
    families = [run_family(f, size, rounds=rounds, steps=steps, log=print)
                for f in (FAMILIES[:1] if a.smoke else FAMILIES)]
    import torchtitan

    payload = {"benchmark": "frameworks", "framework": f"torchtitan {torchtitan.__version__}", "schedule": "1F1B",
               "sizes": size, "rounds": rounds, "steps_per_round": steps, "threads_per_process": 1,
               "smoke": a.smoke, "host_start": start, "host_end": host_info(), "families": families,
               "wall_s": time.perf_counter() - t0}
    print(f"wrote {write_result(a.out, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
