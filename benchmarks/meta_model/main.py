"""Build a Pipeline of a Llama-style model of over a billion parameters from the meta device, on 2 and 4 ranks.

The launching process builds the model under ``torch.device("meta")`` (shapes, no values)
and plans it from counted FLOPs, once per run, into a plan file: the recipe of
``docs/large_models.md`` for a model no process holds whole. Then every rank of a
``torchrun`` world builds the same meta model and ``autopipe.Pipeline(model, plan=...)``,
which materializes and initializes (the default init) only the tensors of the rank's own
stage. Three runs:

* 2 ranks, split for time: no memory limit, so the planner balances the stages' compute
  and the first stage also holds the embedding, which costs no FLOPs;
* 2 ranks, each device given 9.5 GiB for training with AdamW: the model's weights,
  gradients and optimizer state (16.4 GiB) fit only when each rank holds about half, so
  memory decides the split;
* 4 ranks, split for time.

After construction each rank records, from ``/proc/self/status`` and
``/proc/self/smaps_rollup``: its resident set (``VmRSS``), its proportional share of it
(``Pss``: a page that several processes map, such as torch's shared libraries, counts a
share in each), its anonymous (private) part (``RssAnon``), its peak (``VmHWM``) and the
resident set before construction (Python, torch, transformers and the meta model), all
against the full model's parameter bytes. Results go to ``results.json`` next to this file.

    python benchmarks/meta_model/main.py                       # 1.1B parameters: 22 layers, seq 512
    python benchmarks/meta_model/main.py --layers 2 --seq 64   # a quick look (results not written)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # the checkout, also when autopipe is not installed
sys.path.insert(0, str(HERE.parent))  # benchmarks/_common
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the test models (tests/zoo)
from autopipe import PlannerOptions  # noqa: E402
RESULTS = HERE / "results.json"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                vocab_size=32000, max_position_embeddings=2048)


def _proc_bytes(field: str, path: str = "/proc/self/status") -> int | None:
    """A ``kB`` memory field of a ``/proc/self`` file (``VmRSS``; ``Pss`` of ``smaps_rollup``) in bytes.

    None where the kernel has no such file or field (``smaps_rollup`` is Linux 4.14 on).
    """
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _build_meta_model(layers: int, seq: int):
    import torch
    from zoo.hf import llama_from_config

    with torch.device("meta"):
        return llama_from_config(num_hidden_layers=layers, batch=1, seq_len=seq, **LLAMA_1B)


def _loss_fn(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, LLAMA_1B["vocab_size"]), target.reshape(-1))


def rank_main(layers: int, seq: int, plan_path: str, out_dir: str) -> None:
    """One rank (under torch.distributed.run): build the pipeline from meta and the plan file, record its memory."""
    import torch

    import autopipe

    torch.set_num_threads(1)
    model, (x_mb,) = _build_meta_model(layers, seq)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    before = _proc_bytes("VmRSS")
    start = time.perf_counter()
    pipe = autopipe.Pipeline(model, example_args=(torch.zeros(x_mb.shape, dtype=x_mb.dtype),), loss_fn=_loss_fn,
                             plan=plan_path)
    build_s = time.perf_counter() - start
    rss, hwm = _proc_bytes("VmRSS"), _proc_bytes("VmHWM")
    anon, file_backed = _proc_bytes("RssAnon"), _proc_bytes("RssFile")
    pss = _proc_bytes("Pss", "/proc/self/smaps_rollup")
    held = sum(p.numel() * p.element_size() for p in pipe.parameters())
    row = {
        "rank": pipe.rank, "stages": pipe.stage_indices, "split_points": pipe.plan.split_points,
        "parameters": n_params, "parameter_bytes": param_bytes, "held_parameter_bytes": held,
        "rss_before_bytes": before, "rss_after_construction_bytes": rss, "peak_rss_bytes": hwm,
        "pss_after_construction_bytes": pss, "rss_anon_bytes": anon, "rss_file_bytes": file_backed,
        "rss_fraction_of_parameter_bytes": rss / param_bytes,
        "pss_fraction_of_parameter_bytes": None if pss is None else pss / param_bytes,
        "anon_fraction_of_parameter_bytes": anon / param_bytes,
        "peak_fraction_of_parameter_bytes": hwm / param_bytes,
        "construction_s": build_s, "finite": all(bool(torch.isfinite(p).all()) for p in pipe.parameters()),
    }
    pipe.close()
    with open(os.path.join(out_dir, f"rank{row['rank']}.json"), "w") as f:
        json.dump(row, f)


#: (name, ranks, per-device memory for planning or None); the memory is for training with AdamW.
RUNS = [("2 ranks, split for time", 2, None),
        ("2 ranks, devices of 9.5 GiB (AdamW)", 2, "9.5GiB"),
        ("4 ranks, split for time", 4, None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)  # internal: run as one rank, write here
    parser.add_argument("--plan", help=argparse.SUPPRESS)  # internal: the plan file the ranks load
    a = parser.parse_args()
    if a.rank_out:
        rank_main(a.layers, a.seq, a.plan, a.rank_out)
        return
    start = time.perf_counter()
    runs = []
    for name, n_ranks, memory in RUNS:
        with tempfile.TemporaryDirectory(prefix="meta-model-") as tmp:
            plan_path = os.path.join(tmp, "plan.json")
            split = _plan(n_ranks, memory, a.layers, a.seq, plan_path)
            rows = _run(n_ranks, a.layers, a.seq, plan_path, tmp)
        print(f"{name}: split at {split}")
        for row in rows:
            pss = row["pss_fraction_of_parameter_bytes"]
            print(f"  rank {row['rank']}: holds {row['held_parameter_bytes'] / 2**30:.2f} GiB of "
                  f"{row['parameter_bytes'] / 2**30:.2f} GiB of parameters; after construction resident "
                  f"{row['rss_after_construction_bytes'] / 2**30:.2f} GiB "
                  f"({100 * row['rss_fraction_of_parameter_bytes']:.1f}%), proportional share "
                  f"{'n/a' if pss is None else f'{100 * pss:.1f}%'}; before construction "
                  f"{row['rss_before_bytes'] / 2**30:.2f} GiB; built in {row['construction_s']:.0f} s")
        runs.append({"name": name, "n_ranks": n_ranks, "memory": memory, "split_points": split, "ranks": rows})
    result = {"model": "HF Llama (hidden 2048, 32 heads, 4 kv heads, vocab 32000), built on meta",
              "layers": a.layers, "seq_len": a.seq, "schedule": "1F1B", "n_microbatches": 4, "cost": "flops",
              "optimizer": "adamw", "init": "default", "runs": runs, "wall_s": time.perf_counter() - start}
    if a.layers == 22 and a.seq == 512:
        from _common import write_result
        write_result(RESULTS, result)
        print(f"wrote {RESULTS}")


def _plan(n_ranks: int, memory: str | None, layers: int, seq: int, path: str) -> list[str]:
    """Plan the meta model for ``n_ranks`` from counted FLOPs (within ``memory`` per device) into ``path``."""
    import torch

    import autopipe

    model, (x_mb,) = _build_meta_model(layers, seq)
    plan = autopipe.partition(model, n_ranks, (x_mb,), loss_fn=_loss_fn,
                              example_target=torch.zeros(x_mb.shape, dtype=torch.long, device="meta"),
                              schedule="1F1B", n_microbatches=4,
                              planner=PlannerOptions(cost="flops", memory=memory, optimizer="adamw", profiling=autopipe.ProfileOptions(progress=False)))
    plan.save(path)
    return list(plan.split_points)


def _run(n_ranks: int, layers: int, seq: int, plan_path: str, out_dir: str) -> list[dict]:
    """One torchrun world of ``n_ranks`` processes building the pipeline from the plan file; each rank's record."""
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(n_ranks), __file__, "--layers", str(layers), "--seq", str(seq), "--plan", plan_path,
                    "--rank-out", out_dir],
                   check=True, timeout=3600,
                   env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(n_ranks)]


if __name__ == "__main__":
    main()
