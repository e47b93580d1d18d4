"""Planning: from a model to a :class:`~autopipe.planning.plan.Plan`, in the order the data flows.

1. **Trace.** :mod:`.tracing` exports the model (torch.export) and finds the candidate split
   points; :mod:`.hf_compat` makes Hugging Face models traceable as they come, and
   :mod:`.inplace` gives inputs a segment writes in place their own copy.
2. **Profile.** :mod:`.profile` measures each segment between split points (time, memory,
   the tensors crossing each cut) on graphs from :mod:`.segment_graphs`; :mod:`.scaling`
   fits those costs across micro-batch sizes (:mod:`.affine_fit`); :mod:`.rank_profile`
   profiles in every rank at once; :mod:`.default_loss` picks the loss the last stage is
   charged with when the caller names none.
3. **Cost graph.** :mod:`.costgraph` holds the segments' costs and the bytes crossing each
   cut; :mod:`.problem` turns them into the partitioner's numbers.
4. **Search.** :mod:`.partitioner` finds the split points that minimise the bottleneck
   stage; :mod:`.schedules` names torch's schedules and reads their action order,
   :mod:`.simulator` plays one out into a :mod:`.timeline`; :mod:`.costmodel` is the one
   place that turns stage numbers into times and bytes; :mod:`.schedule_options` costs
   each schedule and micro-batch count the planner compares; :mod:`.baselines` computes
   the splits other tools would pick, by those tools' rules in :mod:`.peers`.
5. **Plan.** :mod:`.planner` ties it together (:func:`~autopipe.planning.planner.partition`,
   with the option groups of :mod:`.options`); :mod:`.plan_assembly` builds the
   :mod:`.plan` (typed parts in :mod:`.plan_records`), whose file format and checks are
   :mod:`.plan_file`.
"""

from __future__ import annotations

from .._lazy import lazy_exports

# Public name -> the module that defines it, loaded on first use.
_PUBLIC = {
    "trace": "tracing",
    "TracedModel": "tracing",
    "profile_segments": "profile",
    "profile_in_ranks": "rank_profile",
    "profile_scaling": "scaling",
    "ScaledProfile": "scaling",
    "CostSource": "cost_sources",
    "SegmentCost": "costgraph",
    "CostGraph": "costgraph",
    "build_cost_graph": "costgraph",
    "stage_times_s": "costmodel",
    "PartitionProblem": "partitioner",
    "solve_bottleneck": "partitioner",
    "SCHEDULES": "schedules",
    "ScheduleSpec": "schedules",
    "schedule_spec": "schedules",
    "simulate": "simulator",
    "layer_units": "baselines",
    "partition": "planner",
    "PlannerOptions": "options",
    "ProfileOptions": "options",
    "DataParallelOptions": "options",
    "Plan": "plan",
    "StagePlan": "plan_records",
}

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
