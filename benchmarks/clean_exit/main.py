"""Does a finished run exit cleanly? The documented training loop, run many times through ``autopipe run``.

Each run starts ``loop.py`` (the loop of docs/training.md section 1 without its ``with``
block, so the script never closes its pipeline) on 2 CPU ranks with ``python -m autopipe run loop.py --nproc 2`` and records the
launcher's exit code and whether a rank aborted (SIGABRT, "terminate called" on stderr).
Without the pipeline closing itself at interpreter exit (``--without-exit-hooks``), 5 runs
in 100 on a 2-core host ended with a rank aborted at exit, and ``autopipe run`` returned 1;
with it, none in 100 (README.md).

    python benchmarks/clean_exit/main.py                        # 100 runs (~20-40 min on 2 cores)
    python benchmarks/clean_exit/main.py --runs 5               # a short check
    python benchmarks/clean_exit/main.py --without-exit-hooks   # the exit as it was, for comparison

Writes ``exit_codes.json`` beside this file (``--out`` elsewhere) and exits with 0 only if
every run exited with 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the checkout, also when autopipe is not installed
from _common import write_result  # noqa: E402


def one_run(extra: list[str], timeout_s: float) -> dict:
    """Start loop.py on 2 ranks; return its exit code, whether a rank aborted, and the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks on gloo, as on the host this was found on
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(HERE / "loop.py"), "--nproc", "2", *extra],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(ROOT))
        code, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as e:
        code, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
    aborted = "terminate called" in err or "exitcode: -6" in err or "Signal 6" in err
    return {"exit_code": code, "aborted": aborted, "seconds": round(time.perf_counter() - t0, 1),
            "stderr_tail": "" if code == 0 else err[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="5 runs")
    ap.add_argument("--without-exit-hooks", action="store_true", help="take autopipe's exit hooks away (as before)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--out", default=None, help="result file (default: exit_codes.json beside this script)")
    ap.add_argument("--device", default=None, help="accepted for run_all.py; the runs use CPU ranks (gloo)")
    args = ap.parse_args(argv)
    runs = 5 if args.quick else args.runs
    extra = ["--without-exit-hooks"] if args.without_exit_hooks else []
    results = []
    for i in range(runs):
        r = one_run(extra, args.timeout)
        results.append(r)
        print(f"run {i + 1:3d}/{runs}: exit code {r['exit_code']}{'  (a rank aborted)' if r['aborted'] else ''}"
              f"  {r['seconds']} s", flush=True)
    codes = collections.Counter(str(r["exit_code"]) for r in results)
    clean = codes.get("0", 0)
    summary = (f"{clean}/{runs} runs exited with 0; {sum(r['aborted'] for r in results)} with a rank aborted at exit"
               f"{' (exit hooks taken away)' if args.without_exit_hooks else ''}")
    print(summary)
    command = "python benchmarks/clean_exit/main.py" + (f" --runs {runs}" if runs != 100 else "") + (
        " --without-exit-hooks" if args.without_exit_hooks else "")
    write_result(args.out or HERE / ("exit_codes_without_hooks.json" if args.without_exit_hooks else "exit_codes.json"),
                 {"benchmark": "clean_exit", "command": command, "runs": runs, "exit_codes": dict(codes),
                  "summary": summary, "per_run": results})
    return 0 if clean == runs else 1


if __name__ == "__main__":
    sys.exit(main())
