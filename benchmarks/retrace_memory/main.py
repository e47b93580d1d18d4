"""Does a pipeline's memory stay flat when the batches' sequence lengths keep changing?

A pipeline keeps the stages of 8 input shapes besides the traced one; with 20 lengths in a
cycle every step traces its stages again and drops the least recently used shape's. This
runs the seed Transformer on 2 gloo CPU ranks, one training step per length, cycling 20
lengths, and records each rank's resident memory (VmRSS) and the number of entries torch.fx
keeps in ``linecache`` after every cycle. Flat after the first cycles means re-traces free
what they make.

    python benchmarks/retrace_memory/main.py                    # 1,000 steps (50 cycles)
    python benchmarks/retrace_memory/main.py --quick            # 100 steps, a short check

Writes ``results.json`` beside this file (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import linecache
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402
from _pipebench import run_world  # noqa: E402


def rss_mb() -> float:
    """This process's resident memory (Linux's /proc/self/status VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark reads Linux's process status")


def worker(rank: int, world: int, job: dict) -> list[dict]:
    import gc

    import torch

    from autopipe import Pipeline
    from autopipe.models import seed_transformer

    model, (x_mb,) = seed_transformer(vocab_size=64, d_model=32, num_heads=4, d_ff=64, num_layers=4, batch=2,
                                      seq_len=job["lengths"][0])
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, 64), y.reshape(-1))  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    with Pipeline(model, example_args=(x_mb,), loss_fn=loss_fn, split_points=["layers.2"], n_microbatches=2) as pipe:
        t0 = time.perf_counter()
        for step in range(job["steps"]):
            length = job["lengths"][step % len(job["lengths"])]
            x = torch.randint(0, 64, (4, length), generator=gen)
            pipe.step(x, target=x)
            pipe.zero_grad()
            if (step + 1) % len(job["lengths"]) == 0:
                gc.collect()
                rows.append({"step": step + 1, "rss_mb": rss_mb(), "linecache": len(linecache.cache),
                             "seconds": time.perf_counter() - t0})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="100 steps (5 cycles)")
    parser.add_argument("--lengths", type=int, default=20, help="distinct sequence lengths cycled through")
    parser.add_argument("--out", default=str(HERE / "results.json"))
    args = parser.parse_args()
    if args.quick:
        args.steps = 100
    lengths = [8 + k for k in range(args.lengths)]
    per_rank = run_world(worker, 2, {"steps": args.steps, "lengths": lengths}, timeout_s=6 * 3600,
                         pg_timeout_s=300)
    warm = 2  # cycles before memory is judged: the first ones fill the 8 kept shapes and torch's own caches
    summary = []
    for rank, rows in enumerate(per_rank):
        after = rows[warm - 1:] if len(rows) >= warm else rows
        summary.append({"rank": rank, "rss_after_warmup_mb": after[0]["rss_mb"], "rss_end_mb": rows[-1]["rss_mb"],
                        "growth_after_warmup_mb": max(r["rss_mb"] for r in after) - after[0]["rss_mb"],
                        "linecache_after_warmup": after[0]["linecache"], "linecache_end": rows[-1]["linecache"]})
        print(f"rank {rank}: RSS {after[0]['rss_mb']:.1f} MB after cycle {warm}, {rows[-1]['rss_mb']:.1f} MB after "
              f"{rows[-1]['step']} steps (largest rise {summary[-1]['growth_after_warmup_mb']:.1f} MB); linecache "
              f"entries {after[0]['linecache']} -> {rows[-1]['linecache']}")
    write_result(args.out, {"steps": args.steps, "lengths": lengths, "per_rank": per_rank, "summary": summary})


if __name__ == "__main__":
    main()
