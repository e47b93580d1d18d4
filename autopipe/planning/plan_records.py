"""The typed parts of a :class:`~autopipe.planning.plan.Plan`: its stages, baselines and records.

Example:
    >>> from autopipe.planning.plan_records import Link, MachineModel
    >>> machine = MachineModel(links=[Link(bandwidth=2e9, latency_s=1e-4)], action_overhead_s=[7e-4, 7e-4])
    >>> machine.links[0].bandwidth
    2000000000.0
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .costgraph import SegmentCost

@dataclass
class StagePlan:
    """One pipeline stage of a plan: which modules it holds and what it is predicted to cost.

    Times are per micro-batch, in seconds; bytes are per device (``param_bytes``,
    ``peak_bytes``) or per micro-batch (``act_bytes``, ``send_bytes``, ``recv_bytes``).
    """

    index: int  # stage number, 0 = first
    fqns: list[str]  # top-most module names whose code runs entirely in this stage
    first_segment: int  # first segment (cost-graph node) of the stage
    last_segment: int  # last segment, inclusive
    fwd_s: float  # forward compute per micro-batch
    bwd_s: float  # backward compute per micro-batch
    comm_s: float  # time to send and receive this stage's boundary tensors, both directions
    param_bytes: int  # parameters (and buffers) held by the stage
    act_bytes: int  # activations saved for backward, per micro-batch in flight
    peak_bytes: int  # predicted peak memory: params, grads, optimizer state, activations in flight
    send_bytes: int  # bytes sent to the next stage per micro-batch, forward
    recv_bytes: int  # bytes received from the previous stage per micro-batch, forward
    inflight_microbatches: int = 1  # micro-batches whose activations are held at the peak
    device: str = ""  # name of the device the stage is planned for (heterogeneous plans)
    peak_bytes_kept: int = 0  # predicted peak keeping its activations (0: not recorded)
    peak_bytes_recomputed: int = 0  # predicted peak recomputing them in the backward (0: not recorded)

    @property
    def time_s(self) -> float:
        """Forward + backward + communication per micro-batch: the stage's pipeline period."""
        return self.fwd_s + self.bwd_s + self.comm_s


@dataclass
class BaselinePlan:
    """A split users could pick by hand or with another tool, costed by the same model."""

    name: str  # "deepspeed_parameters", "torchgpipe_time", ... (autopipe.planning.baselines.BASELINES)
    description: str  # one line: where the method comes from
    split_points: list[str]  # its split points (module names), in order
    bottleneck_s: float  # its heaviest stage under the same cost model
    predicted_step_s: float  # its predicted step time under the same schedule
    peak_bytes: int  # its heaviest stage's predicted memory
    fits_memory: bool = True
    reason: str = ""  # "not applicable: ..." when the tool's rule gives no split here (split_points empty)


@dataclass(frozen=True)
class PlanSegment:
    """One segment of the profile a plan was made from (per micro-batch), and the cut before it.

    Example:
        >>> seg = PlanSegment(fwd_s=1e-3, bwd_s=2e-3, param_bytes=64, act_bytes=32, out_bytes=16, name="layers.0")
        >>> seg.cost().time_s
        0.003
    """

    fwd_s: float
    bwd_s: float
    param_bytes: int
    act_bytes: int
    out_bytes: int
    name: str = ""  # the split point the segment starts at
    modules: list[str] = field(default_factory=list)  # modules whose code runs in it
    flops: float = 0.0
    trainable_param_bytes: int = 0
    accum_s: float = 0.0  # gradient accumulation per micro-batch after the first
    cut_fwd_bytes: int = 0
    cut_bwd_bytes: int = 0
    # Tensors crossing that cut each way (costgraph.CostGraph.cut_fwd_messages); each pays the latency.
    cut_fwd_messages: int = 1
    cut_bwd_messages: int = 1
    bwd_peak_bytes: int = 0  # its backward's working set beyond act_bytes (SegmentCost.bwd_peak_bytes)
    bwd_input_peak_bytes: int = 0  # the same for the input gradients alone

    def cost(self) -> SegmentCost:
        """The segment's cost as the profile gave it (for ``PlannerOptions(cost=...)``)."""
        return SegmentCost(fwd_s=self.fwd_s, bwd_s=self.bwd_s, param_bytes=self.param_bytes,
                           act_bytes=self.act_bytes, out_bytes=self.out_bytes, flops=self.flops,
                           trainable_param_bytes=self.trainable_param_bytes, accum_s=self.accum_s,
                           bwd_peak_bytes=self.bwd_peak_bytes, bwd_input_peak_bytes=self.bwd_input_peak_bytes)


@dataclass(frozen=True)
class Link:
    """The link between two neighbouring stages: bytes per second and seconds per message."""

    bandwidth: float  # bytes/s, > 0
    latency_s: float  # >= 0


@dataclass(frozen=True)
class MachineModel:
    """What the planner assumed of the machine beyond the profile."""

    links: list[Link] = field(default_factory=list)  # one per cut, cut c between stages c and c + 1
    action_overhead_s: list[float] = field(default_factory=list)  # per stage, beyond compute, per action
    lazy_sends: bool = False  # the backend delivers a send when its sender next calls in (gloo)


@dataclass(frozen=True)
class SearchRecord:
    """How the split was found, and the best step any split could reach under the schedule."""

    candidates: int = 1  # splits whose step was simulated
    iterations: int = 0  # bisection steps of the exact min-max search (0: not recorded)
    step_lower_bound_s: float = 0.0  # no split beats this step (autopipe.planning.costmodel.step_lower_bound_s)
    step_gap: float = 0.0  # 1 - step_lower_bound_s / predicted_step_s: mostly pipeline fill


@dataclass(frozen=True)
class ScheduleAlternative:
    """One (schedule, stages per rank, micro-batches) option the planner costed with its best split."""

    schedule: str
    stages_per_rank: int
    n_microbatches: int
    predicted_step_s: float | None  # None: no split of it could be costed
    peak_bytes: int | None  # on its fullest device
    fits: bool
    split_points_count: int | None = None
    note: str = ""  # why it was not usable, when it was not


@dataclass(frozen=True)
class Calibration:
    """Per stage, the factors measured / planned that :meth:`Plan.calibrate` applied."""

    fwd_factor: list[float | None]
    bwd_factor: list[float | None]


@dataclass(frozen=True)
class TuningRecord:
    """What :func:`autopipe.tune` measured: real steps of several splits on the ranks, the fastest kept."""

    split_points: list[list[str]]
    predicted_step_s: list[float]
    measured_step_s: list[float]  # each split's median step
    rounds: int
    chosen: int
    # Each split's step over the chosen one's, the median of their rounds' ratios (1.0 for itself).
    vs_chosen: list[float] = field(default_factory=list)
    # Each split's step in each timed round, the slowest rank's: what chosen and vs_chosen come from.
    round_steps_s: list[list[float]] = field(default_factory=list)


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
