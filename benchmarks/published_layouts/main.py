"""Predict published training runs' layouts, fit efficiency shares on a named third, judge the rest.

Each row of ``rows.json`` is a measured run: the model's shape, the cluster, the layout it
ran and the throughput it reported, with its source. This script:

1. fits the efficiency shares of :class:`autopipe.layouts.gpu.Efficiency` that the data
   sheets cannot give (the GEMM share per accelerator, the fused-attention, float8 and
   compiled shares) on the rows marked ``fit`` only, minimizing the squared log error;
2. predicts every row's layout exactly as published, and reports the error of each, the
   held-out rows apart;
3. searches autopipe's own layout for the same model, GPU count and global batch
   (:func:`autopipe.layouts.search.search_layouts`, the row's runtime options kept) and
   reports its predicted throughput beside the published layout's, and why they differ.

Run:
    python benchmarks/published_layouts/main.py            # writes results.json beside it
    python benchmarks/published_layouts/main.py --smoke    # three rows, no fit
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _common import write_result  # noqa: E402

from autopipe.layouts.gpu import Efficiency, GpuCosts  # noqa: E402
from autopipe.layouts.search import search_layouts  # noqa: E402
from autopipe.layouts.shapes import TransformerShape  # noqa: E402
from autopipe.layouts.layout import Layout  # noqa: E402
from autopipe.layouts.step import model_flops_per_token, predict_step  # noqa: E402
from autopipe.machine.topology import Topology  # noqa: E402

#: The shares fitted, with the range searched for each and where the search starts (a fixed
#: start, so the fit does not depend on the library's current defaults, which it sets).
FITTED = {"gemm:A100": (0.3, 0.95), "gemm:H100": (0.2, 0.95), "gemm:H100-HBM2e": (0.2, 0.95), "attention": (0.15, 1.5),
          "fp8_gemm": (0.3, 2.0), "compiled_memory": (0.05, 1.0)}
START = {"gemm:A100": 0.72, "gemm:H100": 0.62, "gemm:H100-HBM2e": 0.62, "attention": 0.7, "fp8_gemm": 1.0,
         "compiled_memory": 0.5}


def load_rows(path: Path = HERE / "rows.json") -> list[dict]:
    return json.loads(path.read_text())["rows"]


def shape_of(row: dict) -> TransformerShape:
    model = row["model"]
    if "named" in model:
        return TransformerShape.named(model["named"])
    return TransformerShape(**model)


def gpu_of(row: dict, efficiency: Efficiency) -> GpuCosts:
    c = row["cluster"]
    inter = tuple(c["inter"]) if isinstance(c["inter"], list) else c["inter"]
    topology = Topology(gpus_per_node=c["gpus_per_node"], intra=c["intra"], inter=inter)
    return GpuCosts(c["accelerator"], topology, dtype=c["dtype"], efficiency=efficiency,
                    memory_bytes=c["memory_gb"] * 1e9, memory_bandwidth=c.get("memory_bandwidth"))


def layout_of(row: dict) -> Layout:
    return Layout(**row["layout"])


def megatron_flops_per_step(shape: TransformerShape, global_batch: int) -> float:
    """Megatron-LM's Eq. 3 (Narayanan et al. 2021): FLOPs a step counts, recomputation included."""
    b, s, l, h, v = global_batch, shape.seq_len, shape.layers, shape.hidden, shape.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def in_published_unit(row: dict, shape: TransformerShape, layout: Layout, step_s: float) -> float:
    """A predicted step time in the unit the row's source reports."""
    unit = row["published"]["unit"]
    if unit == "iteration_s":
        return step_s
    if unit == "tokens_per_s_per_gpu":
        return layout.global_batch * shape.seq_len / step_s / layout.n_gpus
    if unit == "model_tflops_per_gpu":  # 6 N + attention per token, as the Llama 3 paper and torchtitan count
        return layout.global_batch * shape.seq_len / step_s / layout.n_gpus * model_flops_per_token(shape) / 1e12
    if unit == "megatron_tflops_per_gpu":
        return megatron_flops_per_step(shape, layout.global_batch) / step_s / layout.n_gpus / 1e12
    raise ValueError(f"row {row['id']}: unknown unit {unit!r}")


def throughput_error(row: dict, predicted: float) -> float:
    """Signed error of the predicted throughput (a time unit is inverted first)."""
    published = row["published"]["value"]
    if row["published"]["unit"] == "iteration_s":
        return published / predicted - 1
    return predicted / published - 1


def efficiency_with(values: dict[str, float]) -> Efficiency:
    gemm = {k.split(":")[1]: v for k, v in values.items() if k.startswith("gemm:")}
    rest = {k: v for k, v in values.items() if ":" not in k}
    return Efficiency(gemm={**Efficiency().gemm, **gemm}, **rest)


def predict_row(row: dict, efficiency: Efficiency) -> dict:
    shape, layout = shape_of(row), layout_of(row)
    gpu = gpu_of(row, efficiency)
    p = predict_step(shape, layout, gpu)
    value = in_published_unit(row, shape, layout, p.step_s)
    return {"prediction": p, "predicted": value, "error": throughput_error(row, value), "gpu": gpu, "shape": shape}


def fit(rows: list[dict], sweeps: int = 6) -> dict[str, float]:
    """Coordinate descent with golden-section steps on the squared log error of the fitting rows,
    from :data:`START`."""
    values = dict(START)

    def loss(vals: dict[str, float]) -> float:
        eff = efficiency_with(vals)
        return sum(math.log1p(predict_row(r, eff)["error"]) ** 2 for r in rows)

    phi = (math.sqrt(5) - 1) / 2
    for _ in range(sweeps):
        for key, (lo, hi) in FITTED.items():
            a, b = lo, hi
            for _ in range(30):
                c, d = b - phi * (b - a), a + phi * (b - a)
                if loss({**values, key: c}) <= loss({**values, key: d}):
                    b = d
                else:
                    a = c
            values[key] = round((a + b) / 2, 4)
    return values


def own_layout(row: dict, efficiency: Efficiency, published: dict) -> dict:
    """autopipe's searched layout for the row's model, GPUs and global batch, the runtime kept."""
    shape, layout = shape_of(row), layout_of(row)
    gpu = gpu_of(row, efficiency)
    runtime = replace(Layout(), flash=layout.flash, float8=layout.float8, compiled=layout.compiled,
                      async_tp=layout.async_tp, overlap_dp=layout.overlap_dp, sp_regather=layout.sp_regather)
    started = time.perf_counter()
    found = search_layouts(shape, layout.n_gpus, global_batch=layout.global_batch, gpu=gpu, base=runtime,
                           max_micro_batch=max(8, layout.micro_batch))
    best = found.best
    theirs = published["prediction"]
    return {"layout": best.layout.describe(), "tokens_per_s_per_gpu": best.tokens_per_s_per_gpu,
            "predicted_in_unit": in_published_unit(row, shape, best.layout, best.step_s),
            "memory_gb": best.memory_bytes / 1e9, "speedup_over_published": theirs.step_s / best.step_s,
            "published_fits": theirs.memory_bytes <= gpu.memory_bytes,
            "why_published_is_slower": found.why_slower(theirs) if best.step_s < theirs.step_s else "",
            "considered": found.considered, "search_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--smoke", action="store_true", help="three rows, the default shares, no fit")
    args = ap.parse_args(argv)
    rows = load_rows()
    if args.smoke:
        rows = [r for r in rows if r["id"] in ("sc21-1.7B", "korthikanti-22B-selective", "torchtitan-t1-fsdp")]
        fitted = {}
    else:
        fitted = fit([r for r in rows if r["fit"]])
    efficiency = efficiency_with(fitted)
    out_rows = []
    for row in rows:
        got = predict_row(row, efficiency)
        p = got["prediction"]
        entry = {"id": row["id"], "source": row["source"], "fit": row["fit"], "layout": p.layout.describe(),
                 "published": row["published"], "predicted": got["predicted"], "error": got["error"],
                 "predicted_tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "predicted_mfu": p.mfu,
                 "predicted_memory_gb": p.memory_bytes / 1e9, "parts_s": p.parts_s,
                 "memory_error": (p.memory_bytes / (row["published"]["memory_gib"] * 2**30) - 1
                                  if "memory_gib" in row["published"] else None),
                 "own": own_layout(row, efficiency, got)}
        out_rows.append(entry)
        print(f"{row['id']:34s} {'fit ' if row['fit'] else 'held'} published {row['published']['value']:>8g} "
              f"predicted {got['predicted']:>9.4g}  error {got['error']:+.1%}   own: {entry['own']['layout']} "
              f"x{entry['own']['speedup_over_published']:.2f}", flush=True)
    held = [abs(r["error"]) for r in out_rows if not r["fit"]]
    by_id = {r["id"]: r for r in out_rows}
    ratio = None
    if "torchtitan-t5-1f1b" in by_id and "torchtitan-t5-interleaved" in by_id:
        a, b = by_id["torchtitan-t5-interleaved"], by_id["torchtitan-t5-1f1b"]
        ratio = {"published": a["published"]["value"] / b["published"]["value"], "predicted": a["predicted"] / b["predicted"]}
    summary = {"held_out_rows": len(held), "fit_rows": [r["id"] for r in out_rows if r["fit"]],
               "median_abs_error_held_out": statistics.median(held) if held else None,
               "max_abs_error_held_out": max(held) if held else None,
               "interleaved_over_1f1b": ratio, "fitted_shares": fitted}
    print(json.dumps(summary, indent=1))
    write_result(args.out, {"benchmark": "published_layouts", "summary": summary, "rows": out_rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
