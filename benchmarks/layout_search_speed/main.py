"""How long the whole layout search takes at scale, from the model to the ranked layouts.

Each case builds the model on the meta device (Hugging Face classes at the published
shape), traces it once (``autopipe.planning.tracing.trace``), reads its shape and what
tensor parallelism can shard from the graph (``autopipe.layouts.shape_from_graph``), and
searches every tp x pp x dp layout with micro-batches, schedules and checkpointing
(``autopipe.layouts.search_layouts``). Each case runs in a fresh process, so its peak
resident memory is its own.

Run:
    python benchmarks/layout_search_speed/main.py           # 405B on 512 GPUs, a 1T GPT on 3,072
    python benchmarks/layout_search_speed/main.py --smoke   # a small Llama on 64 GPUs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from _common import write_result  # noqa: E402

#: (name, Hugging Face model_type, config, GPUs, global batch in sequences, accelerator, link inside a node)
CASES = {
    "llama3-405b": ("llama", dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248,
                                  num_attention_heads=128, num_key_value_heads=8, vocab_size=128256), 8192,
                    512, 256, "H100", "nvlink4"),
    "gpt-1t": ("gpt2", dict(n_layer=128, n_embd=25600, n_head=160, vocab_size=51200), 2048,
               3072, 3072, "A100", "nvlink3"),
    "llama-small": ("llama", dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=4096,
                                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000), 1024,
                    64, 128, "H100", "nvlink4"),
}


def run_case(name: str) -> dict:
    """One case, timed phase by phase, in this process."""
    import resource
    import time

    import torch
    import transformers

    from autopipe.layouts import GpuCosts, search_layouts, shape_from_graph
    from autopipe.machine.topology import Topology
    from autopipe.planning.tracing import trace

    model_type, config, seq, gpus, batch, accelerator, intra = CASES[name]
    started = time.perf_counter()
    if model_type == "llama":
        cfg = transformers.LlamaConfig(max_position_embeddings=seq, **config)
    else:
        cfg = transformers.GPT2Config(n_positions=seq, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    built = time.perf_counter()
    exported = trace(model, (ids,)).exported
    traced = time.perf_counter()
    shape = shape_from_graph(exported, seq_len=seq, name=name)
    read = time.perf_counter()
    gpu = GpuCosts(accelerator, Topology(gpus_per_node=8, intra=intra, inter="ib-ndr"))
    found = search_layouts(shape, gpus, global_batch=batch, gpu=gpu)
    searched = time.perf_counter()
    return {"case": name, "gpus": gpus, "global_batch": batch, "layers": shape.layers, "hidden": shape.hidden,
            "build_s": built - started, "trace_s": traced - built, "shape_s": read - traced,
            "search_s": searched - read, "total_s": searched - started, "layouts_considered": found.considered,
            "best": found.best.layout.describe(), "best_tokens_per_s_per_gpu": found.best.tokens_per_s_per_gpu,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--smoke", action="store_true", help="a small Llama on 64 GPUs only")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one case, in the child process
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case)))
        return 0
    rows = []
    for name in (["llama-small"] if args.smoke else ["llama3-405b", "gpt-1t"]):
        proc = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True,
                              timeout=900)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{name}: {row['gpus']} GPUs, trace {row['trace_s']:.1f} s, search {row['search_s']:.2f} s, "
              f"total {row['total_s']:.1f} s, peak {row['peak_rss_bytes'] / 2**30:.2f} GiB; best {row['best']}",
              flush=True)
    write_result(args.out, {"benchmark": "layout_search_speed", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
