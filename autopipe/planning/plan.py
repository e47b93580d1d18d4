"""The Plan: where to cut the model, what each stage is predicted to cost, and why.

Example:
    >>> from autopipe.planning.plan import Plan, StagePlan
    >>> stage = StagePlan(index=0, fqns=["layers.0"], first_segment=0, last_segment=0,
    ...                   fwd_s=1e-3, bwd_s=2e-3, comm_s=0.0, param_bytes=4, act_bytes=8,
    ...                   peak_bytes=24, send_bytes=0, recv_bytes=0)
    >>> plan = Plan(num_stages=1, split_points=[], stages=[stage], schedule="1F1B",
    ...             n_microbatches=1, bottleneck_s=3e-3, predicted_step_s=3e-3,
    ...             lower_bound_s=3e-3)
    >>> plan.split_spec
    {}
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torch.distributed.pipelining import SplitPoint

from .._checks import check_int
from ..machine.device import default_link
from . import costmodel
from .costgraph import SegmentCost
from .costmodel import StepTail
from .frameworks import deepspeed_parts, megatron_layout, torchtitan_config, torchtitan_toml
from .plan_file import PLAN_FORMAT_VERSION, check_model_names, plan_from_data, read_plan_file
from .plan_records import DataParallelRecord
from .plan_records import (BaselinePlan, Calibration, Link, MachineModel, PlanSegment, ScheduleAlternative,
                           SearchRecord, StagePlan, TuningRecord)
from ..machine.passes import WholePass
from .profile import LossCost
from .schedules import stage_ranks

if TYPE_CHECKING:
    import torch

@dataclass
class Plan:
    """Where to cut a model into pipeline stages, with the predictions behind the choice.

    Use ``plan.split_spec`` for ``torch.distributed.pipelining.pipeline(..., split_spec=)``,
    or hand the plan to :class:`autopipe.Pipeline`.
    """

    num_stages: int
    split_points: list[str]  # module names cut at their BEGINNING, in pipeline order
    stages: list[StagePlan]
    schedule: str
    n_microbatches: int
    bottleneck_s: float  # the heaviest stage's time per micro-batch
    predicted_step_s: float  # predicted time of one optimizer step (all micro-batches)
    lower_bound_s: float  # max(total compute / p, heaviest segment): no split can beat it
    baselines: list[BaselinePlan] = field(default_factory=list)
    cost_source: str = "measured"  # "measured", "flops" or "params"
    objective: str = "bottleneck"  # what the partitioner minimised
    device: str = "cpu"  # device the costs were measured on
    stages_per_rank: int = 1
    memory_limit_bytes: list[int] | None = None  # per device, when given
    optimizer: str = "adam"
    planner_s: float = 0.0  # time the exact search took
    planning_peak_rss_bytes: int | None = None  # the planning process's peak resident memory (machine.host_memory)
    model_name: str = ""
    target: str = ""  # the framework whose granularity the split points keep ("torchtitan"), or "" (torch's)
    segment_names: list[str] = field(default_factory=list)  # one per cost-graph segment
    segments: list[PlanSegment] = field(default_factory=list)  # the profile the plan was made from
    machine: MachineModel = field(default_factory=MachineModel)  # links, per-action overhead, lazy sends
    step_tail: StepTail = field(default_factory=StepTail)  # once-per-step work beside the actions
    recompute_stages: list[int] = field(default_factory=list)  # stages recomputing their activations in backward
    rank_peak_bytes: list[int] = field(default_factory=list)  # per rank, predicted peak memory
    search: SearchRecord | None = None  # how the split was found (None: not searched)
    alternatives: list[ScheduleAlternative] = field(default_factory=list)  # with schedule/n_microbatches "auto"
    notes: list[str] = field(default_factory=list)  # what autopipe changed or assumed to make the plan
    loss: LossCost | None = None  # the loss charged to the last stage: given, or assumed for a language model
    whole_pass: WholePass | None = None  # the whole graph timed beside the segments
    global_batch: int | None = None  # samples per optimizer step, when given
    microbatch_rows: int | None = None  # the traced example's batch size: one micro-batch, when it has one
    input_shapes: list[list[int]] = field(default_factory=list)  # each tensor input's shape in one micro-batch
    mixed_precision: str = ""  # "bf16" or "fp16" when planned for autocast in that dtype
    scaling_fit_error: dict[str, float] = field(default_factory=dict)  # quantity -> worst relative fit error
    calibration: Calibration | None = None  # set by calibrate()
    tuning: TuningRecord | None = None  # set by autopipe.tune: the real steps measured
    dp_degree: int = 1  # data-parallel replicas of the whole pipeline (pp x dp ranks in all)
    dp_mode: str = ""  # how the replicas reduce gradients: "fsdp" or "replicate" ("" with dp_degree 1)
    data_parallel: DataParallelRecord | None = None  # the factorizations compared (partition(data_parallel=...))

    # ------------------------------------------------------------------ derived
    @property
    def split_spec(self) -> dict[str, SplitPoint]:
        """The ``split_spec`` for ``torch.distributed.pipelining.pipeline``.

        Example:
            >>> from torch.distributed.pipelining import pipeline  # doctest: +SKIP
            >>> pipe = pipeline(model, (x_mb,), split_spec=plan.split_spec)  # doctest: +SKIP
        """
        return {name: SplitPoint.BEGINNING for name in self.split_points}

    @property
    def balance(self) -> float:
        """lower_bound_s / bottleneck_s: 1.0 means no split could have a lighter heaviest stage."""
        return self.lower_bound_s / self.bottleneck_s if self.bottleneck_s > 0 else 1.0

    @property
    def bubble_fraction(self) -> float:
        """Share of the step a device idles, from the predicted step and the stage times."""
        if self.predicted_step_s <= 0:
            return 0.0
        busy = max(s.time_s for s in self.stages) * self.n_microbatches
        return max(0.0, 1.0 - busy / self.predicted_step_s)

    @property
    def stage_ranks(self) -> list[int]:
        """The rank that runs each stage under the plan's schedule (stage ``s`` -> ``stage_ranks[s]``)."""
        return stage_ranks(self.schedule, self.num_stages // self.stages_per_rank, self.stages_per_rank)

    @property
    def pp_degree(self) -> int:
        """Pipeline ranks per replica (``num_stages // stages_per_rank``); ``pp_degree * dp_degree`` ranks in all."""
        return self.num_stages // self.stages_per_rank

    @property
    def microbatch_size(self) -> int | None:
        """Samples per micro-batch: the global batch split over replicas and micro-batches, else the example's rows."""
        if self.global_batch:
            return self.global_batch // (self.dp_degree * self.n_microbatches)
        return self.microbatch_rows

    def baseline(self, name: str) -> BaselinePlan:
        """The baseline called ``name``; raises KeyError listing those present."""
        for b in self.baselines:
            if b.name == name:
                return b
        raise KeyError(f"no baseline {name!r}; this plan has {[b.name for b in self.baselines]}")

    # ------------------------------------------------------------------ the cost model, on this plan
    def segment_costs(self) -> list[SegmentCost]:
        """The per-segment costs this plan was made from (for ``PlannerOptions(cost=...)``).

        Lets a plan be re-made for another schedule, memory or device count, or after
        :meth:`calibrate`, without measuring again.

        Raises:
            ValueError: the plan carries no profile (made from split points alone).
        """
        if not self.segments:
            raise ValueError("this plan carries no per-segment costs (it was made from split points alone); "
                             "make one with autopipe.partition")
        return [seg.cost() for seg in self.segments]

    def action_overhead_s(self) -> list[float]:
        """Seconds each action of each stage costs beyond its compute, as the planner charged it.

        From ``machine.action_overhead_s``; zeros when the plan records none.

        Example:
            >>> len(plan.action_overhead_s()) == plan.num_stages  # doctest: +SKIP
            True
        """
        values = self.machine.action_overhead_s
        return [float(x) for x in values] if len(values) == self.num_stages else [0.0] * self.num_stages

    def simulation_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`autopipe.simulate` that describe how this plan runs.

        Its schedule, micro-batches, stages per rank, per-action overhead and whether its
        backend's sends are lazy (``machine.lazy_sends``); the stage and cut times are the caller's.

        Example:
            >>> autopipe.simulate(fwd, bwd, comm_s=plan.cut_comm_s(), **plan.simulation_options())  # doctest: +SKIP
        """
        return {"schedule": self.schedule, "n_microbatches": self.n_microbatches,
                "stages_per_rank": self.stages_per_rank, "action_overhead_s": self.action_overhead_s(),
                "lazy_sends": bool(self.machine.lazy_sends)}

    def step_tail_s(self) -> float:
        """Seconds of the once-per-step work around the schedule's actions, as the planner charged it.

        ``step_tail.total_s``: merging the last stage's outputs, the loss broadcast, summing
        tied gradients across ranks (:class:`~autopipe.planning.costmodel.StepTail`).
        ``predicted_step_s`` = the simulated schedule + this.

        Example:
            >>> plan.step_tail_s() <= plan.predicted_step_s  # doctest: +SKIP
            True
        """
        return self.step_tail.total_s

    def links(self) -> list[Link]:
        """The link of each cut, as recorded, or the defaults of the plan's device type.

        Example:
            >>> [link.bandwidth for link in plan.links()]  # doctest: +SKIP
            [2000000000.0]
        """
        if len(self.machine.links) == self.num_stages - 1:
            return list(self.machine.links)
        bandwidth, latency = default_link(str(self.device).split(":")[0])
        return [Link(bandwidth, latency)] * (self.num_stages - 1)

    def cut_comm_s(self, split_points: Sequence[str] | None = None) -> list[float]:
        """One-way seconds of each cut (:func:`autopipe.planning.costmodel.cut_time_s`).

        Forward bytes are what each stage sends; backward bytes come from the profile
        (``segments[k].cut_bwd_bytes``), or equal the forward ones for a plan without it.

        Args:
            split_points: another split of the plan's segments (needs the profile); None =
                the plan's own.

        Example:
            >>> len(plan.cut_comm_s()) == plan.num_stages - 1  # doctest: +SKIP
            True
        """
        links = self.links()
        if split_points is None:
            firsts = [st.first_segment for st in self.stages[1:]]
            fwd = [st.send_bytes for st in self.stages[:-1]]
        else:
            firsts = self.segment_cuts(split_points)
            fwd = [self.segments[k].cut_fwd_bytes for k in firsts]
        bwd = [self.segments[k].cut_bwd_bytes if k < len(self.segments) else f for k, f in zip(firsts, fwd)]
        messages = [max(self.segments[k].cut_fwd_messages, self.segments[k].cut_bwd_messages)
                    if k < len(self.segments) else 1 for k in firsts]
        return costmodel.cut_times_s(fwd, bwd, [lk.bandwidth for lk in links], [lk.latency_s for lk in links],
                                     messages)

    def segment_cuts(self, split_points: Sequence[str]) -> list[int]:
        """The segment indices where stages 1 .. p-1 begin for ``split_points`` (names of the plan's segments).

        Raises:
            ValueError: the plan has no profile, a name is not one of its segments, or
                there are not ``num_stages - 1`` of them.

        Example:
            >>> plan.segment_cuts(plan.split_points) == [st.first_segment for st in plan.stages[1:]]  # doctest: +SKIP
            True
        """
        if not self.segments:
            raise ValueError("plan has no per-segment profile (plan.segments); re-plan with autopipe.partition")
        names = [s.name for s in self.segments]
        unknown = [p for p in split_points if p not in names]
        if unknown or len(split_points) != self.num_stages - 1:
            raise ValueError(
                f"split_points={list(split_points)!r} must be {self.num_stages - 1} of the plan's segment names "
                f"({', '.join(names[1:6])}, ...); unknown: {unknown}"
            )
        return sorted(names.index(p) for p in split_points)

    def simulated_step_s(self, compute_factor: float = 1.0) -> float:
        """The plan's step re-predicted from its stage times, each stage's compute scaled by ``compute_factor``.

        :func:`autopipe.planning.costmodel.predicted_step_s` on the stages, the cuts
        (:meth:`cut_comm_s`), the plan's simulation options and its step tail: with factor
        1 it is ``predicted_step_s``, as the planner computed it.

        Example:
            >>> plan.simulated_step_s() == pytest.approx(plan.predicted_step_s)  # doctest: +SKIP
            True
        """
        return costmodel.predicted_step_s(
            [st.fwd_s * compute_factor for st in self.stages], [st.bwd_s * compute_factor for st in self.stages],
            self.cut_comm_s(), **self.simulation_options(), tail=self.step_tail)

    @property
    def sequence_length(self) -> int | None:
        """The length the plan was made for: dimension 1 of its first input with two or more (None without)."""
        return next((shape[1] for shape in self.input_shapes if len(shape) >= 2), None)

    def predict_at(self, length: int) -> float:
        """The predicted step for micro-batches of sequence ``length`` instead of :attr:`sequence_length`.

        Every stage's compute and the bytes crossing every cut are scaled by the ratio of the
        lengths (the tokens per micro-batch), and the step simulated again under the plan's
        schedule; the optimizer step and the other once-per-step work stay. Exact for work
        per token (linear layers, norms, the loss); attention's share that grows with the
        square of the length is under-counted at longer lengths, and per-call overheads
        over-counted at shorter ones. For a split made at that length, plan with an example
        of it.

        Args:
            length: the sequence length, a positive integer.

        Returns:
            The predicted seconds per step.

        Raises:
            ValueError: ``length`` is not a positive integer, or the plan records no input
                with a sequence dimension (a plan file written before it recorded them).

        Example:
            >>> plan.predict_at(2 * plan.sequence_length) > plan.predicted_step_s  # doctest: +SKIP
            True
        """
        check_int("length", length, what="the sequence length to predict a step at")
        if self.sequence_length is None:
            raise ValueError(f"predict_at(length={length}): the plan records no input with a sequence dimension "
                             f"(input_shapes={self.input_shapes}); plan with an example of that length instead")
        factor = length / self.sequence_length
        scaled = copy.deepcopy(self)
        for st in scaled.stages:
            st.fwd_s, st.bwd_s = st.fwd_s * factor, st.bwd_s * factor
            st.send_bytes, st.recv_bytes = round(st.send_bytes * factor), round(st.recv_bytes * factor)
        scaled.segments = [replace(seg, cut_fwd_bytes=round(seg.cut_fwd_bytes * factor),
                                   cut_bwd_bytes=round(seg.cut_bwd_bytes * factor)) for seg in scaled.segments]
        return scaled.simulated_step_s()

    def split_step_s(self, split_points: Sequence[str]) -> float:
        """Predicted step of another split of the plan's profiled segments, under the plan's schedule.

        :func:`autopipe.planning.costmodel.predicted_step_s` on that split's stage times and
        cut times, with the plan's step tail (which holds for any split unless a tied
        weight's readers change ranks). Use it to compare a hand split with the plan.

        Raises:
            ValueError: as :meth:`segment_cuts`.

        Example:
            >>> plan.split_step_s(plan.baselines[0].split_points) >= plan.predicted_step_s  # doctest: +SKIP
            True
        """
        fwd, bwd = costmodel.stage_times_s(self.segments, self.segment_cuts(split_points), self.n_microbatches)
        return costmodel.predicted_step_s(fwd, bwd, self.cut_comm_s(split_points), **self.simulation_options(),
                                          tail=self.step_tail)

    def _compute_factor_for_step(self, step_s: float) -> float:
        """The factor on every stage's compute that makes the simulated step ``step_s``."""
        if self.predicted_step_s <= 0:
            return 1.0
        if not any(self.action_overhead_s()) and not any(self.cut_comm_s()) and not self.step_tail_s():
            return step_s / self.predicted_step_s  # the step is proportional to compute alone
        floor = self.simulated_step_s(0.0)
        if step_s <= floor:
            raise ValueError(
                f"measured step_s={step_s:.6g} s is no longer than the {floor:.6g} s the plan charges beyond compute "
                "(per-action overhead, communication, once-per-step work): no factor on the stages' compute reaches "
                "it; measure this machine's action_overhead_s (autopipe measure --overhead) and plan with it")
        from .simulator import solve_increasing

        return solve_increasing(self.simulated_step_s, step_s)  # the simulated step grows with the factor

    def calibrate(self, measured: "Sequence[float] | Mapping[str, Any]") -> "Plan":
        """A copy of the plan with measured stage times folded in.

        Args:
            measured: one of
                * a list of per-stage seconds per micro-batch (forward + backward), e.g. from
                  timing each stage alone;
                * ``{"fwd_s": [...], "bwd_s": [...]}`` per stage;
                * ``{"step_s": x}``: a measured step time; every cost is scaled by one factor.

        Returns:
            A new Plan whose stage times, segment costs (scaled by their stage's factor),
            bottleneck and simulated step time agree with the measurement;
            ``calibration`` keeps the factors (None for a stage direction the plan had no
            time for, e.g. a plan made from split points alone: it takes the measured time
            as it is). Pass ``plan.segment_costs()`` of the result to
            :func:`autopipe.partition` to re-plan with the corrected costs.

        Raises:
            ValueError: wrong number of stages, a non-positive time, or a ``step_s`` no longer
                than what the plan charges beyond compute.

        Example:
            >>> calibrated = plan.calibrate([0.012, 0.015])  # doctest: +SKIP
        """
        fwd, bwd = self._measured_stage_times(measured)
        new = copy.deepcopy(self)
        fwd_f, bwd_f = [], []
        segments = list(new.segments)
        for st, f, b in zip(new.stages, fwd, bwd):
            ff = f / st.fwd_s if st.fwd_s > 0 else None  # None: nothing planned to scale
            bf = b / st.bwd_s if st.bwd_s > 0 else None
            fwd_f.append(ff)
            bwd_f.append(bf)
            for k in range(st.first_segment, min(st.last_segment + 1, len(segments))):
                seg, first = segments[k], k == st.first_segment
                # Scale the profile's segments, or charge an unprofiled stage to its first one.
                # The stage's backward includes its segments' gradient accumulation
                # (costmodel.step_backward_s), so that scales with it; a stage charged its
                # measured time as it is has it inside that time already.
                segments[k] = replace(
                    seg, fwd_s=seg.fwd_s * ff if ff is not None else (f if first else 0.0),
                    bwd_s=seg.bwd_s * bf if bf is not None else (b if first else 0.0),
                    accum_s=seg.accum_s * bf if bf is not None else 0.0)
            st.fwd_s, st.bwd_s = f, b
        new.segments = segments
        new.bottleneck_s = max(st.time_s for st in new.stages)
        new.predicted_step_s = new.simulated_step_s()
        new.calibration = Calibration(fwd_factor=fwd_f, bwd_factor=bwd_f)
        return new

    def _measured_stage_times(self, measured: "Sequence[float] | Mapping[str, Any]") -> tuple[list[float], list[float]]:
        """Per stage, the measured forward and backward seconds :meth:`calibrate` was given, checked."""
        p = self.num_stages
        if isinstance(measured, Mapping) and "step_s" in measured:
            step = float(measured["step_s"])
            if not step > 0:
                raise ValueError(f"measured step_s={measured['step_s']!r} must be > 0 seconds")
            factor = self._compute_factor_for_step(step)
            return [st.fwd_s * factor for st in self.stages], [st.bwd_s * factor for st in self.stages]
        if isinstance(measured, Mapping):
            fwd, bwd = list(measured.get("fwd_s", [])), list(measured.get("bwd_s", []))
            if len(fwd) != p or len(bwd) != p:
                raise ValueError(f"measured fwd_s and bwd_s must each have {p} entries (one per stage)")
            # One direction of a tiny stage may time at 0 (the clock's resolution); the
            # stage as a whole may not.
            if any(not (math.isfinite(x) and x >= 0) for x in fwd + bwd) or any(
                    not (f + b > 0) for f, b in zip(fwd, bwd)):
                raise ValueError(f"measured fwd_s and bwd_s must be finite and >= 0, with each stage's sum "
                                 f"> 0 seconds; got fwd_s={fwd}, bwd_s={bwd}")
            return fwd, bwd
        values = [float(x) for x in measured]
        if len(values) != p:
            raise ValueError(f"measured has {len(values)} stage times but the plan has {p} stages")
        if any(not (x > 0) for x in values):
            raise ValueError(f"measured times must all be > 0 seconds, got {values}")
        # Split each total as the plan splits it; a stage the plan has no time for (a
        # plan made from split points alone) gets the usual backward = 2 x forward.
        shares = [st.fwd_s / (st.fwd_s + st.bwd_s) if st.fwd_s + st.bwd_s > 0 else 1 / 3 for st in self.stages]
        fwd = [x * sh for x, sh in zip(values, shares)]
        return fwd, [x - f for x, f in zip(values, fwd)]

    # ------------------------------------------------------------------ text
    def report(self) -> str:
        """A plain-text table of the stages, the predictions and the baselines.

        Every figure is traced back to the profile: times per micro-batch, bytes per device.
        """
        from ..reporting.text import plan_to_text  # local import: reporting depends on plan

        return plan_to_text(self)

    def to_torchtitan(self, as_toml: bool = False) -> dict[str, Any] | str:
        """The split as torchtitan's config: ``[parallelism]`` fields, for a plan made with ``target="torchtitan"``.

        Args:
            as_toml: return the ``[parallelism]`` section as TOML text to paste into the train
                config, the ``autopipe`` fields and the comparison with torchtitan's default
                split as comment lines below it.

        Returns:
            ``{"parallelism": {"pipeline_parallel_degree", "pipeline_parallel_schedule",
            "module_fqns_per_model_part", "pipeline_parallel_microbatch_size"}, "autopipe":
            {"layers_per_stage", "recompute_stages" (when some stages recompute)}}``, or that
            text.

        Raises:
            ValueError: the plan was made without ``PlannerOptions(target="torchtitan")``.

        Example:
            >>> plan = autopipe.partition(model, 2, (tokens,),
            ...                           planner=autopipe.PlannerOptions(target="torchtitan"))  # doctest: +SKIP
            >>> plan.to_torchtitan()["parallelism"]["module_fqns_per_model_part"]  # doctest: +SKIP
            [['tok_embeddings', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'output']]
            >>> print(plan.to_torchtitan(as_toml=True))  # doctest: +SKIP
            [parallelism]
            pipeline_parallel_degree = 2
            ...
        """
        return torchtitan_toml(self) if as_toml else torchtitan_config(self)

    def to_megatron(self) -> dict[str, Any]:
        """The split as Megatron-Core's arguments, for a plan made with ``target="megatron"``.

        Returns:
            ``{"pipeline_model_parallel_layout": "Ettt|tttL", "pipeline_model_parallel_size",
            "num_layers"}`` and, where they apply, ``virtual_pipeline_model_parallel_size`` and
            ``micro_batch_size`` (``--pipeline-model-parallel-layout`` etc. on the command line).

        Raises:
            ValueError: the plan was made without ``PlannerOptions(target="megatron")``, or its
                schedule places stages in a V.

        Example:
            >>> plan.to_megatron()["pipeline_model_parallel_layout"]  # doctest: +SKIP
            'Ettt|tttL'
        """
        return megatron_layout(self)

    def to_deepspeed(self, num_layers: int | None = None) -> dict[str, Any]:
        """DeepSpeed's ``parts`` boundaries, for a plan of ``nn.Sequential(*layers)`` made with ``target="deepspeed"``.

        Args:
            num_layers: ``len(layers)``; by default one past the last layer a stage runs.

        Returns:
            ``{"parts": [0, b1, ..., num_layers], "num_stages": p}``: stage ``s`` runs
            ``layers[parts[s]:parts[s + 1]]``. ``PipelineModule`` takes them by its
            ``_partition_layers`` hook (docs/frameworks.md shows the subclass).

        Raises:
            ValueError: the plan was made without ``PlannerOptions(target="deepspeed")``, or
                holds several stages per rank.

        Example:
            >>> plan.to_deepspeed()  # doctest: +SKIP
            {'parts': [0, 5, 8], 'num_stages': 2}
        """
        return deepspeed_parts(self, num_layers)

    def __str__(self) -> str:
        return (
            f"Plan({self.num_stages} stages, split at {self.split_points}, {self.schedule} "
            f"x{self.n_microbatches}, bottleneck {self.bottleneck_s * 1e3:.3f} ms/mb, "
            f"predicted step {self.predicted_step_s * 1e3:.2f} ms, balance {self.balance:.2f})"
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """Everything in the plan as JSON-ready data, with a format version."""
        data = asdict(self)
        data["format_version"] = PLAN_FORMAT_VERSION
        data["split_spec"] = {k: "BEGINNING" for k in self.split_points}  # for readers of the file
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`, every field checked before the plan is built.

        The checks are :meth:`load`'s, listed in :mod:`autopipe.planning.plan_file`; only the
        format version this autopipe writes is read (an older one is refused, saying to plan again).

        Raises:
            PlanFileError: the first field at fault (``.field``): a newer or unknown format
                version, a missing or unknown field, a wrong type, a value out of range, or
                fields that disagree.

        Example:
            >>> stage = StagePlan(0, [], 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0)
            >>> plan = Plan(num_stages=1, split_points=[], stages=[stage], schedule="GPipe", n_microbatches=2,
            ...             bottleneck_s=0.0, predicted_step_s=0.0, lower_bound_s=0.0)
            >>> Plan.from_dict(plan.to_dict()) == plan
            True
            >>> Plan.from_dict({**plan.to_dict(), "n_microbatches": 0})
            Traceback (most recent call last):
            ...
            autopipe.errors.PlanFileError: plan data: n_microbatches=0 must be an integer >= 1 and <= 262144
        """
        return plan_from_data(data, cls)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON (``Plan.load`` reads it back)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike, *, model: "torch.nn.Module | None" = None) -> "Plan":
        """Read a plan written by :meth:`save`, checking the whole file before using any of it.

        The file is read as JSON data only: nothing in it is run. Every field is checked
        (types, ranges, the counts agreeing with each other; :mod:`autopipe.planning.plan_file` has
        the list) and, with ``model``, the split points against the model's modules
        (:meth:`check_model`). A file of an older format version is refused: plan again to
        write the current one.

        Args:
            path: the plan file.
            model: the model the plan will split; None skips that check.

        Raises:
            PlanFileError: the file is malformed or does not fit ``model``; ``.field`` names
                the field at fault (``"n_microbatches"``, ``"stages[1].fwd_s"``).
            OSError: the file cannot be opened.

        Example:
            >>> plan = Plan.load("plan.json", model=model)  # doctest: +SKIP
        """
        plan = plan_from_data(read_plan_file(path), cls, path=os.fspath(path))
        if model is not None:
            plan.check_model(model)
        return plan

    def check_model(self, model: "torch.nn.Module") -> None:
        """Refuse this plan for ``model`` when a split point is not one of its modules.

        Raises:
            PlanFileError: ``field="split_points"``, naming the unknown split points.
            TypeError: ``model`` is not an ``nn.Module``.

        Example:
            >>> plan.check_model(model)  # doctest: +SKIP
        """
        check_model_names(self, model)
