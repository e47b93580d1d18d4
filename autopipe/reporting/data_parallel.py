"""The pipeline x data-parallel table: every (pp, dp) factorization compared, fastest first.

Example:
    >>> record = {"mode": "fsdp", "reduction_s": 0.001, "dp_bandwidth": 5e10, "dp_latency_s": 2e-5,
    ...           "crossing": "dp", "factorizations": [
    ...     {"pp": 2, "dp": 4, "mode": "fsdp", "n_microbatches": 4, "schedule": "1F1B", "pipeline_step_s": 0.01,
    ...      "reduction_s": 0.001, "peak_bytes": 2**30, "fits": True, "reason": "", "crossing": "dp"}]}
    >>> dp_table(record).rows[0][:4]
    ['2 x 4', 'fsdp', '11.00 ms', '10.00 ms']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .tables import Table
from ..machine.device import format_bytes
from .units import format_seconds

def dp_table(record: Mapping[str, Any] | None) -> Table | None:
    """The factorizations of ``record`` as a table (None for a plan of one replica)."""
    if not record or not record.get("factorizations"):
        return None
    rows, highlight = [], []
    for i, r in enumerate(record["factorizations"]):
        usable = r["pipeline_step_s"] is not None and r["reduction_s"] is not None
        step = r["pipeline_step_s"] + r["reduction_s"] if usable else None
        rows.append([
            f"{r['pp']} x {r['dp']}", r["mode"] or "-", format_seconds(step) if usable else "-",
            format_seconds(r["pipeline_step_s"]) if usable else "-", format_seconds(r["reduction_s"]) if usable else "-",
            f"{r['schedule']} x{r['n_microbatches']}" if r["n_microbatches"] else "-",
            format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-", r["crossing"] or "-",
            "chosen" if i == 0 and r["fits"] else r["reason"][:90],
        ])
        highlight.append(i == 0 and r["fits"])
    link = f"{record['dp_bandwidth'] / 1e9:.3g} GB/s"
    return Table(
        title="pipeline x data parallel (pp x dp), fastest first",
        header=["pp x dp", "mode", "step", "pipeline", "dp reduction", "schedule x micro-batches",
                "peak mem/rank", "crosses nodes", "why not"],
        rows=rows, numeric=[False, False, True, True, True, False, True, False, False], highlight=highlight,
        notes=[f"step = one replica's pipeline step + its gradient reduction after it (not overlapped); the chosen "
               f"layout's dp groups reduce at {link}"])
