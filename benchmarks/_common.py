"""Helpers shared by the benchmark scripts: machine description and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# The models the benchmarks run are the tests' (tests/zoo), not part of the library.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }
    return info


def write_result(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus the machine description as indented JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def median(xs: list[float]) -> float:
    return statistics.median(xs)
