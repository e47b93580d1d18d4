"""Build a Pipeline of a Llama-style model of over a billion parameters from the meta device, on 2 and 4 ranks.

Every rank builds the model under ``torch.device("meta")`` (shapes, no values), the
pipeline plans it from counted FLOPs, and each rank materializes and initializes (the
default init) only the tensors of its own stage. The script records each rank's resident
memory after construction (``VmRSS``), its peak so far (``VmHWM``) and the resident
split into what the rank allocated (``RssAnon``) and mapped files (``RssFile``: the shared
libraries, whose pages both ranks share), all from ``/proc/self/status``, against the full
model's parameter bytes, and writes ``results.json`` next to itself.

    python benchmarks/meta_model/main.py                 # 1.1B parameters: 22 layers, seq 512
    python benchmarks/meta_model/main.py --layers 2 --seq 64   # a quick look
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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
RESULTS = HERE / "results.json"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                vocab_size=32000, max_position_embeddings=2048)


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rank_main(layers: int, seq: int, out_dir: str) -> None:
    """One rank (under torch.distributed.run): build the pipeline from meta, record its memory."""
    import torch
    import torch.nn as nn

    import autopipe
    from autopipe.models.hf import llama_from_config

    torch.set_num_threads(1)
    with torch.device("meta"):
        model, (x_mb,) = llama_from_config(num_hidden_layers=layers, batch=1, seq_len=seq, **LLAMA_1B)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = LLAMA_1B["vocab_size"]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    pipe = autopipe.Pipeline(model, example_args=(torch.zeros(x_mb.shape, dtype=x_mb.dtype),), loss_fn=loss_fn,
                             schedule="1F1B", n_microbatches=4,
                             planner=autopipe.PlannerOptions(cost="flops",
                                                             profiling=autopipe.ProfileOptions(progress=False)))
    build_s = time.perf_counter() - start
    rss, hwm = _status_bytes("VmRSS"), _status_bytes("VmHWM")
    anon, file_backed = _status_bytes("RssAnon"), _status_bytes("RssFile")
    held = sum(p.numel() * p.element_size() for p in pipe.parameters())
    # What of the resident is heap already freed (Python garbage, glibc arenas not yet returned).
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = _status_bytes("VmRSS")
    row = {
        "rank": pipe.rank, "stages": pipe.stage_indices, "split_points": pipe.plan.split_points,
        "parameters": n_params, "parameter_bytes": param_bytes, "held_parameter_bytes": held,
        "rss_before_bytes": before, "rss_after_construction_bytes": rss, "peak_rss_bytes": hwm,
        "rss_after_gc_and_malloc_trim_bytes": trimmed, "rss_anon_bytes": anon, "rss_file_bytes": file_backed,
        "rss_fraction_of_parameter_bytes": rss / param_bytes, "anon_fraction_of_parameter_bytes": anon / param_bytes,
        "peak_fraction_of_parameter_bytes": hwm / param_bytes,
        "construction_s": build_s, "finite": all(bool(torch.isfinite(p).all()) for p in pipe.parameters()),
    }
    pipe.close()
    with open(os.path.join(out_dir, f"rank{row['rank']}.json"), "w") as f:
        json.dump(row, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pipeline sizes to build, one run each")
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)  # internal: run as one rank, write here
    a = parser.parse_args()
    if a.rank_out:
        rank_main(a.layers, a.seq, a.rank_out)
        return
    start = time.perf_counter()
    runs = []
    for n_ranks in a.ranks:
        rows = _run(n_ranks, a.layers, a.seq)
        for row in rows:
            print(f"{n_ranks} ranks, rank {row['rank']} (stages {row['stages']}): {row['parameters'] / 1e9:.2f}B-parameter "
                  f"model, {row['parameter_bytes'] / 2**30:.2f} GiB of parameters; this rank holds "
                  f"{row['held_parameter_bytes'] / 2**30:.2f} GiB; resident after construction "
                  f"{row['rss_after_construction_bytes'] / 2**30:.2f} GiB "
                  f"({100 * row['rss_fraction_of_parameter_bytes']:.1f}%), of which "
                  f"{row['rss_before_bytes'] / 2**30:.2f} GiB before construction (torch, transformers); peak "
                  f"{row['peak_rss_bytes'] / 2**30:.2f} GiB; built in {row['construction_s']:.0f} s")
        runs.append({"n_ranks": n_ranks, "ranks": rows})
    result = {"model": "HF Llama (hidden 2048, 32 heads, 4 kv heads, vocab 32000), built on meta",
              "layers": a.layers, "seq_len": a.seq, "schedule": "1F1B", "n_microbatches": 4, "cost": "flops",
              "init": "default", "runs": runs, "wall_s": time.perf_counter() - start}
    if a.layers == 22 and a.seq == 512:
        from _common import write_result
        write_result(RESULTS, result)
        print(f"wrote {RESULTS}")


def _run(n_ranks: int, layers: int, seq: int) -> list[dict]:
    """One torchrun world of ``n_ranks`` processes building the pipeline; each rank's record."""
    with tempfile.TemporaryDirectory(prefix="meta-model-") as out_dir:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(n_ranks), __file__, "--layers", str(layers), "--seq", str(seq), "--rank-out", out_dir],
                       check=True, timeout=3600,
                       env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(n_ranks)]


if __name__ == "__main__":
    main()
