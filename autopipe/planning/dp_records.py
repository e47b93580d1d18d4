"""What a pipeline x data-parallel plan records: every (pp, dp) factorization tried, and the links.

Example:
    >>> row = Factorization(pp=2, dp=4, mode="fsdp", n_microbatches=4, schedule="1F1B",
    ...                     pipeline_step_s=1.0, reduction_s=0.1, peak_bytes=2**30, fits=True)
    >>> row.step_s
    1.1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan_checks import MAX_STAGES, FieldCheck, required_fields

@dataclass
class Factorization:
    """One (pp, dp, mode) the planner costed: its best pipeline, the reduction, its memory, or why not."""

    pp: int  # pipeline ranks per replica
    dp: int  # replicas
    mode: str  # "fsdp" or "replicate"
    n_microbatches: int | None = None  # per replica and step
    schedule: str = ""
    pipeline_step_s: float | None = None  # one replica's pipeline step (costmodel.predicted_step_s)
    reduction_s: float | None = None  # the slowest rank's data-parallel collectives after the step
    peak_bytes: int | None = None  # the fullest rank's predicted peak memory
    fits: bool = False
    reason: str = ""  # why it was not usable (skipped, does not fit), or empty
    crossing: str = ""  # which dimension leaves a node: "none", "pp", "dp", "both" ("" without a Topology)
    min_memory_bytes: int | None = None  # where it does not fit: the least per-device memory that would

    @property
    def step_s(self) -> float | None:
        """Predicted step: the pipeline, then the reduction (not overlapped)."""
        if self.pipeline_step_s is None or self.reduction_s is None:
            return None
        return self.pipeline_step_s + self.reduction_s


@dataclass
class DataParallelRecord:
    """The data-parallel side of a plan: the reduction charged and every factorization compared."""

    mode: str  # of the chosen factorization
    reduction_s: float  # charged after the pipeline step
    dp_bandwidth: float  # bytes/s the dp ring was charged at
    dp_latency_s: float
    crossing: str = ""  # of the chosen factorization
    factorizations: list[Factorization] = field(default_factory=list)


def record_from_data(c: FieldCheck, name: str, value: Any) -> DataParallelRecord | None:
    """A :class:`DataParallelRecord` from plan-file data, every field checked (None stays None)."""
    if value is None:
        return None

    def maybe_int(f: str, v: Any) -> int | None:
        return None if v is None else c.integer(f, v)

    def maybe_number(f: str, v: Any) -> float | None:
        return c.number(f, v, none=True)

    rows = {
        "pp": lambda f, v: c.integer(f, v, 1, MAX_STAGES), "dp": lambda f, v: c.integer(f, v, 1, MAX_STAGES),
        "mode": c.text, "n_microbatches": maybe_int, "schedule": c.text, "pipeline_step_s": maybe_number,
        "reduction_s": maybe_number, "peak_bytes": maybe_int, "fits": c.flag, "reason": c.text, "crossing": c.text,
        "min_memory_bytes": maybe_int,
    }
    top = {
        "mode": c.text, "reduction_s": c.number, "dp_bandwidth": lambda f, v: c.number(f, v, positive=True),
        "dp_latency_s": c.number, "crossing": c.text,
        "factorizations": lambda f, v: c.sequence(f, v, lambda g, x: Factorization(
            **c.record(g, x, rows, required_fields(Factorization)))),
    }
    return DataParallelRecord(**c.record(name, value, top, required_fields(DataParallelRecord)))
