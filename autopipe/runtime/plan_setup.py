"""Settling, on every rank, which plan the pipeline runs: given, split by hand, or planned once."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._checks import check_int
from ..machine.precision import mixed_precision_context
from ..planning.default_loss import pipeline_loss, traced_output
from ..planning.cost_sources import CostSource, cost_source
from ..planning.options import PlannerOptions, ProfileOptions
from ..planning.plan import Plan, StagePlan
from ..planning.schedules import canonical_schedule_name, default_stages_per_rank, validate_schedule
from ..planning.tracing import resolve_example_inputs, trace
from .distributed import broadcast_object, gather_digests
from .materialize import on_meta, to_meta

@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, checked: a plan, split points, or settings for the planner."""

    plan: Plan | None
    split_points: list[str] | None
    schedule: str | None
    n_microbatches: int | None
    planner: PlannerOptions
    example_target: Any = None

    @property
    def stages_per_rank(self) -> int | None:
        return self.planner.stages_per_rank

    @property
    def profile_in_ranks(self) -> bool | None:
        return self.planner.profiling.in_ranks if self.planner.profiling is not None else None

    @classmethod
    def checked(cls, model: nn.Module, *, plan: Plan | str | os.PathLike | None = None,
                split_points: Sequence[str] | None = None, schedule: str | None = None,
                n_microbatches: int | None = None, planner: PlannerOptions | None = None,
                example_target: Any = None) -> PlanRequest:
        """Check every argument that needs no other rank; raise naming the first bad one."""
        plan = _load_plan(plan, split_points)
        split_points = _check_split_points(model, split_points if plan is None else plan.split_points,
                                           "split_points" if plan is None else "plan.split_points")
        if n_microbatches is not None:
            check_int("n_microbatches", n_microbatches, not_int=TypeError)
        if schedule is not None:
            schedule = canonical_schedule_name(schedule)  # lists the valid names when unknown
        request = cls(plan=plan, split_points=split_points, schedule=schedule, n_microbatches=n_microbatches,
                      planner=PlannerOptions.of(planner), example_target=example_target)
        profile_in_ranks = request.profile_in_ranks
        if profile_in_ranks and (plan is not None or split_points is not None):
            raise ValueError("planner.profiling.in_ranks=True profiles for the planner, but a plan or split_points "
                             "was given: there is nothing to plan; drop one of them")
        if profile_in_ranks and not _measures_costs(request.planner):
            raise ValueError(f"planner.profiling.in_ranks=True measures the costs, but the planner options give them "
                             f"(cost={_short(request.planner.cost)}): drop one of them")
        return request


@dataclass(frozen=True)
class PipelineLayout:
    """The settled plan and how it runs: the same on every rank."""

    plan: Plan
    schedule: str
    n_microbatches: int
    stages_per_rank: int
    n_ranks: int


def settle_plan(request: PlanRequest, model: nn.Module, example_args: tuple, example_kwargs: dict | None,
                loss_fn: Callable | None, *, rank: int, world_size: int, device: torch.device,
                comm_device: torch.device, pp_size: int | None = None, mesh_given: bool = False) -> PipelineLayout:
    """One plan and schedule for every rank (collective). ``pp_size``: the ranks of one pipeline under
    data parallelism; ``mesh_given``: whether the user built the mesh (else ``data_parallel=`` did)."""
    plan, schedule = request.plan, request.schedule
    pipeline_ranks = world_size if pp_size is None else pp_size
    dp = world_size // pipeline_ranks
    if pp_size is None:
        where, fix = "the world has", lambda n: f"launch with --nproc {n}"
    elif mesh_given:
        where, fix = "the mesh's pp dimension has", lambda n: f"build the mesh with pp={n}"
    else:
        where = f"data_parallel={dp} leaves each pipeline ({world_size} ranks / {dp})"
        fix = lambda n: (f"launch with --nproc {n * dp}" + (f", or give data_parallel={world_size // n}"  # noqa: E731
                                                              if world_size % n == 0 else ""))
    n_microbatches, stages_per_rank = request.n_microbatches, request.stages_per_rank
    # ---- the settings every rank derives from its own arguments (no communication)
    if plan is not None:
        schedule = schedule or canonical_schedule_name(plan.schedule)
        n_microbatches = n_microbatches or plan.n_microbatches
        stages_per_rank = stages_per_rank or plan.stages_per_rank
        if plan.num_stages % stages_per_rank:
            raise ValueError(f"the plan has {plan.num_stages} stages, which is not a multiple of "
                             f"stages_per_rank={stages_per_rank}")
        n_ranks = plan.num_stages // stages_per_rank
    else:
        schedule = schedule or "1F1B"
        n_ranks = pipeline_ranks
        stages_per_rank = stages_per_rank or default_stages_per_rank(schedule)
        if request.split_points is not None:
            n_microbatches = n_microbatches or 2 * n_ranks
            stages = n_ranks * stages_per_rank
            if len(request.split_points) + 1 != stages:
                raise ValueError(
                    f"split_points={list(request.split_points)} make {len(request.split_points) + 1} stages, but "
                    f"{n_ranks} ranks x stages_per_rank={stages_per_rank} need {stages} "
                    f"(give {stages - 1} split points)"
                )
    if n_ranks != pipeline_ranks:
        raise ValueError(
            f"the pipeline needs {n_ranks} ranks (the plan: {n_ranks * stages_per_rank} stages, "
            f"{stages_per_rank} per rank) but {where} {pipeline_ranks} processes; {fix(n_ranks)}"
        )
    if n_microbatches is not None:
        validate_schedule(schedule, n_ranks, n_microbatches, stages_per_rank)
    if plan is None and request.split_points is not None:
        plan = _plan_from_split_points(request.split_points, schedule, n_microbatches, stages_per_rank)

    # ---- one plan for all ranks
    if plan is None:
        plan = _plan_on_rank0(request, model, example_args, example_kwargs, loss_fn, rank=rank,
                              world_size=world_size, n_ranks=n_ranks, schedule=schedule,
                              n_microbatches=n_microbatches, stages_per_rank=stages_per_rank, device=device,
                              comm_device=comm_device)
        n_microbatches = n_microbatches or plan.n_microbatches
        validate_schedule(schedule, n_ranks, n_microbatches, plan.stages_per_rank)
        if plan.num_stages != n_ranks * stages_per_rank:
            raise ValueError(f"the planner returned {plan.num_stages} stages; {n_ranks} ranks x "
                             f"stages_per_rank={stages_per_rank} need {n_ranks * stages_per_rank}")
    else:
        _check_ranks_agree(plan, schedule, n_microbatches, stages_per_rank, world_size)
    return PipelineLayout(plan=plan, schedule=schedule, n_microbatches=n_microbatches,
                          stages_per_rank=stages_per_rank, n_ranks=n_ranks)


def _plan_on_rank0(request: PlanRequest, model: nn.Module, example_args: tuple, example_kwargs: dict | None,
                   loss_fn: Callable | None, *, rank: int, world_size: int, n_ranks: int, schedule: str,
                   n_microbatches: int | None, stages_per_rank: int, device: torch.device,
                   comm_device: torch.device) -> Plan:
    """Profile (in every rank, or on rank 0 alone), plan on rank 0; every rank receives its plan, or its error."""
    planner = request.planner
    if on_meta(model):  # a model on the meta device is planned from inputs on it too
        example_args, example_kwargs = to_meta((tuple(example_args), example_kwargs))
    # Measure where the stages will run.
    profiling = planner.profiling or ProfileOptions()
    profiling = replace(profiling, device=profiling.device if profiling.device is not None else device)
    kwargs, loss_note = planner_kwargs(planner, model, example_args, example_kwargs, loss_fn,
                                       request.example_target)
    kwargs["profiling"] = profiling
    kwargs["stages_per_rank"] = stages_per_rank
    profile_together = request.profile_in_ranks
    if profile_together is None:
        profile_together = profile_in_ranks_by_default(world_size, planner)
    if profile_together:  # every rank at once, before rank 0 plans from their mean
        from ..planning.rank_profile import profile_in_ranks

        with mixed_precision_context(planner.mixed_precision, torch.device(profiling.device)):
            kwargs["cost"] = profile_in_ranks(model, example_args, example_kwargs, device=profiling.device,
                                              **rank_profile_settings(profiling))
    outcome: tuple[str, Any] | None = None
    if rank == 0:
        try:
            from ..planning.planner import plan_partition

            found = plan_partition(model, n_ranks, example_args=example_args, example_kwargs=example_kwargs,
                                   schedule=schedule, n_microbatches=n_microbatches, **kwargs)
            if loss_note:  # the pipeline's loss could not be costed: the plan says so
                found.notes = [*found.notes, loss_note]
            outcome = ("ok", found.to_dict())
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            outcome = ("error", f"{type(e).__name__}: {e}")
    outcome = broadcast_object(outcome, src=0, device=comm_device)
    if outcome[0] == "error":
        if rank == 0:
            raise error
        raise RuntimeError(f"planning failed on rank 0, so no rank can build its stages: {outcome[1]}")
    return Plan.from_dict(outcome[1])


def planner_kwargs(planner: PlannerOptions, model: nn.Module, example_args: tuple, example_kwargs: dict | None,
                   loss_fn: Callable | None, example_target: Any = None) -> tuple[dict[str, Any], str | None]:
    """The keywords the pipeline passes to ``partition`` (before ``profiling``), and a plan note or None."""
    kwargs = {f.name: v for f in fields(planner) if (v := getattr(planner, f.name)) is not None and v != f.default}
    if kwargs.get("recompute") is not False:  # stages checkpointed by hand (True, indices): the planner decides freely
        kwargs.pop("recompute", None)
    output = None
    if loss_fn is not None and example_target is None and on_meta(model):
        # A meta model cannot run (Hugging Face's mask code reads values): its output's shapes come from the trace.
        output = traced_output(trace(model, to_meta(tuple(example_args)), to_meta(example_kwargs)))
    loss_kwargs, note = pipeline_loss(model, example_args, example_kwargs, loss_fn, example_target, output)
    return {**kwargs, **loss_kwargs}, note


def check_ranks_agree_on_inputs(example_args: tuple, example_kwargs: dict | None, world_size: int) -> None:
    """Every rank must trace the same example micro-batch (shapes, dtypes, other values); otherwise all
    raise at once, naming the ranks and the input that differ, instead of splitting differently and
    waiting (collective)."""
    described = describe_inputs(example_args, example_kwargs)
    if len(set(gather_digests(described, world_size))) == 1:
        return
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, described)
    differ = [r for r, d in enumerate(every) if d != every[0]]
    first = differ[0]
    where = next((f"{a} on rank 0, {b} on rank {first}" for a, b in zip(every[0], every[first]) if a != b),
                 f"{len(every[0])} inputs on rank 0, {len(every[first])} on rank {first}")
    raise ValueError(f"the ranks were given different example inputs (example_args / example_kwargs): ranks {differ} "
                     f"differ from rank 0, first at {where}. Every rank traces the model on its example, so all must "
                     f"give the same shapes, dtypes and values of other arguments")


def describe_inputs(example_args: tuple, example_kwargs: dict | None) -> list[str]:
    """One line per input leaf: where it sits, and its dtype and shape (or its value).

    Example:
        >>> describe_inputs((torch.ones(2, 3),), {"causal": True})
        ['args[0]: torch.float32 (2, 3) on cpu', "kwargs['causal']: True"]
    """
    from torch.utils._pytree import keystr, tree_flatten_with_path

    leaves, _ = tree_flatten_with_path({"args": tuple(example_args), "kwargs": dict(example_kwargs or {})})
    lines = []
    for path, leaf in leaves:
        where = keystr(path)[2:].replace("']", "", 1)  # "['args'][0]" -> "args[0]"
        value = f"{leaf.dtype} {tuple(leaf.shape)} on {leaf.device.type}" if isinstance(leaf, torch.Tensor) \
            else repr(leaf)
        lines.append(f"{where}: {value}")
    return lines


def _check_ranks_agree(plan: Plan, schedule: str, n_microbatches: int, stages_per_rank: int,
                       world_size: int) -> None:
    """Every rank must run the same split and schedule; otherwise all raise the same error."""
    digests = gather_digests((plan.split_points, plan.num_stages, schedule, n_microbatches, stages_per_rank),
                             world_size)
    if len(set(digests)) > 1:
        groups = {d: [r for r, x in enumerate(digests) if x == d] for d in set(digests)}
        raise ValueError(
            f"ranks were given different plans or settings (split points, schedule, "
            f"n_microbatches, stages_per_rank); ranks agreeing with each other: "
            f"{sorted(groups.values())}. Give every rank the same plan file."
        )


def _measures_costs(planner: PlannerOptions) -> bool:
    """Whether the planner would measure the model (no estimate, no costs given)."""
    return isinstance(planner.cost, (str, CostSource)) and cost_source(planner.cost).measured


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def profile_in_ranks_by_default(world_size: int, planner: PlannerOptions) -> bool:
    """``profile_in_ranks=None``: profile in every rank when there are several and nothing else gives the costs.

    Example:
        >>> profile_in_ranks_by_default(2, PlannerOptions(memory="1GiB"))
        True
        >>> profile_in_ranks_by_default(2, PlannerOptions(cost="flops")), profile_in_ranks_by_default(1, PlannerOptions())
        (False, False)
    """
    return world_size > 1 and planner.devices is None and _measures_costs(planner)


def rank_profile_settings(profiling: ProfileOptions) -> dict[str, Any]:
    """The settings of the ranks' profile: the planner's own profiling settings.

    Example:
        >>> rank_profile_settings(ProfileOptions(repeats=3, flush_cache=False))
        {'warmup': 2, 'repeats': 3, 'flush_cache': False, 'fit_to_whole': None}
    """
    return {"warmup": profiling.warmup, "repeats": profiling.repeats, "flush_cache": profiling.flush_cache,
            "fit_to_whole": profiling.fit_to_whole}


def check_model_and_inputs(model: Any, example_args: Any, example_kwargs: Any,
                           loss_fn: Any) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The checked ``(example_args, example_kwargs)``: ``()`` for args when only keywords are given.

    Example:
        >>> check_model_and_inputs(nn.Linear(2, 2), None, {"input": torch.ones(1, 2)}, None)[0]
        ()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if example_args is None and example_kwargs is None:
        example_args, example_kwargs = resolve_example_inputs(model, None, None)
    elif example_args is None:  # every input is a keyword (Hugging Face's input_ids=...)
        example_args = ()
    if not isinstance(example_args, tuple):
        raise TypeError(
            f"example_args must be a tuple of one micro-batch's positional inputs, e.g. (x_mb,); "
            f"got {type(example_args).__name__}"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict or None, got {type(example_kwargs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    return example_args, example_kwargs


def _load_plan(plan: Any, split_points: Any) -> Plan | None:
    if plan is not None and split_points is not None:
        raise ValueError("give either plan= or split_points=, not both")
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            raise FileNotFoundError(f"plan={os.fspath(plan)!r}: no such plan file")
        return Plan.load(plan)
    raise TypeError(f"plan must be an autopipe Plan, a plan file path or None, got {type(plan).__name__}")


def _check_split_points(model: nn.Module, split_points: Any, arg: str) -> list[str] | None:
    if split_points is None:
        return None
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise TypeError(f"{arg} must be a list of module names, got {split_points!r}")
    names = dict(model.named_modules())
    bad = [p for p in split_points if not isinstance(p, str) or p not in names or p == ""]
    if bad:
        raise ValueError(
            f"{arg}={list(split_points)!r}: {bad} are not submodules of the model; split points "
            f"are module names such as {[n for n in names if n][:5]}"
        )
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"{arg}={list(split_points)!r} names a module twice")
    return list(split_points)


def _plan_from_split_points(split_points: list[str], schedule: str, n_microbatches: int,
                            stages_per_rank: int) -> Plan:
    """A Plan for a hand-chosen split: the split points, no cost predictions."""
    n = len(split_points) + 1
    stages = [StagePlan(index=i, fqns=[], first_segment=i, last_segment=i, fwd_s=0.0, bwd_s=0.0, comm_s=0.0,
                        param_bytes=0, act_bytes=0, peak_bytes=0, send_bytes=0, recv_bytes=0) for i in range(n)]
    return Plan(num_stages=n, split_points=list(split_points), stages=stages, schedule=schedule,
                n_microbatches=n_microbatches, bottleneck_s=0.0, predicted_step_s=0.0, lower_bound_s=0.0,
                cost_source="none", objective="given by hand", stages_per_rank=stages_per_rank,
                notes=["split points given by hand to autopipe.Pipeline: no costs predicted"])
