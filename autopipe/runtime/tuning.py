"""Measure before committing: real steps of a plan's best few splits on the ranks, the fastest kept."""

from __future__ import annotations

import copy
import gc
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from .._checks import check_int
from ..machine.timing import fastest_paired, paired_ratio, paired_ratio_interval, synchronize
from ..planning.options import PlannerOptions
from ..planning.plan import Plan
from ..planning.plan_records import TuningRecord
from .distributed import collective_device, gather_digests
from .pipeline import Pipeline

def tuning_candidates(plan: Plan, count: int) -> list[tuple[list[str], float]]:
    """The plan's own split and the fastest-predicted distinct splits it reports, at most ``count``.

    Example:
        >>> [s for s, _ in tuning_candidates(plan, 2)]  # doctest: +SKIP
        [['model.norm'], ['model.layers.3']]
    """
    count = check_int("candidates", count, 1)
    out = [(list(plan.split_points), float(plan.predicted_step_s))]
    others = sorted((b for b in plan.baselines if b.fits_memory and not b.reason and b.split_points),
                    key=lambda b: b.predicted_step_s)
    for b in others:
        if len(out) >= count:
            break
        if all(list(b.split_points) != s for s, _ in out):
            out.append((list(b.split_points), float(b.predicted_step_s)))
    return out


def tune(model: torch.nn.Module, *args: Any, target: Any, plan: Plan, candidates: int = 3, rounds: int = 5,
         **pipeline_kwargs: Any) -> Pipeline:
    """Build the best few splits of ``plan`` on the ranks, time real steps of each, return the fastest's Pipeline.

    Collective: every rank calls it with the same arguments and the same batch, as for
    :meth:`Pipeline.step`. Each candidate takes one untimed step, then ``rounds`` timed steps
    in turn with the others; the parameters' gradients are cleared after each step, and no
    optimizer runs, so the model's weights are as they were.

    Args:
        model: the model, as for :class:`Pipeline`.
        *args: the model's inputs for a whole batch (``n_microbatches`` micro-batches).
        target: what ``loss_fn`` compares the output with.
        plan: the plan whose splits compete (:func:`tuning_candidates`).
        candidates: how many splits to measure, >= 1 (the plan's own among them).
        rounds: timed steps of each split, >= 1. Splits are compared round by round, by the
            median of their rounds' step ratios: the plan's own split is kept unless another
            beats it beyond the noise of those ratios (:func:`faster_beyond_noise`); with few
            rounds only a clear difference moves it.
        **pipeline_kwargs: what :class:`Pipeline` takes beside the model and the plan
            (``loss_fn`` and ``example_args`` at least).

    Returns:
        The fastest split's :class:`Pipeline`, ready to train; ``pipe.plan.tuning`` is a
        :class:`~autopipe.planning.plan_records.TuningRecord` of every split measured.
        Where the plan's own split wins, ``pipe.plan`` is the plan; otherwise the plan of
        the split that won, as :class:`Pipeline` builds it from split points.

    Raises:
        ValueError: ``candidates`` or ``rounds`` is not a positive integer, or
            ``pipeline_kwargs`` names ``plan`` or ``split_points`` (the candidates set them).
        PipelineStepError: a step failed on some rank (every rank raises).

    Example:
        >>> pipe = autopipe.tune(model, x, target=y, plan=plan, loss_fn=loss_fn,
        ...                      example_args=(x_mb,))  # doctest: +SKIP
    """
    rounds = check_int("rounds", rounds, 1)
    splits = tuning_candidates(plan, candidates)
    taken = sorted({"plan", "split_points"} & set(pipeline_kwargs))
    if taken:
        raise ValueError(f"tune() sets {taken} for each candidate; pass the plan as plan= and leave "
                         f"{', '.join(taken)} out of the Pipeline's arguments")
    rest = {k: v for k, v in pipeline_kwargs.items() if k != "planner"}
    planner = PlannerOptions.of(pipeline_kwargs.get("planner"))
    layout = {"schedule": plan.schedule, "n_microbatches": plan.n_microbatches,
              "planner": replace(planner, stages_per_rank=plan.stages_per_rank)}
    pipes = [Pipeline(model, plan=plan, planner=planner, **rest)]  # the same on every rank, whatever they were given
    settings = {"candidates": candidates, "rounds": rounds, "splits": [s for s, _ in splits]}
    digests = gather_digests(settings, pipes[0].world_size)
    if len(set(digests)) > 1:
        pipes[0].close()
        groups = sorted([r for r, d in enumerate(digests) if d == digest] for digest in set(digests))
        raise ValueError(f"tune() was called with different candidates, rounds or plans on different ranks (ranks "
                         f"agreeing with each other: {groups}); this rank has candidates={candidates}, "
                         f"rounds={rounds}. Every rank must call it with the same arguments")
    for split, _ in splits[1:]:
        pipes.append(Pipeline(model, split_points=split, **layout, **rest))
    times = torch.zeros(len(pipes), rounds, dtype=torch.float64)
    for r in range(-1, rounds):  # round -1 sets up buffers and communication: untimed
        for k, pipe in enumerate(pipes):
            pipe.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(*args, target=target)
            synchronize(pipe.device)  # a GPU step ends when its kernels do
            if r >= 0:
                times[k, r] = time.perf_counter() - t0
    for pipe in pipes:
        pipe.zero_grad()
    # The step of a split is its slowest rank's; every rank then reads the same numbers.
    shared = times.to(collective_device(pipes[0].device))
    dist.all_reduce(shared, op=dist.ReduceOp.MAX)
    rows = shared.cpu().tolist()
    measured = [statistics.median(row) for row in rows]
    best = faster_beyond_noise(rows)
    winner = pipes[best]
    del pipes
    gc.collect()
    record = TuningRecord(split_points=[s for s, _ in splits], predicted_step_s=[p for _, p in splits],
                          measured_step_s=measured, rounds=rounds, chosen=best,
                          vs_chosen=[paired_ratio(row, rows[best]) for row in rows], round_steps_s=rows)
    winner.plan = copy.copy(winner.plan)
    winner.plan.tuning = record
    return winner


def faster_beyond_noise(rows: list[list[float]]) -> int:
    """Index of the split to keep, from each split's step in each round (``rows[0]``: the plan's own).

    Compared round by round, as they ran, so that the host's drift between rounds cancels.
    Another split replaces the plan's own only where its steps beat the own split's beyond
    their noise: the whole 95% interval of its paired ratio over the own split lies below 1
    (:func:`~autopipe.machine.timing.paired_ratio_interval`). Of several such splits, the one
    none of them beats (:func:`~autopipe.machine.timing.fastest_paired`); where they beat each
    other in a circle, the plan's own stays.

    Example:
        >>> faster_beyond_noise([[1.0, 1.0, 1.0], [0.9, 0.9, 0.9], [0.98, 1.05, 0.97]])
        1
    """
    beyond = [k for k in range(1, len(rows)) if paired_ratio_interval(rows[k], rows[0])[1] < 1.0]
    if not beyond:
        return 0
    best, _ = fastest_paired({k: rows[k] for k in [0, *beyond]}, start=0)
    return best
