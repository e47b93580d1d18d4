"""The runtime's benchmarks run end to end at a tiny size (``--smoke``) and write the JSON they promise.

Timings are never checked: the benchmarks report them, they do not assert on them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _run(name: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name / "main.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_runtime_overhead_compares_autopipe_with_hand_written_torch(tmp_path):
    data = _run("runtime_overhead", tmp_path / "ro.json")
    (row,) = data["rows"]
    assert row["schedule"] == "1F1B"
    assert row["autopipe_step_s"] > 0 and row["hand_step_s"] > 0
    assert len(row["autopipe_steps_s"]) == len(row["hand_steps_s"]) == row["steps_each"]


def test_schedule_memory_measures_every_variant_on_every_rank(tmp_path):
    data = _run("schedule_memory", tmp_path / "sm.json")
    seen = {(r["variant"], r["rank"]) for r in data["rows"]}
    variants = ("GPipe", "1F1B", "1F1B+checkpointing", "1F1B, 4x micro-batches")
    assert seen == {(v, r) for v in variants for r in (0, 1)}
    m = {r["variant"]: r["n_microbatches"] for r in data["rows"]}
    assert m["1F1B, 4x micro-batches"] == 4 * m["1F1B"]
    assert all(r["peak_step_bytes"] > 0 for r in data["rows"])
