"""Option groups that ``partition`` and ``Pipeline`` share: build one, pass it to both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .._checks import check_bool, check_choice, check_int
from ..machine.device import Device, parse_bytes
from ..machine.precision import MIXED_PRECISIONS

if TYPE_CHECKING:
    import torch

    from .cost_sources import CostSource
    from .costgraph import SegmentCost
    from .scaling import ScaledProfile

#: What each rank is given under pipeline x data parallel (``DataParallelOptions.batch``).
DP_BATCHES = ("replica", "global")

#: How a block can be checkpointed (:data:`autopipe.layouts.blocks.RECOMPUTE_MODES` adds ``"none"``);
#: as ``PlannerOptions.recompute``, a Pipeline checkpoints each block so rather than whole stages.
BLOCK_RECOMPUTE = ("selective", "full")
#: Accepted values of ``PlannerOptions.objective``.
OBJECTIVES = ("step", "bottleneck")
#: The frameworks a plan can be made for (``PlannerOptions(target=...)``, :mod:`autopipe.planning.frameworks`).
TARGETS = ("torchtitan", "megatron", "deepspeed")
#: The cost sources' names (:data:`autopipe.planning.cost_sources.COST_SOURCES`), where torch is not imported.
COST_SOURCE_NAMES = ("measured", "flops", "params")


@dataclass(frozen=True)
class ProfileOptions:
    """How :func:`~autopipe.planning.planner.partition` measures the model's segments.

    Args:
        device: Where to run the profile (``"cuda"``, ``"cpu"``, ``"cuda:1"``, a
            ``torch.device``); None = CUDA when present, else the CPU. Its type also picks
            the planner's defaults for the link, the cost per action and the copy bandwidth,
            so with a profile given as ``cost=`` name the device it was measured on.
        warmup: Untimed runs of each segment before timing (>= 0).
        repeats: Timed runs of each segment; their mean is kept (>= 1;
            :func:`autopipe.machine.timing.per_run_s`).
        flush_cache: Empty the device's caches before each pass of the profile, as a
            pipeline action finds them (:func:`autopipe.planning.profile.profile_segments`);
            ``False`` keeps them warm, for hosts whose last-level cache holds a whole stage.
        fit_to_whole: Scale the segments' times so that they add up to the whole graph
            timed beside them (:class:`autopipe.machine.passes.WholePass`); None = on
            CUDA only, where segments timed one by one add up to more than the model.
        progress: Show progress on stderr while tracing and profiling.
        measure_link: Which link the planner charges between ranks whose ``Device`` gives no
            ``bandwidth`` or ``latency_s``. None (default): planning measures nothing by
            itself; where the link can decide the split (the split with the assumed default
            differs from the split with free communication,
            :mod:`autopipe.planning.link_choice`), the profile is measured on the CPU and no
            process group runs, a link measured before on this host (``autopipe measure``,
            kept per host) is charged, else the assumed default; ``plan.notes`` says which, and
            how to measure. ``AUTOPIPE_MEASURE_LINK=0`` keeps the default. True: measure now
            when this host has no measurement (two spawned processes, a few seconds; also on
            CUDA, between GPUs 0 and 1; under ``Pipeline``, rank 0 measures while the others
            wait). False: always the assumed default.
        in_ranks: When a :class:`~autopipe.Pipeline` plans: True has every rank profile the
            model at once (:func:`autopipe.planning.profile_in_ranks`) and rank 0 plan from
            the mean of their profiles; False has rank 0 profile alone while the others wait.
            None (default): in the ranks when there are several and the planner brings no
            costs of its own (no ``devices``, ``cost="measured"``). Ranks sharing a host
            compete for memory bandwidth and caches, which a profile taken alone does not see.

    Raises:
        ValueError: a field out of range (the message names it and says what is accepted).

    Example::

        autopipe.partition(model, 4, (x,), planner=PlannerOptions(profiling=ProfileOptions(repeats=1)))
    """

    device: str | torch.device | None = None
    warmup: int = 2
    repeats: int = 5
    flush_cache: bool = True
    fit_to_whole: bool | None = None
    progress: bool = True
    measure_link: bool | None = None
    in_ranks: bool | None = None

    def __post_init__(self) -> None:
        # Checked here so that a bad value fails where it is written, not once profiling starts.
        check_int("ProfileOptions warmup", self.warmup, 0)
        check_int("ProfileOptions repeats", self.repeats, 1)
        check_bool("ProfileOptions flush_cache", self.flush_cache)
        check_bool("ProfileOptions fit_to_whole", self.fit_to_whole, allow_none=True)
        check_bool("ProfileOptions progress", self.progress)
        check_bool("ProfileOptions measure_link", self.measure_link, allow_none=True)
        check_bool("ProfileOptions in_ranks", self.in_ranks, allow_none=True)
        if not (self.device is None or isinstance(self.device, str) or type(self.device).__name__ == "device"):
            raise ValueError(f"ProfileOptions device={self.device!r} must be None, a string such as 'cuda:0' "
                             "or a torch.device")


@dataclass(frozen=True)
class DataParallelOptions:
    """Pipeline × data parallelism: every stage replicated over data-parallel ranks.

    ``partition(..., data_parallel=)`` and ``Pipeline(..., data_parallel=)`` take it, or a
    replica count alone (``data_parallel=2`` is ``DataParallelOptions(degree=2)``).

    Attributes:
        degree: replicas of each stage, >= 1; ``"auto"`` (planning only) compares every
            ``pp × dp`` factorization of the ranks. None: the plan's (a Pipeline), else 1.
        mode: how the replicas reduce: ``"fsdp"`` (FSDP2 shards each stage's parameters,
            gradients and optimizer state over its replicas), ``"replicate"`` (whole copies,
            gradients all-reduced) or ``"auto"`` (planning only: both compared). None: the
            plan's (a Pipeline), else ``"fsdp"``.
        mesh: a 2-D ``DeviceMesh`` with dimensions ``"dp"`` and ``"pp"`` to run on (a
            Pipeline only), in place of the ``(degree, world / degree)`` mesh built from
            ``degree`` (consecutive ranks form a pipeline); give one of the two. With tensor
            parallelism, a 3-D one with ``"pp"``, ``"dp"`` and ``"tp"``, ``tp`` last.
        tensor_parallel: ranks that shard each stage (a Pipeline only): its matrices, paired
            column- and row-wise by the export's graph analysis, sharded with torch's
            tensor-parallel API over the ``tp`` dimension of a ``(pp, dp, tp)`` mesh, each
            group on one node (:mod:`autopipe.runtime.tensor_parallel`). None: the mesh's, else 1.
        loss_parallel: with tensor parallelism, shard the output layer along the vocabulary too
            (a Pipeline only): ``loss_fn`` receives the logits as a DTensor sharded along their
            last dimension and runs under torch's ``loss_parallel()``, so ``cross_entropy``
            never gathers them. The layout planner charges every tp > 1 layout so. False: the
            output layer stays whole on every rank of the group.
        sequence_parallel: with tensor parallelism, run what lies between a block's row matrix and
            the next column one (residual adds, norms, dropout) on sequence shards, Megatron-LM's
            sequence parallelism (a Pipeline only): rows reduce-scatter, columns all-gather, the
            stage boundaries stay whole.
        batch: what each rank's ``step``/``evaluate`` is given (a Pipeline only):
            ``"replica"`` (default, DDP's convention) its replica's own rows, ``n_microbatches``
            micro-batches, e.g. from a ``DistributedSampler(dataset,
            num_replicas=pipe.dp_size, rank=pipe.dp_rank)``; or ``"global"``: the whole global
            batch on every rank, each replica taking its contiguous ``1 / degree`` of the rows.

    Example::

        plan = autopipe.partition(model, 8, (x,), planner=PlannerOptions(global_batch=64),
                                  data_parallel=DataParallelOptions(degree="auto", mode="auto"))
        pipe = autopipe.Pipeline(model, example_args=(x,), loss_fn=loss, plan=plan)   # follows the plan
    """

    degree: int | str | None = None
    mode: str | None = None
    mesh: Any = None
    batch: str = "replica"
    tensor_parallel: int | None = None
    loss_parallel: bool = False
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        check_choice("DataParallelOptions batch", self.batch, DP_BATCHES)
        for name in ("loss_parallel", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DataParallelOptions {name} must be True or False, got {getattr(self, name)!r}")
        if self.tensor_parallel is not None:
            check_int("DataParallelOptions tensor_parallel", self.tensor_parallel)

    @classmethod
    def of(cls, value: Any) -> DataParallelOptions:
        """``value`` as options: None (nothing asked), a replica count or ``"auto"``, or the options themselves.

        Raises:
            TypeError: anything else, naming what is accepted.

        Example:
            >>> DataParallelOptions.of(2)
            DataParallelOptions(degree=2, mode=None, mesh=None, batch='replica', tensor_parallel=None, loss_parallel=False, sequence_parallel=False)
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return cls(degree=value)
        raise TypeError(f"data_parallel={value!r} must be a replica count, 'auto' or an "
                        "autopipe.DataParallelOptions(degree=, mode=, mesh=, batch=)")


@dataclass(frozen=True)
class PlannerOptions:
    """The planner's settings, built once and given to both ``partition`` and ``Pipeline``.

    ``partition(..., planner=opts)`` plans with them; ``Pipeline(..., planner=opts)`` plans
    with the same when it is given no plan and no split points, and also reads
    ``stages_per_rank`` and ``recompute`` for a hand split.

    Args:
        devices: The hardware: one :class:`~autopipe.machine.device.Device` for every rank, or
            a list of one per rank. A Device carries its speed, memory, the link to the next
            rank (``bandwidth``, ``latency_s``) and ``action_overhead_s``, what each pipeline
            action costs beyond its compute (measure yours with
            :func:`autopipe.runtime.measure_action_overhead`). With data parallelism, a
            :class:`~autopipe.machine.topology.Topology` (GPUs per node, the links inside and
            between nodes). Default: this machine's kind of device, memory unlimited.
        memory: Memory per device in bytes or as "16GiB"; one value or one per rank. It fills
            in each Device that does not set its own.
        cost: Where the segment costs come from: ``"measured"`` (default; timed on
            ``profiling.device``), ``"flops"`` or ``"params"`` (estimated), or a
            :class:`~autopipe.planning.CostSource` object; or a profile to
            reuse, which skips measuring (the same costs always give the same plan): a list of
            :class:`~autopipe.planning.SegmentCost` (from
            :func:`~autopipe.planning.profile_segments` or
            :func:`~autopipe.planning.profile_in_ranks`), or, with ``n_microbatches="auto"``, a
            :class:`~autopipe.planning.ScaledProfile` (from :func:`autopipe.profile_scaling`).
        profiling: How to measure: a :class:`ProfileOptions`; None = its defaults. With a
            profile given as ``cost``, its device still picks the defaults for the link and
            the cost per action.
        objective: ``"step"`` (default): the split whose simulated step is fastest among
            bottleneck-optimal and near-optimal splits; ``"bottleneck"``: the exact min-max
            split alone (fastest to compute).
        optimizer: Optimizer whose state counts toward memory (``"adam"``, ``"sgd"``, ..., a
            ``torch.optim`` class, or state bytes per parameter byte).
        global_batch: Samples per optimizer step. Needed for ``n_microbatches="auto"`` and for
            data parallelism; with a fixed ``n_microbatches`` it must be divisible by it.
        stages_per_rank: Stages per rank (default: 1 for GPipe and 1F1B, 2 for the looped
            schedules: :func:`~autopipe.planning.schedule_spec`); the plan has
            ``n_gpus * stages_per_rank`` stages.
        recompute: Activation checkpointing. ``"auto"`` (default): when memory binds, the
            planner may have some stages recompute their activations in the backward and
            picks the fastest split that fits (``plan.recompute_stages``, which a Pipeline
            follows); ``False``: no stage recomputes. A Pipeline also takes ``True`` (every
            stage) or a list of stage indices, to checkpoint by hand, or per block of the
            model's block lists (``layers.0``, ...), as ``autopipe layout`` plans: ``"full"``
            (each keeps its input) or ``"selective"`` (torchtitan's op-level policy).
        mixed_precision: ``"bf16"`` or ``"fp16"``: the model trains under ``torch.autocast``
            in that dtype, its weights, gradients and optimizer state in float32. The planner
            profiles the segments under autocast; a Pipeline runs every step, evaluation and
            forward under it, its stage boundaries carry the dtypes autocast produces (a
            bfloat16 activation crosses a cut in bfloat16), and in pp x dp with ``"fsdp"``
            FSDP2 gathers parameters in that dtype and reduces gradients in float32
            (``MixedPrecisionPolicy``). None (default): the model's own precision.
        compile: ``torch.compile`` a Pipeline's stage modules: True (torch's defaults,
            inductor), or a dict of ``torch.compile`` keyword arguments (``{"backend":
            "aot_eager"}``, ``{"mode": "max-autotune"}``). Each stage module is compiled in
            place before the first step; the planner still costs eager segments: fold in the
            compiled stages' times with ``pipe.plan.calibrate(pipe.measure_stage_times(...))``.
            False (default): eager.
        target: A framework whose stages the plan is for, one of :data:`TARGETS`: the
            planner cuts only where that framework can (``"torchtitan"``: before a child of
            the model or an entry of its layer container, ``layers.3``; ``"megatron"``: between
            whole decoder layers, the embedding before the first, the loss after the last;
            ``"deepspeed"``: between the entries of an ``nn.Sequential``, the layer list a
            ``PipelineModule`` takes) and the plan exports the split in its words
            (``plan.to_torchtitan()``, ``plan.to_megatron()``, ``plan.to_deepspeed()``). None:
            wherever torch's ``pipeline()`` can.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong kind, named.

    Example::

        opts = PlannerOptions(memory="16GiB", cost="flops")
        plan = autopipe.partition(model, 4, (x,), planner=opts)
        pipe = autopipe.Pipeline(model, example_args=(x,), loss_fn=loss, planner=opts)
    """

    devices: Any = None
    memory: int | str | Sequence[int | str] | None = None
    cost: str | CostSource | Sequence[SegmentCost] | ScaledProfile = "measured"
    profiling: ProfileOptions | None = None
    objective: str = "step"
    optimizer: str | type | float = "adam"
    global_batch: int | None = None
    stages_per_rank: int | None = None
    recompute: str | bool | Sequence[int] = "auto"
    target: str | None = None
    mixed_precision: str | None = None
    compile: bool | dict[str, Any] = False

    def __post_init__(self) -> None:
        if self.profiling is not None and not isinstance(self.profiling, ProfileOptions):
            raise TypeError(f"PlannerOptions profiling={self.profiling!r} must be an autopipe.ProfileOptions "
                            "or None")
        check_choice("PlannerOptions objective", self.objective, OBJECTIVES)
        if self.target is not None:
            check_choice("PlannerOptions target", self.target, TARGETS)
        if self.mixed_precision is not None:
            check_choice("PlannerOptions mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        if not isinstance(self.compile, (bool, dict)):
            raise TypeError(f"PlannerOptions compile={self.compile!r} must be True, False or a dict of "
                            "torch.compile keyword arguments (e.g. {'backend': 'aot_eager'})")
        for name in ("global_batch", "stages_per_rank"):
            if getattr(self, name) is not None:
                check_int(f"PlannerOptions {name}", getattr(self, name), not_int=TypeError)
        r = self.recompute
        if not (isinstance(r, bool) or (isinstance(r, str) and r in ("auto", *BLOCK_RECOMPUTE))
                or (isinstance(r, Sequence) and not isinstance(r, (str, bytes)))):
            raise ValueError(f"PlannerOptions recompute={r!r} is not an option; use 'auto' (the planner decides), "
                             "False (never), or, for a Pipeline, True (every stage), a list of stage indices, "
                             f"or per block one of {list(BLOCK_RECOMPUTE)}")

    @classmethod
    def of(cls, value: Any) -> PlannerOptions:
        """``value`` as options: None (the defaults) or the options themselves; anything else is a TypeError."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"planner={value!r} must be an autopipe.PlannerOptions (devices, memory, cost, profiling, "
                        "objective, optimizer, global_batch, stages_per_rank, recompute, target, "
                        "mixed_precision, compile) or None")


def resolve_devices(n_gpus: int, devices: Device | Sequence[Device] | None,
                    memory: int | str | Sequence[int | str] | None) -> list[Device]:
    """One :class:`~autopipe.machine.device.Device` per pipeline rank."""
    if devices is None:
        ranks = [Device() for _ in range(n_gpus)]
    elif isinstance(devices, Device):
        ranks = [replace(devices) for _ in range(n_gpus)]
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        ranks = list(devices)
        if len(ranks) != n_gpus:
            raise ValueError(f"devices has {len(ranks)} entries but n_gpus={n_gpus}; give one Device per rank "
                             "or a single Device for all of them")
        for i, d in enumerate(ranks):
            if not isinstance(d, Device):
                raise TypeError(f"devices[{i}]={d!r} is not an autopipe.Device")
    else:
        raise TypeError(f"devices={devices!r} must be an autopipe.Device (the same for every rank) "
                        "or a list of one Device per rank")
    if memory is None:
        return ranks
    if any(d.memory is not None for d in ranks):
        raise ValueError("give memory either per device (Device(memory=...)) or as memory=, not both")
    if isinstance(memory, (list, tuple)):
        if len(memory) != n_gpus:
            raise ValueError(f"memory has {len(memory)} entries but n_gpus={n_gpus}; give one per rank or a "
                             "single value")
        mems = [parse_bytes(m, name=f"memory[{i}]") for i, m in enumerate(memory)]
    else:
        mems = [parse_bytes(memory, name="memory")] * n_gpus
    return [replace(d, memory=m) for d, m in zip(ranks, mems)]
