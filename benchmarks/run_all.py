"""Run every benchmark one after another, then render ``docs/benchmarks.md``.

Each benchmark is a separate process (``python benchmarks/<name>/main.py``), so one that
fails does not stop the others; the page is rendered from whatever results exist. Runs
one at a time on purpose: benchmarks that time things must not share the machine.

    python benchmarks/run_all.py                 # full runs (each within ~10 min on a 2-core CPU)
    python benchmarks/run_all.py --quick         # every benchmark's --quick mode
    python benchmarks/run_all.py --only split_quality prediction_accuracy
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("planner_scaling", "trace_profile", "split_quality", "split_quality_sim", "real_steps", "prediction_accuracy", "precision",
         "runtime_overhead", "schedule_memory")
# Not timings but a behaviour counted over many runs (clean_exit: 100 launches, ~20-40 min;
# retrace_memory: 1,000 steps each tracing the stages again, ~30 min): run only when named with --only.
ON_REQUEST = ("clean_exit", "retrace_memory")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument("--device", default=None, help="pass --device to every benchmark (cpu, cuda)")
    ap.add_argument("--only", nargs="*", default=None, help="benchmark folders to run (default: all)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a benchmark is stopped")
    ap.add_argument("--no-render", action="store_true")
    args = ap.parse_args(argv)
    found = [d.name for d in HERE.iterdir() if (d / "main.py").exists()]
    names = [n for n in ORDER if n in found] + sorted(n for n in found if n not in ORDER)
    if args.only:
        unknown = sorted(set(args.only) - set(found))
        if unknown:
            raise SystemExit(f"unknown benchmarks {unknown}; these exist: {names}")
        names = [n for n in names if n in args.only]
    else:
        names = [n for n in names if n not in ON_REQUEST]
    failed = []
    for name in names:
        cmd = [sys.executable, str(HERE / name / "main.py")]
        if args.quick:
            cmd.append("--quick")
        if args.device:
            cmd += ["--device", args.device]
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"== {name} (load average {load:.1f})", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, cwd=HERE.parent, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    if not args.no_render:
        subprocess.run([sys.executable, str(HERE / "render_docs.py")], cwd=HERE.parent, check=False)
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
