"""Pipeline x data parallel at scale, simulated: Llama-3-8B and 70B shapes planned for 8 to 512 H100s.

Each model is built on the meta device in bf16 (shapes only: no memory for its weights),
traced once and its segments' FLOPs counted once on meta (``profile_segments(...,
device="meta")``); that profile is then handed to ``autopipe.partition(..., data_parallel=DataParallelOptions("auto", "auto"),
planner=PlannerOptions(cost=profile, global_batch=B))`` for every GPU count, so no layout
re-traces the model. The machine is H100s (``Device.preset("H100")``: 80 GB, 40% of the
989 TFLOP/s bf16 peak) in nodes of 8, NVLink 4 inside a node and one 400 Gb/s InfiniBand NDR
port per GPU between nodes (:class:`autopipe.machine.topology.Topology`).

The global batch follows torchtitan's runs: 2 sequences of 8192 tokens per GPU.

    python benchmarks/scale_study/main.py            # the study, writes results.json
    python benchmarks/scale_study/main.py --quick    # a tiny Llama on 8 and 16 GPUs, checks the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/_common
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the test models (tests/zoo)
sys.path.insert(0, str(HERE.parents[1]))  # the checkout's autopipe
from autopipe import PlannerOptions  # noqa: E402

RESULTS = HERE / "results.json"

VOCAB = 128256  # the Llama 3 tokenizer
MODELS: dict[str, dict[str, int]] = {
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=VOCAB),
    "llama3-70b": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=VOCAB),
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512)
SEQ_PER_GPU = 2  # torchtitan's local batch per data-parallel rank of 1 GPU (Tables 1 and 3)

#: Mixed-precision Adam as torchtitan's FSDP2 runs it: fp32 master weights and two fp32 moments
#: per parameter, 12 bytes, i.e. 6 bytes per byte of the bf16 parameter the planner counts.
OPTIMIZER_FACTOR = 6.0

#: What torchtitan reports for these models (arXiv 2410.06511; the same runs are tabled in
#: pytorch/torchtitan docs/performance.md at commit eaea6f6). Sequence length 8192, H100s,
#: 8 per host on NVLink, 400 Gb/s RDMA per GPU between hosts.
TORCHTITAN: dict[tuple[str, int], dict[str, Any]] = {
    ("llama3-8b", 8): {"layout": "FSDP 8 (1D)", "fsdp": 8, "tp": 1, "pp": 1, "global_batch": 16,
                       "source": "performance.md Table 1: local batch 2, global batch 16, selective AC"},
    ("llama3-8b", 128): {"layout": "FSDP 128 (1D)", "fsdp": 128, "tp": 1, "pp": 1, "global_batch": 256,
                         "source": "performance.md Table 3: local batch 2, global batch 256, selective AC"},
    ("llama3-70b", 256): {"layout": "FSDP 32 x TP 8 (2D)", "fsdp": 32, "tp": 8, "pp": 1, "global_batch": 512,
                          "source": "performance.md Table 4: local batch 16, global batch 512, full AC"},
}


def build(name: str, seq: int) -> tuple[Any, Any, int]:
    """The model on meta in bf16, one micro-batch of one sequence, and its parameter count."""
    import torch

    from zoo.hf import llama_from_config

    with torch.device("meta"):
        model, args = llama_from_config(batch=1, seq_len=seq, max_position_embeddings=seq, **MODELS[name])
    model = model.to(torch.bfloat16)
    return model, args, sum(p.numel() for p in model.parameters())


def plan_row(model: Any, args: Any, costs: Any, name: str, n_gpus: int, seq: int, topo: Any,
             schedule: str) -> dict[str, Any]:
    """Plan one GPU count; the chosen layout and every factorization ranked."""
    import autopipe

    # The loss is sized on meta too: on the CPU its logits (8192 x 128256) would be made for real.
    META_PROFILING = autopipe.ProfileOptions(device="meta", warmup=0, repeats=1, progress=False)
    global_batch = SEQ_PER_GPU * n_gpus
    start = time.perf_counter()
    try:
        plan = autopipe.partition(model, n_gpus, args, data_parallel=autopipe.DataParallelOptions("auto", "auto"),
                                  schedule=schedule,
                                  planner=PlannerOptions(cost=costs, devices=topo, global_batch=global_batch, optimizer=OPTIMIZER_FACTOR, profiling=META_PROFILING))
    except autopipe.InfeasibleMemoryError as e:  # no layout fits: each one's least memory is the result
        plan, rows, least = None, e.factorizations, e.min_memory_bytes
    else:
        rows = plan.data_parallel.factorizations if plan.data_parallel else []
    planning_s = time.perf_counter() - start
    tokens = global_batch * seq
    alternatives = [{"pp": r.pp, "dp": r.dp, "mode": r.mode, "schedule": r.schedule, "n_microbatches": r.n_microbatches,
                     "step_s": r.step_s, "reduction_s": r.reduction_s, "peak_bytes": r.peak_bytes, "fits": r.fits,
                     "min_memory_bytes": r.min_memory_bytes, "crossing": r.crossing, "reason": r.reason}
                    for r in rows]
    common = {"model": name, "n_gpus": n_gpus, "global_batch_seqs": global_batch, "global_batch_tokens": tokens,
              "memory_bytes": topo.device.memory_bytes, "torchtitan": TORCHTITAN.get((name, n_gpus)),
              "planning_s": planning_s, "alternatives": alternatives}
    if plan is None:
        return {**common, "fits": False, "pp": None, "dp": None, "dp_mode": None, "schedule": None,
                "n_microbatches": None, "step_s": None, "tokens_per_s_per_gpu": None, "peak_bytes": None,
                "least_memory_bytes": least}
    record = plan.data_parallel
    step_s = plan.predicted_step_s + (record.reduction_s if record else 0.0)
    best = rows[0] if rows else None
    return {
        **common, "fits": True,
        "pp": plan.pp_degree, "dp": plan.dp_degree, "dp_mode": plan.dp_mode, "schedule": plan.schedule,
        "n_microbatches": plan.n_microbatches, "split_points": len(plan.split_points),
        "recompute_stages": list(plan.recompute_stages or []),
        "pipeline_step_s": plan.predicted_step_s, "reduction_s": record.reduction_s if record else 0.0,
        "step_s": step_s, "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / n_gpus,
        "peak_bytes": best.peak_bytes if best else max(plan.rank_peak_bytes or [0]),
        "crossing": best.crossing if best else "",
    }


def study(name: str, seq: int, gpu_counts: list[int], schedule: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Trace and count one model once, then plan it for every GPU count."""
    from autopipe.machine.device import Device
    from autopipe.machine.topology import Topology
    from autopipe.planning.profile import profile_segments
    from autopipe.planning.tracing import trace

    topo = Topology(Device.preset("H100"), gpus_per_node=8, intra="nvlink4", inter="ib-ndr")
    start = time.perf_counter()
    model, args, n_params = build(name, seq)
    costs = profile_segments(trace(model, args), cost="flops", device="meta", device_flops=topo.device.flops,
                             progress=False)
    info = {"model": name, "config": MODELS[name], "parameters": n_params, "segments": len(costs),
            "seq_len": seq, "act_bytes_per_microbatch": sum(c.act_bytes for c in costs),
            "param_bytes": sum(c.param_bytes for c in costs), "profile_s": time.perf_counter() - start}
    print(f"{name}: {n_params / 1e9:.2f}B parameters, {len(costs)} segments, traced and counted in "
          f"{info['profile_s']:.1f} s", flush=True)
    rows = []
    for n in gpu_counts:
        row = plan_row(model, args, costs, name, n, seq, topo, schedule)
        rows.append(row)
        if not row["fits"]:
            print(f"  {n:4d} GPUs: no layout fits; the least memory any needs is "
                  f"{row['least_memory_bytes'] / 1e9:.0f} GB (planned in {row['planning_s']:.1f} s)", flush=True)
            continue
        print(f"  {n:4d} GPUs: pp={row['pp']} x dp={row['dp']} {row['dp_mode'] or '-'} {row['schedule']} "
              f"m={row['n_microbatches']}: step {row['step_s']:.2f} s, {row['tokens_per_s_per_gpu']:.0f} tok/s/GPU, "
              f"peak {row['peak_bytes'] / 1e9:.1f} GB (planned in {row['planning_s']:.1f} s)", flush=True)
    return info, rows


def layout_rows(name: str, seq: int, gpu_counts: list[int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every GPU count again with tensor parallelism and per-block checkpointing allowed
    (autopipe.layouts), the model's shape read from its traced graph on the meta device."""
    from autopipe.layouts import GpuCosts, search_layouts, shape_from_graph
    from autopipe.machine.topology import Topology
    from autopipe.planning.tracing import trace

    start = time.perf_counter()
    model, args, _ = build(name, seq)
    shape = shape_from_graph(trace(model, args).exported, seq_len=seq, name=name)
    traced_s = time.perf_counter() - start
    # torchtitan's own part (96 GB of HBM2e, 500 W), so its tables compare like with like.
    gpu = GpuCosts("H100-HBM2e", Topology(gpus_per_node=8, intra="nvlink4", inter="ib-ndr"))
    rows = []
    for n in gpu_counts:
        started = time.perf_counter()
        found = search_layouts(shape, n, global_batch=SEQ_PER_GPU * n, gpu=gpu)
        row: dict[str, Any] = {"model": name, "n_gpus": n, "search_s": time.perf_counter() - started,
                               "considered": found.considered, "fits": bool(found.ranked)}
        if found.ranked:
            best = found.best
            row.update(best.to_dict())
            print(f"  {n:4d} GPUs with TP: {best.layout.describe()}: {best.tokens_per_s_per_gpu:.0f} tok/s/GPU, "
                  f"{best.memory_bytes / 1e9:.0f} GB", flush=True)
        rows.append(row)
    shape_info = {"model": name, "layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads,
                  "kv_heads": shape.kv_heads, "ffn": shape.ffn, "vocab": shape.vocab, "traced_s": traced_s}
    return shape_info, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", "--smoke", action="store_true",
                        help="a tiny Llama on 8 and 16 GPUs; writes results only where --out is given")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--schedule", default="1F1B", help="a schedule, or 'auto' to compare them all (slower)")
    parser.add_argument("--gpus-8b", type=int, nargs="+", default=list(GPU_COUNTS))
    parser.add_argument("--gpus-70b", type=int, nargs="+", default=list(GPU_COUNTS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--layouts-only", action="store_true",
                        help="only (re)compute the tensor-parallel layouts, into the existing results.json")
    a = parser.parse_args()
    from _common import write_result

    start = time.perf_counter()
    if a.quick:
        plan = [("tiny", 128, [8, 16])]
    else:
        plan = [("llama3-8b", a.seq, a.gpus_8b), ("llama3-70b", a.seq, a.gpus_70b)]
    shapes, layouts = [], []
    for name, seq, counts in plan:
        info, got = layout_rows(name, seq, counts)
        shapes.append(info)
        layouts.extend(got)
    if a.layouts_only:
        import json

        out = a.out or RESULTS
        payload = json.loads(out.read_text())
        payload.update({"layout_shapes": shapes, "layouts": layouts})
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"added {len(layouts)} tensor-parallel layouts to {out}")
        return
    models, rows = [], []
    for name, seq, counts in plan:
        info, got = study(name, seq, counts, a.schedule)
        models.append(info)
        rows.extend(got)
    payload = {"machine_simulated": "H100 SXM preset (80 GB, 0.4 x 989 TFLOP/s bf16), 8 per node, NVLink 4 "
                                    "(450 GB/s) inside, InfiniBand NDR (50 GB/s per GPU) across",
               "cost": "flops", "schedule": a.schedule, "seq_per_gpu": SEQ_PER_GPU,
               "optimizer_bytes_per_param_byte": OPTIMIZER_FACTOR, "models": models, "rows": rows,
               "layout_shapes": shapes, "layouts": layouts,
               "wall_s": time.perf_counter() - start}
    if a.quick and a.out is None:
        print(f"quick run done in {payload['wall_s']:.1f} s ({len(rows)} rows); results not written")
        return
    out = a.out or RESULTS
    write_result(out, payload)
    print(f"wrote {out} in {payload['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
