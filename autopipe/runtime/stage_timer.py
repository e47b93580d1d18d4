"""Timing every stage inside running training steps, for :meth:`autopipe.Plan.calibrate`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..machine.timing import Timer, per_run_s

#: The stage methods torch's schedules call, and what each is charged as.
_TIMED_CALLS = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


class StageTimer:
    """Times the schedule's calls on ``stages`` while active (``with StageTimer(...)``)."""

    def __init__(self, stages: Sequence[Any], device: torch.device) -> None:
        self._stages = list(stages)
        self._timer = Timer(device)
        self._times: dict[int, dict[str, list[float]]] = {
            stage.stage_index: {key: [] for _, key in _TIMED_CALLS} for stage in self._stages}
        self._patched: list[tuple[Any, str]] = []

    def __enter__(self) -> StageTimer:
        for stage in self._stages:
            record = self._times[stage.stage_index]
            for method, key in _TIMED_CALLS:
                original = getattr(stage, method, None)
                if original is None:
                    continue

                def timed(*a: Any, _original: Any = original, _into: list = record[key], **k: Any) -> Any:
                    seconds, result = self._timer.time(lambda: _original(*a, **k))
                    _into.append(seconds)
                    return result

                setattr(stage, method, timed)  # an instance attribute shadows the method
                self._patched.append((stage, method))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for stage, method in self._patched:
            delattr(stage, method)
        self._patched = []

    def clear(self) -> None:
        """Forget the calls timed so far (the first step, which sets up buffers)."""
        for record in self._times.values():
            for values in record.values():
                values.clear()

    def means(self) -> dict[int, tuple[float, float]]:
        """``{stage index: (forward s, backward s)}``, the mean per call; backward includes the weight part."""
        def mean(values: list[float]) -> float:
            return per_run_s(values) if values else 0.0

        return {s: (mean(r["F"]), mean(r["B"]) + mean(r["W"])) for s, r in self._times.items()}


def gather_stage_times(local: dict[int, tuple[float, float]], world_size: int) -> dict[str, list[float]]:
    """Every rank's :meth:`StageTimer.means`, as ``{"fwd_s": [...], "bwd_s": [...]}`` by stage (collective)."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    every = {s: v for part in gathered for s, v in part.items()}
    n_stages = len(every)
    return {"fwd_s": [every[s][0] for s in range(n_stages)], "bwd_s": [every[s][1] for s in range(n_stages)]}
