"""``autopipe.partition``: from a model to a Plan, one visible step at a time.

Example:
    >>> import autopipe
    >>> from autopipe.models import seed_transformer
    >>> model, args = seed_transformer(vocab_size=1000, num_layers=2, seq_len=16)
    >>> quick = autopipe.ProfileOptions(warmup=0, repeats=1, progress=False)
    >>> plan = autopipe.partition(model, 2, example_args=args, planner=autopipe.PlannerOptions(profiling=quick))
    >>> plan.num_stages, len(plan.split_spec)
    (2, 1)
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from .._checks import check_at_most, check_int
from . import schedules as sim
from .costgraph import CostGraph, SegmentCost, autocast_dtypes, build_cost_graph
from .data_parallel import example_batch_size, plan_data_parallel
from ..machine.topology import Topology
from .link_choice import choose_link, link_mode
from ..machine.device import (Device, format_bytes, default_action_overhead_s, default_copy_bandwidth, default_link,
                               optimizer_state_factor, sends_are_lazy)
from ..errors import InfeasibleMemoryError
from .plan import Plan
from .plan_assembly import make_plan
from .plan_file import MAX_STAGES
from .options import DataParallelOptions, PlannerOptions, ProfileOptions, resolve_devices
from ..machine.host_memory import PeakResidentMemory
from ..machine.speed import counting_flops
from ..machine.timing import resolve_device
from ..machine.precision import mixed_precision_context
from .default_loss import charged_loss
from .cost_sources import COST_SOURCES, MEASURED, CostSource, cost_source
from .profile import LossCost, SegmentCosts, coarsened, profile_segments
from .scaling import ScaledProfile, profile_scaling
from .schedule_options import ScheduleOption, auto_schedule_options, cost_option
from .split_candidates import INSIDE_BLOCK_MARGIN, close_call_note
from .segment_graphs import on_meta_device
from .frameworks import restrict_to_target
from .tracing import TracedModel, trace, traced_from

# --------------------------------------------------------------------------- entry point


def partition(
    model: torch.nn.Module | SegmentCosts,
    n_gpus: int,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Any = None,
    example_target: Any = None,
    schedule: str = "1F1B",
    n_microbatches: int | str | None = None,
    planner: PlannerOptions | None = None,
    data_parallel: int | str | DataParallelOptions = 1,
) -> Plan:
    """Find where to cut ``model`` into pipeline stages so the schedule runs fastest.

    Traces the model with ``torch.export`` (as ``torch.distributed.pipelining.pipeline``
    does), measures every segment between legal split points, and searches exactly for the
    contiguous split whose heaviest stage (compute + communication) is lightest while
    every stage fits its device's memory. The model is left exactly as it was.

    Args:
        model: Any ``nn.Module`` that ``torch.export`` can capture. A Hugging Face model may
            come with its default config: its KV cache is off while autopipe traces and
            profiles it and is restored after (:mod:`autopipe.planning.hf_compat`), and
            ``plan.notes`` says so. Or a profile of it from
            :func:`~autopipe.planning.profile_segments`: planned from its trace and costs,
            nothing traced or measured again (the example inputs come with it), so one profile
            serves every ``n_gpus``, schedule and micro-batch count.
        n_gpus: Number of pipeline ranks (devices), >= 1.
        example_args: One micro-batch of positional inputs (``mb_args`` in torch's
            ``pipeline()``); may be omitted if the model carries ``example_input_array``
            or ``dummy_inputs``.
        example_kwargs: One micro-batch of keyword inputs.

    Keyword Args:
        schedule: One of :data:`autopipe.planning.schedules.SCHEDULES` (GPipe, 1F1B,
            Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), or
            ``"auto"`` to compare them all (and 2 or 4 stages per rank for the looped ones)
            and keep the fastest that fits in memory; ``plan.alternatives`` lists them all.
        n_microbatches: Micro-batches per step; default ``2 * n_gpus``. ``"auto"`` tries
            every divisor of ``planner.global_batch`` (up to 64) as the micro-batch count, costing each
            micro-batch size from a profile taken at several sizes (no re-profiling per
            count), and keeps the fastest that fits (``plan.microbatch_size``).
        loss_fn, example_target: The training loss ``loss_fn(output, target)`` and one
            micro-batch's target. The last stage computes the loss of every micro-batch and
            holds what it saves (for a language model, the log-softmax over the vocabulary)
            until that micro-batch's backward; with both given, its time and saved bytes
            (:func:`autopipe.planning.profile.profile_loss`) are charged to the last stage.
            Without ``loss_fn`` (None), a language model's output (vocabulary logits over
            integer token inputs) is charged the token cross-entropy it trains with, against
            random token ids; any other output is costed without a loss. ``plan.notes`` (and
            so the report) says which (:mod:`autopipe.planning.default_loss`).
            ``loss_fn=False`` costs the last stage without a loss and says nothing (a
            pipeline that runs no loss).
        planner: The hardware, the cost source and the search's settings, a
            :class:`~autopipe.planning.options.PlannerOptions` (devices, memory, cost,
            profiling, objective, optimizer, global_batch, stages_per_rank, recompute, target,
            mixed_precision, compile);
            the same value configures :class:`~autopipe.Pipeline`. None: its defaults (this
            machine's device, memory unlimited, costs measured, Adam's state counted).
        data_parallel: Replicas of the pipeline (pipeline x data parallel): 1 (default, a pure
            pipeline of ``n_gpus`` ranks), a count dividing ``n_gpus``, or ``"auto"`` to compare
            every ``pp x dp`` factorization of ``n_gpus`` and keep the fastest that fits; or a
            :class:`~autopipe.planning.options.DataParallelOptions` saying that and how the
            replicas reduce gradients: mode ``"fsdp"`` (default: parameters, gradients and
            optimizer state sharded over the replicas), ``"replicate"`` (whole copies and an
            all-reduce) or ``"auto"`` (both compared). Replicas need
            ``planner.global_batch`` (each replica runs ``global_batch / dp`` samples in
            micro-batches of the example's size). ``plan.pp_degree``, ``plan.dp_degree`` and
            ``plan.data_parallel`` (every factorization, ranked) say what was chosen
            (:mod:`autopipe.planning.data_parallel`). ``planner.devices`` may then be a
            :class:`~autopipe.machine.topology.Topology`.

    Returns:
        A :class:`~autopipe.planning.plan.Plan`. Use ``plan.split_spec`` with
        ``torch.distributed.pipelining.pipeline`` or pass the plan to
        :class:`autopipe.Pipeline`; ``print(plan.report())`` explains it.

    Raises:
        ValueError: a bad argument (named in the message), raised before any work:
            ``n_gpus`` above ``MAX_STAGES`` (10**5) or ``n_microbatches`` above
            :data:`~autopipe.planning.schedules.MAX_SCHEDULE_SIZE` before tracing; more stages than
            the legal split points allow, or more (stage, micro-batch) pairs than
            ``MAX_SCHEDULE_SIZE``, right after tracing, before profiling.
        TypeError: an argument of the wrong kind (``planner`` not a PlannerOptions,
            ``planner.devices`` not Devices).
        MissingExampleInputsError: no example inputs.
        ModelExportError: the model cannot be exported (with the exporter's reason).
        InfeasibleMemoryError: no split fits ``planner.memory`` (the message says what would).

    Example:
        >>> import autopipe
        >>> from autopipe.models import seed_transformer
        >>> model, args = seed_transformer(vocab_size=2000, num_layers=2, seq_len=16)
        >>> quick = autopipe.ProfileOptions(warmup=0, repeats=1, progress=False)
        >>> plan = autopipe.partition(model, 2, example_args=args,
        ...                           planner=autopipe.PlannerOptions(profiling=quick))
        >>> plan.num_stages, len(plan.split_spec)
        (2, 1)
    """
    o = PlannerOptions.of(planner)
    if isinstance(model, SegmentCosts):  # a profile: plan from its trace and costs, measuring nothing again
        model, example_args, example_kwargs, o = _from_profile(model, example_args, example_kwargs, o)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or a profile from profile_segments, got "
                        f"{type(model).__name__}")
    if not (o.recompute is False or o.recompute == "auto"):
        raise ValueError(f"planner.recompute={o.recompute!r}: partition() takes 'auto' (recompute on the stages "
                         "that need it when memory binds) or False (never); True, stage indices, 'full' or "
                         "'selective' (per block) checkpoint a Pipeline")
    return plan_partition(model, n_gpus, example_args, example_kwargs, loss_fn=loss_fn,
                          example_target=example_target, schedule=schedule, n_microbatches=n_microbatches,
                          data_parallel=data_parallel, **{f.name: getattr(o, f.name) for f in fields(o)})


def _from_profile(profile: SegmentCosts, example_args: Any, example_kwargs: Any,
                  options: PlannerOptions) -> tuple[torch.nn.Module, Any, Any, PlannerOptions]:
    """The model, inputs and options to plan a profile with; what the profile brings may not be given again."""
    traced = profile.traced
    model = traced.source[0]() if traced is not None and traced.source is not None else None
    if model is None:
        raise ValueError("model: this profile holds no trace of a live model (read from a file, sent between "
                         "processes, or its model is gone); pass the model and the profile as planner.cost")
    if example_args is not None or example_kwargs is not None:
        raise ValueError("example_args / example_kwargs: a profile brings the inputs it was traced with; leave "
                         "them out")
    if not (isinstance(options.cost, str) and options.cost == "measured"):
        raise ValueError(f"planner.cost={options.cost!r}: a profile brings its costs; leave cost out")
    return model, traced.example_args, traced.example_kwargs, replace(options, cost=profile)


def plan_partition(
    model: torch.nn.Module, n_gpus: int, example_args: Any = None, example_kwargs: Mapping[str, Any] | None = None,
    *, loss_fn: Any = None, example_target: Any = None, schedule: str = "1F1B",
    n_microbatches: int | str | None = None, data_parallel: int | str | DataParallelOptions = 1,
    global_batch: int | None = None, stages_per_rank: int | None = None, objective: str = "step", memory: Any = None,
    devices: Any = None, optimizer: Any = "adam", cost: Any = "measured", profiling: ProfileOptions | None = None,
    recompute: str | bool = "auto", target: str | None = None, mixed_precision: str | None = None,
    compile: bool | dict[str, Any] = False,
) -> Plan:
    """``partition`` with the planner's options as keywords (what pp x dp planning calls per layout)."""
    # ---- validate everything before any work
    n_gpus = check_int("n_gpus", n_gpus)
    # Before anything sized by it (one Device per rank, torch's schedule orders); whether the
    # model has split points for this many is known only after tracing, below.
    check_at_most("n_gpus", n_gpus, MAX_STAGES, f"ranks (MAX_STAGES={MAX_STAGES})")
    replicas = DataParallelOptions.of(data_parallel)
    if replicas.mesh is not None:
        raise ValueError("data_parallel=DataParallelOptions(mesh=...) is for a Pipeline, which runs on the mesh; "
                         "partition() plans for n_gpus ranks: give degree= (and mode=) instead")
    runtime_only = [f"{name}=True" for name in ("loss_parallel", "sequence_parallel") if getattr(replicas, name)]
    if (replicas.tensor_parallel or 1) > 1 or runtime_only:
        given = f"tensor_parallel={replicas.tensor_parallel}" if replicas.tensor_parallel else runtime_only[0]
        raise ValueError(f"data_parallel=DataParallelOptions({given}) is for a "
                         "Pipeline; partition() plans pipeline x data parallel layouts, and `autopipe layout` plans "
                         "tensor-parallel ones")
    degree, dp_mode = 1 if replicas.degree is None else replicas.degree, replicas.mode or "fsdp"
    if not (degree == 1 and type(degree) is int) or isinstance(devices, Topology):
        # Every (pp, dp) factorization of n_gpus, each pipeline planned by this function (data_parallel.py).
        return plan_data_parallel(
            plan_partition, model, n_gpus, example_args, example_kwargs, data_parallel=degree, dp_mode=dp_mode,
            global_batch=global_batch, n_microbatches=n_microbatches, devices=devices, optimizer=optimizer,
            schedule=schedule, stages_per_rank=stages_per_rank, objective=objective, memory=memory, loss_fn=loss_fn,
            example_target=example_target, cost=cost, profiling=profiling, recompute=recompute, target=target,
            mixed_precision=mixed_precision, compile=compile)
    source, costs, scaling = _cost_inputs(cost)
    wanted = _resolve_options(n_gpus, schedule, n_microbatches, global_batch, stages_per_rank, costs, scaling)
    opt_name, opt_factor = optimizer_state_factor(optimizer)
    rank_devices = resolve_devices(n_gpus, devices, memory)
    if loss_fn is not None and loss_fn is not False and not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} must be callable as loss_fn(output, target), None (assume the "
                        "model's usual loss) or False (no loss)")
    if (loss_fn is None or loss_fn is False) != (example_target is None):
        raise ValueError("give loss_fn and example_target together (the loss is measured on one micro-batch's "
                         f"target), got loss_fn={'set' if callable(loss_fn) else loss_fn}, "
                         f"example_target={'set' if example_target is not None else None}")
    if profiling is None:
        profiling = ProfileOptions()
    elif not isinstance(profiling, ProfileOptions):
        raise TypeError(f"profiling={profiling!r} must be an autopipe.ProfileOptions "
                        "(e.g. ProfileOptions(warmup=0, repeats=1)) or None")
    dev = resolve_device(profiling.device)
    measure = dict(device=dev, warmup=profiling.warmup, repeats=profiling.repeats, progress=profiling.progress,
                   flush_cache=profiling.flush_cache, fit_to_whole=profiling.fit_to_whole)
    if not source.measured and any(d.flops is not None for d in rank_devices):
        rank_devices = _speeds_from_flops(rank_devices)
        measure["device_flops"] = rank_devices[0].flops  # counted seconds at the first device's rate
    if on_meta_device(model):
        # Shapes and no weights (a model built under torch.device("meta")). Measured costs time
        # one segment at a time, copied to the profiling device with stand-in values; counted
        # ones are counted on the meta device, FLOPs at the profiling device's rate.
        if wanted.auto_microbatches:
            raise ValueError("n_microbatches='auto' profiles the whole model at several batch sizes, which a "
                             "model on the meta device cannot run; give n_microbatches as a number")
        if not source.measured:
            measure["device"] = torch.device("meta")
            measure.setdefault("device_flops", counting_flops(dev))

    # ---- trace, profile, cost graph (one per micro-batch count)
    host_memory = PeakResidentMemory().start()  # what planning needs of the host, for the plan to say
    given = getattr(costs, "traced", None)  # a profile brings the trace it was measured on
    reuse = given is not None and traced_from(given, model, example_args, example_kwargs)
    traced = given if reuse else trace(model, example_args, example_kwargs)
    fine = traced  # at torch's split points, where profiles are taken
    if target is not None:  # cut only where the framework can
        traced = restrict_to_target(traced, model, target)
        if costs is not None and len(costs) == fine.num_segments != traced.num_segments:
            costs = coarsened(costs, fine, traced)  # a profile at torch's split points, summed per unit
        elif costs is not None and len(costs) != traced.num_segments:
            raise ValueError(f"planner.target={target!r} plans {traced.num_segments} segments (or {fine.num_segments} "
                             f"at torch's split points), but the profile given as cost= has {len(costs)}")
    # The stage count against the legal split points as soon as tracing knows them, before
    # torch's schedule orders (whose cost grows with ranks x micro-batches) or any profiling.
    if n_gpus * (wanted.stages_per_rank or 1) > traced.num_segments:
        raise _too_many_stages(n_gpus, n_gpus * (wanted.stages_per_rank or 1), traced)
    wanted = _buildable(wanted, n_gpus, global_batch)
    pairs_for = {
        mm: auto_schedule_options(n_gpus, mm, traced.num_segments) if wanted.auto_schedule
        else [(wanted.schedule, wanted.stages_per_rank)]
        for mm in wanted.n_microbatches
    }
    needed = min((n_gpus * v for pairs in pairs_for.values() for _, v in pairs), default=n_gpus)
    if not any(pairs_for.values()) or needed > traced.num_segments:
        raise _too_many_stages(n_gpus, needed, traced)
    # Measured in the precision the model will train in: under autocast, as the stages will run.
    with mixed_precision_context(mixed_precision, torch.device(measure["device"])):
        if wanted.auto_microbatches and scaling is None:
            scaling = profile_scaling(model, example_args, example_kwargs,
                                      sizes=_scaling_sizes(global_batch, wanted.n_microbatches),
                                      cost=source, traced=fine, **measure)
        if not wanted.auto_microbatches and costs is None:
            costs = profile_segments(traced, cost=source, **measure)
        # The loss given, or the one a model of this kind trains with (default_loss), or a note saying there is none.
        loss, loss_note = charged_loss(model, traced, loss_fn, example_target, device=measure["device"],
                                       warmup=profiling.warmup,
                                       repeats=profiling.repeats, cost_source=source,
                                       profile_given=not isinstance(cost, str))
    # Under autocast the tensors crossing a cut are as wide as autocast makes them.
    dtypes = autocast_dtypes(traced, mixed_precision, torch.device(measure["device"])) if mixed_precision else None
    graphs = _cost_graphs(traced, wanted.n_microbatches, global_batch, costs=costs,
                          scaling=scaling if wanted.auto_microbatches else None, loss=loss, fine=fine, dtypes=dtypes)

    # ---- search: the best split for each (micro-batches, schedule) option, then the fastest that fits;
    # the default link is measured on this host where assuming it would decide the split (link_choice)
    mode, why = link_mode(profiling.measure_link, device_type=dev.type, cost_source=source,
                          devices=rank_devices, in_process_group=dist.is_available() and dist.is_initialized())

    def search(link: tuple[float, float]) -> tuple[tuple[list[ScheduleOption], ScheduleOption, float], str]:
        found = _search_options(link, graphs=graphs, pairs_for=pairs_for, traced=traced, n_gpus=n_gpus,
                                rank_devices=rank_devices, opt_factor=opt_factor, objective=objective,
                                device_type=dev.type, several=wanted.several,
                                allow_recompute=recompute is not False, measured=source.measured)
        o = found[1]  # the split as the note names it: split points, schedule, micro-batches
        names = [traced.candidates[c - 1].name for c in o.result.cuts]
        return found, (f"{names} ({o.schedule}" + (f" x{o.stages_per_rank}" if o.stages_per_rank > 1 else "")
                       + f", {o.n_microbatches} micro-batches)")

    link_choice, (options, chosen, planner_s) = choose_link(search, assumed=default_link(dev.type), mode=mode,
                                                            device_type=dev.type, why=why)
    limits = None
    if any(math.isfinite(d.memory_bytes) for d in rank_devices):
        limits = [int(d.memory_bytes) if math.isfinite(d.memory_bytes) else -1 for d in rank_devices]
    plan = make_plan(
        traced, graphs[chosen.n_microbatches], chosen,
        optimizer=opt_name, optimizer_factor=opt_factor, rank_devices=rank_devices,
        cost_source=source.name, objective=objective, device=str(dev), planner_s=planner_s,
        memory_limit_bytes=limits, alternatives=options if wanted.several else (),
        allow_recompute=recompute is not False,
    )
    if traced.notes:  # what autopipe changed to capture the model (a Hugging Face KV cache turned off)
        plan.notes = list(traced.notes)
    if link_choice.source == "measured" or mode == "auto":  # a default that was put to the test: say how it went
        plan.notes = [*plan.notes, link_choice.note()]
    if loss_note:  # a loss assumed, or none costed: never silently
        plan.notes = [*plan.notes, loss_note]
    torch_order = graphs[chosen.n_microbatches].torch_stage_order(plan.split_points)
    if torch_order != sorted(torch_order):
        plan.notes = [*plan.notes, torch_order_note(torch_order)]
    plan.loss = loss
    plan.whole_pass = getattr(costs, "whole", None)  # what the whole graph took beside the segments
    if plan.whole_pass is not None and plan.whole_pass.round_spread > NOISY_PROFILE_SPREAD:
        plan.notes = [*plan.notes, noisy_profile_note(plan.whole_pass.round_spread)]
    close = close_call_note(plan)
    if close:
        plan.notes = [*plan.notes, close]
    plan.global_batch = global_batch
    plan.mixed_precision = mixed_precision or ""
    if compile is not False:  # True or torch.compile's arguments: what the profile cannot know: compiled stages run faster than the eager segments it timed
        plan.notes = [*plan.notes, "the stages will be compiled (torch.compile) but the segments were timed eager: "
                      "time the compiled stages in running steps and fold them in with "
                      "plan.calibrate(pipe.measure_stage_times(x, target=y))"]
    plan.microbatch_rows = example_batch_size(example_args, example_kwargs)
    plan.input_shapes = [list(t.shape) for t in tree_leaves((tuple(example_args or ()), dict(example_kwargs or {})))
                         if isinstance(t, torch.Tensor)]
    plan.target = target or ""
    if wanted.auto_microbatches and scaling is not None:
        plan.scaling_fit_error = {k: max(v) if v else 0.0 for k, v in scaling.fit_error.items()}
    plan.planning_peak_rss_bytes = host_memory.stop()
    return plan


#: Above this spread between a profile's rounds ((slowest - fastest) / median of the rounds'
#: summed segment times) the plan says its profile is noisy. On a quiet host the rounds of a
#: small model's profile differ by a few percent.
NOISY_PROFILE_SPREAD = 0.25


def torch_order_note(order: list[int]) -> str:
    """The plan's note for a split whose stages torch's own ``pipeline()`` would call out of order.

    Example:
        >>> torch_order_note([1, 0, 2])[:50]
        "torch's own pipeline() would call this split's sta"
    """
    return (f"torch's own pipeline() would call this split's stages in the order {order}, and its stages would "
            "then compute another function (a stage that needs nothing from the one before it runs first); "
            "autopipe.Pipeline and autopipe.runtime.split_model build them in order")


def noisy_profile_note(spread: float) -> str:
    """The plan's note for a profile whose rounds disagreed by ``spread``.

    Example:
        >>> noisy_profile_note(0.4)[:40]
        'the profile is noisy: its slowest and fa'
    """
    return (f"the profile is noisy: its slowest and fastest rounds differ by {spread:.0%} of the median round "
            f"(over {NOISY_PROFILE_SPREAD:.0%}; other work on this host?), so another run may choose another "
            "split; plan on a quiet host, or measure the best splits' real steps with autopipe.tune")


def _speeds_from_flops(rank_devices: Sequence[Device]) -> list[Device]:
    """The devices with their relative speeds set from their FLOP rates (counted costs)."""
    missing = [i for i, d in enumerate(rank_devices) if d.flops is None]
    if missing:
        raise ValueError(f"devices {missing} give no flops while others do; give every device its FLOP rate "
                         "(Device(flops=...) or Device.preset(...)) or none")
    both = [i for i, d in enumerate(rank_devices) if d.speed != 1.0]
    if both:
        raise ValueError(f"devices {both} give both speed and flops; with counted costs the speed follows "
                         "from the flops, give one of them")
    ref = rank_devices[0].flops
    return [replace(d, speed=d.flops / ref) for d in rank_devices]


def _search_options(
    link: tuple[float, float], *, graphs: Mapping[int, CostGraph], pairs_for: Mapping[int, list[tuple[str, int]]],
    traced: TracedModel, n_gpus: int, rank_devices: Sequence[Device], opt_factor: float, objective: str,
    device_type: str, several: bool, allow_recompute: bool = True, measured: bool = True,
) -> tuple[list[ScheduleOption], ScheduleOption, float]:
    """Every option costed with ``link`` as the default link, the fastest that fits, and the seconds taken."""
    t0 = time.perf_counter()
    options = []
    for mm, graph in graphs.items():
        for sched, v in pairs_for[mm]:
            option = ScheduleOption(schedule=sched, stages_per_rank=v, n_microbatches=mm)
            try:
                cost_option(option, traced=traced, cost_graph=graph, n_gpus=n_gpus, rank_devices=rank_devices,
                            optimizer_factor=opt_factor, link_default=link, objective=objective,
                            overhead_default=default_action_overhead_s(device_type),
                            lazy_sends=sends_are_lazy(device_type), copy_bandwidth=default_copy_bandwidth(device_type),
                            allow_recompute=allow_recompute,
                            inside_block_margin=INSIDE_BLOCK_MARGIN if measured else 0.0)
            except InfeasibleMemoryError as e:
                if not several:
                    raise
                option.reason = str(e).split(";")[0]
            options.append(option)
    planner_s = time.perf_counter() - t0
    usable = [o for o in options if o.result is not None and o.fits]
    if not usable:
        # Every option fails memory: say what the most frugal one would need, and whether
        # recomputing activations was among what was tried.
        tried = ("with activation recomputation considered for every stage" if allow_recompute else
                 "keeping every activation (recompute=False; recompute='auto' lets stages recompute)")
        raise InfeasibleMemoryError(
            f"no schedule considered fits the memory given, {tried}: "
            + "; ".join(f"{o.schedule} x{o.stages_per_rank} needs "
                        f"{_fmt_rank_peak(o)}" for o in options)
        )
    return options, min(usable, key=lambda o: (o.predicted_step_s, max(o.rank_peak_bytes))), planner_s


@dataclass
class _Wanted:
    """The schedule and micro-batch options a call to ``partition`` asks to compare."""

    schedule: str | None  # None with schedule="auto"
    stages_per_rank: int | None
    n_microbatches: list[int]  # candidate micro-batch counts (one unless "auto")
    auto_schedule: bool
    auto_microbatches: bool

    @property
    def several(self) -> bool:
        return self.auto_schedule or self.auto_microbatches


def _cost_inputs(cost: Any) -> tuple[CostSource, Sequence[SegmentCost] | None, ScaledProfile | None]:
    """``partition``'s ``cost`` as (the cost source, a given profile, a given size-scaled profile)."""
    if isinstance(cost, (str, CostSource)):
        try:
            return cost_source(cost), None, None
        except ValueError:
            raise ValueError(f"cost={cost!r} is not a cost source; use one of {list(COST_SOURCES)}, a list of "
                             "SegmentCost (a profile to reuse) or a ScaledProfile") from None
    if isinstance(cost, ScaledProfile):
        return cost_source(cost.cost), None, cost
    if isinstance(cost, Sequence) and all(isinstance(c, SegmentCost) for c in cost):
        return MEASURED, cost, None  # a profile given is charged as this host's: its loss timed, its link may decide
    raise TypeError(f"cost={cost!r} must be one of {list(COST_SOURCES)}, a list of one SegmentCost per segment "
                    "(from profile_segments or profile_in_ranks) or a ScaledProfile (from profile_scaling)")


def _resolve_options(
    n_gpus: int, schedule: Any, n_microbatches: Any, global_batch: int | None,
    stages_per_rank: Any, costs: Sequence[SegmentCost] | None, scaling: ScaledProfile | None,
) -> _Wanted:
    """Validate the schedule / micro-batch arguments together and list what to compare."""
    auto_sched = isinstance(schedule, str) and schedule.strip().lower() == "auto"
    auto_m = isinstance(n_microbatches, str) and n_microbatches.strip().lower() == "auto"
    if global_batch is not None:
        global_batch = check_int("global_batch", global_batch)
    if auto_m:
        if global_batch is None:
            raise ValueError("n_microbatches='auto' needs global_batch= (samples per step) to choose micro-batch sizes")
        if costs is not None:
            raise ValueError("cost= was given one micro-batch size's segment costs; with n_microbatches='auto' "
                             "give a ScaledProfile (autopipe.profile_scaling) or a cost source such as 'measured'")
        m_options = [d for d in range(1, min(global_batch, 64) + 1) if global_batch % d == 0]
    else:
        if n_microbatches is None:
            m = 2 * n_gpus  # bounded with the stage count, once tracing has checked it (_buildable)
        else:
            m = check_int("n_microbatches", n_microbatches)
            check_at_most("n_microbatches", m, sim.MAX_SCHEDULE_SIZE,
                          f"micro-batches (MAX_SCHEDULE_SIZE={sim.MAX_SCHEDULE_SIZE} stage x micro-batch pairs)")
        if global_batch is not None and global_batch % m:
            # Only counts a step can hold are worth listing (and the search stays short).
            divisors = [d for d in range(1, min(global_batch, sim.MAX_SCHEDULE_SIZE) + 1) if global_batch % d == 0]
            raise ValueError(f"n_microbatches={m} does not divide global_batch={global_batch}; use one of {divisors}")
        m_options = [m]
        if scaling is not None:
            raise ValueError("cost= was given a ScaledProfile, which is for n_microbatches='auto'; with a fixed "
                             f"count (here {m}) give its costs at the micro-batch size b: cost=scaled.costs_at(b)")
    if auto_sched:
        if stages_per_rank is not None:
            raise ValueError(f"stages_per_rank={stages_per_rank!r} cannot be fixed with schedule='auto'; leave it None")
        return _Wanted(None, None, m_options, True, auto_m)
    try:
        schedule = sim.canonical_schedule_name(schedule)
    except ValueError as e:  # the planner also takes "auto": say so beside torch's names
        raise ValueError(f"{e}, or 'auto' to compare them all") from None
    if stages_per_rank is None:
        stages_per_rank = sim.default_stages_per_rank(schedule)
    stages_per_rank = check_int("stages_per_rank", stages_per_rank)
    check_at_most("stages_per_rank", stages_per_rank, MAX_STAGES // n_gpus,
                  f"on n_gpus={n_gpus} (MAX_STAGES={MAX_STAGES} stages in all)")
    runnable = []
    for m_try in m_options:
        try:
            # torch's counting rules alone: its order is built once tracing has bounded the stages.
            sim.validate_schedule(schedule, n_gpus, m_try, stages_per_rank, check_order=False)
            runnable.append(m_try)
        except ValueError:
            if not auto_m:
                raise  # a fixed count the schedule cannot run: torch's reason, unchanged
    if not runnable:
        raise ValueError(f"schedule {schedule!r} on {n_gpus} ranks cannot run any micro-batch count dividing "
                         f"global_batch={global_batch}: tried {m_options}")
    return _Wanted(schedule, stages_per_rank, runnable, False, auto_m)


def _buildable(wanted: _Wanted, n_gpus: int, global_batch: int | None) -> _Wanted:
    """``wanted`` without the micro-batch counts torch cannot order or a step cannot hold."""
    runnable = []
    for m in wanted.n_microbatches:
        try:
            if wanted.auto_schedule:
                sim.check_schedule_size(n_gpus, m)
            else:
                sim.validate_schedule(wanted.schedule, n_gpus, m, wanted.stages_per_rank)
            runnable.append(m)
        except ValueError:
            if not wanted.auto_microbatches:
                raise  # a fixed count: the reason, unchanged
    if not runnable:
        raise ValueError(f"schedule {wanted.schedule or 'auto'!r} on {n_gpus} ranks cannot run any micro-batch count "
                         f"dividing global_batch={global_batch}: tried {wanted.n_microbatches}")
    return replace(wanted, n_microbatches=runnable)


def _too_many_stages(n_gpus: int, needed: int, traced: TracedModel) -> ValueError:
    excluded = ""
    if traced.excluded_cuts:
        names = ", ".join(f"{name} ({why})" for name, why in list(traced.excluded_cuts.items())[:5])
        excluded = f"; {len(traced.excluded_cuts)} more are not offered: {names}"
        if any("data-dependent" in why for why in traced.excluded_cuts.values()):
            excluded += (". A tensor whose size depends on the data cannot be received by a pipeline stage: keep "
                         "such tensors inside one module (reduce them to a fixed size, e.g. pad or pool, before the "
                         "next block)")
    return ValueError(
        f"n_gpus={n_gpus} needs at least {needed} stages, but {traced.model_name} has only "
        f"{len(traced.candidates)} legal split points ({traced.num_segments} segments){excluded}; use at most "
        f"{traced.num_segments} stages"
    )


def _with_loss(costs: Sequence[SegmentCost], loss: LossCost | None, scale: float = 1.0) -> list[SegmentCost]:
    """``costs`` with the loss (scaled to the micro-batch size) charged to the last segment."""
    costs = list(costs)
    if loss is not None and costs:
        last = costs[-1]
        freed = max(0, int(loss.act_bytes * scale) - int(last.out_bytes))
        costs[-1] = replace(last, fwd_s=last.fwd_s + loss.fwd_s * scale, bwd_s=last.bwd_s + loss.bwd_s * scale,
                            act_bytes=last.act_bytes + int(loss.act_bytes * scale),
                            # The loss's backward runs first, then the segment's, with its own output's
                            # gradient (already in the segment's working set): the larger one counts. By
                            # the segment's, the loss has freed what it saved beside the output it was handed.
                            bwd_peak_bytes=max(last.bwd_peak_bytes - freed, int(loss.bwd_peak_bytes * scale)),
                            bwd_input_peak_bytes=max(last.bwd_input_peak_bytes - freed,
                                                     int(loss.bwd_peak_bytes * scale)))
    return costs


def _cost_graphs(
    traced: TracedModel, m_options: Sequence[int], global_batch: int | None, *,
    costs: Sequence[SegmentCost] | None, scaling: ScaledProfile | None, loss: LossCost | None = None,
    fine: TracedModel | None = None, dtypes: dict[str, torch.dtype] | None = None,
) -> dict[int, CostGraph]:
    """One cost graph per micro-batch count: from ``costs`` (one size) or from the size fits.

    A size-scaled profile of ``fine`` (the trace at torch's split points, where ``traced``
    keeps a framework's) is summed into ``traced``'s segments and cuts.
    """
    if scaling is None:
        assert costs is not None
        if len(costs) != traced.num_segments:
            raise ValueError(
                f"costs has {len(costs)} entries but {traced.model_name} traces to {traced.num_segments} "
                "segments; pass the profile of this model with these example inputs"
            )
        return {m_options[0]: build_cost_graph(traced, _with_loss(costs, loss), dtypes)}
    names = scaling.segment_names
    summed = fine is not None and fine is not traced and names == [sg.name for sg in fine.segments]
    if names != [sg.name for sg in traced.segments] and not summed:
        raise ValueError("scaling= was profiled on a different model or inputs: its segments do not match")
    fine_index = {sg.start: k for k, sg in enumerate(fine.segments)} if summed else {}
    cuts = [fine_index[sg.start] for sg in traced.segments] + [len(names)] if summed else None
    graphs = {}
    for mm in m_options:
        b = global_batch // mm
        at_b = coarsened(scaling.costs_at(b), fine, traced) if summed else scaling.costs_at(b)
        # The loss is element-wise over the micro-batch: it scales with its size.
        graph = build_cost_graph(traced, _with_loss(at_b, loss, b / loss.batch if loss else 1.0))
        graph.cut_fwd_bytes, graph.cut_bwd_bytes = ([x[k] for k in cuts] if cuts else list(x)
                                                    for x in scaling.cut_bytes_at(b))
        graphs[mm] = graph
    return graphs


def _scaling_sizes(global_batch: int, m_options: Sequence[int]) -> list[int]:
    """Micro-batch sizes to profile for fitting: the smallest, a middle and the largest used."""
    sizes = sorted({global_batch // mm for mm in m_options})
    picks = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})
    if len(picks) < 2:  # one size only (global_batch == 1): fit needs two points
        picks = sorted({picks[0], picks[0] + 1})
    return picks


def _fmt_rank_peak(option: ScheduleOption) -> str:
    """What ``option`` would need, for the message of an :class:`InfeasibleMemoryError`."""
    if option.rank_peak_bytes:

        return format_bytes(max(option.rank_peak_bytes), round_up=True) + " on its fullest device"
    return option.reason or "more memory"
