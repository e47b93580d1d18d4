"""How long tracing and profiling take on a GPT-2-small-sized model, on CPU (or --device cuda).

GPT-2 small's shape (12 layers, d=768, 12 heads, vocabulary 50,257) built from a config, no
weights downloaded. Reports the time of ``trace`` (torch.export plus split-point search), of
``profile_segments`` (every segment measured: warm-up + repeats), the number of segments,
and, for scale, one plain forward+backward of the whole model. Nothing is asserted.

    python benchmarks/trace_profile/main.py            # GPT-2 small, 1 x 128 tokens
    python benchmarks/trace_profile/main.py --quick    # 2 layers
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402

from zoo.hf import gpt2_from_config  # noqa: E402
from autopipe.machine.timing import Timer, resolve_device  # noqa: E402
from autopipe.planning.profile import profile_segments  # noqa: E402
from autopipe.planning.tracing import trace  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers instead of 12")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results.json"))
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    n_layer = 2 if args.quick else 12
    model, inputs = gpt2_from_config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257,
                                     n_positions=1024, batch=args.batch, seq_len=args.seq_len)
    print(f"GPT-2 config: {n_layer} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"{args.batch} x {args.seq_len} tokens, device {device}", flush=True)

    t0 = time.perf_counter()
    traced = trace(model, inputs)
    trace_s = time.perf_counter() - t0
    print(f"trace:   {trace_s:6.2f} s, {traced.num_segments} segments", flush=True)

    t0 = time.perf_counter()
    costs = profile_segments(traced, device=device, warmup=args.warmup, repeats=args.repeats, progress=False)
    profile_s = time.perf_counter() - t0
    seg_sum = sum(c.fwd_s + c.bwd_s for c in costs)
    print(f"profile: {profile_s:6.2f} s ({args.warmup} warm-up + {args.repeats} timed runs per segment)", flush=True)

    # One plain training step of the whole model on the same device, for scale.
    full = model.to(device)
    x = inputs[0].to(device)
    timer = Timer(device)

    def step() -> None:
        full(x).float().sum().backward()

    step()
    whole = statistics.median(timer.time(step)[0] for _ in range(3))
    print(f"whole model fwd+bwd: {whole * 1e3:.1f} ms; sum of segment fwd+bwd: {seg_sum * 1e3:.1f} ms", flush=True)
    path = write_result(args.out, {
        "benchmark": "trace_profile", "model": f"gpt2 {n_layer} layers d768 vocab 50257",
        "tokens": [args.batch, args.seq_len], "device": str(device),
        "segments": traced.num_segments, "trace_s": trace_s, "profile_s": profile_s,
        "warmup": args.warmup, "repeats": args.repeats,
        "whole_model_step_s": whole, "sum_of_segments_s": seg_sum,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
