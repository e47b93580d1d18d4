"""Timing every stage inside running training steps, for :meth:`autopipe.Plan.calibrate`.

A profile times each piece of the model alone in one process; inside a running pipeline
the same stage can take longer (the other ranks compute, the communication threads and
the kernel take their share of the cores; docs/costs-and-measurement.md). A
:class:`StageTimer` times the calls torch's schedule makes on each of this rank's stage
objects - forward, backward, and the weight-gradient part where the schedule splits it -
by shadowing those methods on the instances while it is active; :func:`gather_stage_times`
gives every rank every stage's mean per micro-batch.

Example::

    with StageTimer(pipe_stages, device) as timer:
        run_a_step()          # untimed: sets up buffers
        timer.clear()
        run_a_step()
    times = gather_stage_times(timer.means(), world_size)   # {"fwd_s": [...], "bwd_s": [...]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..machine.timing import Timer, per_run_s

#: The stage methods torch's schedules call, and what each is charged as.
_TIMED_CALLS = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


class StageTimer:
    """Times the schedule's calls on ``stages`` while active (``with StageTimer(...)``).

    Args:
        stages: this rank's torch stage objects (those the training schedule runs).
        device: their device; on a GPU the work is timed, not its launch.

    Example::

        with StageTimer(train_stages, torch.device("cpu")) as timer:
            schedule.step(x, target=y, return_outputs=False)
        timer.means()   # {1: (0.0123, 0.0251)}
    """

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
        """``{stage index: (forward s, backward s)}``, the mean per call; backward includes the weight part.

        The mean per call, as the profile keeps (a step adds the calls up; machine.timing.per_run_s).
        """
        def mean(values: list[float]) -> float:
            return per_run_s(values) if values else 0.0

        return {s: (mean(r["F"]), mean(r["B"]) + mean(r["W"])) for s, r in self._times.items()}


def gather_stage_times(local: dict[int, tuple[float, float]], world_size: int) -> dict[str, list[float]]:
    """Every rank's :meth:`StageTimer.means`, as ``{"fwd_s": [...], "bwd_s": [...]}`` by stage (collective).

    Example::

        gather_stage_times({0: (0.01, 0.02)}, 2)   # rank 1 sent {1: ...}: {"fwd_s": [0.01, ...], ...}
    """
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    every = {s: v for part in gathered for s, v in part.items()}
    n_stages = len(every)
    return {"fwd_s": [every[s][0] for s in range(n_stages)], "bwd_s": [every[s][1] for s in range(n_stages)]}
