"""``autopipe measure``: measure this machine once; the planner charges the link it keeps."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

from .._checks import check_int
from ..machine.link import measure_link
from ..machine.link_cache import cache_file, save_link
from ..runtime.overhead_probe import measure_action_overhead

def main(argv: Sequence[str] | None = None) -> int:
    """``autopipe measure``: measure the loopback link a few times, print the medians, keep the median run."""
    parser = argparse.ArgumentParser(prog="autopipe measure", description=main.__doc__)
    parser.add_argument("--device", default=None, help="'cpu' (gloo) or 'cuda' (NCCL, two GPUs); default: auto")
    parser.add_argument("--runs", type=int, default=5, help="independent measurements (fresh processes each)")
    parser.add_argument("--repeats", type=int, default=10, help="timed round trips per size and run")
    parser.add_argument("--json", action="store_true", help="print every run as JSON as well")
    parser.add_argument("--overhead", action="store_true",
                        help="also measure the runtime's cost per pipeline action and the slowdown of ranks "
                             "computing at once (Device(action_overhead_s=..., speed=...))")
    args = parser.parse_args(argv)
    runs = []
    for i in range(check_int("runs", args.runs, 1)):
        link = measure_link(device=args.device, repeats=args.repeats)
        runs.append(link)
        print(f"run {i + 1}: {link.summary()}", flush=True)
    bandwidth = statistics.median(r.bandwidth_bytes_per_s for r in runs)
    latency_s = statistics.median(r.latency_s for r in runs)
    print(f"median of {len(runs)} runs: {bandwidth / 1e9:.3g} GB/s, latency {latency_s * 1e6:.3g} us")
    kept = sorted(runs, key=lambda r: r.latency_s)[len(runs) // 2]  # a real run, at the median latency
    save_link(kept, kept.devices[0].split(":")[0])
    where = cache_file()
    print("kept for planning on this host" + (f" ({where})" if where is not None else " (this process only: "
                                                                                         "AUTOPIPE_LINK_CACHE=0)"))
    if args.json:
        print(json.dumps([r.to_dict() for r in runs]))
    if args.overhead:
        overhead = measure_action_overhead(device=args.device)
        print(f"runtime overhead: {overhead.summary()}")
        if args.json:
            print(json.dumps(overhead.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
