"""The pipeline schedules autopipe runs: their names, torch's rules, stage placement, action order.

Example:
        >>> from autopipe.planning.schedules import action_order, stage_ranks
        >>> stage_ranks("ZBVZeroBubble", 2)
        [0, 1, 1, 0]
        >>> [str(a) for a in action_order("1F1B", n_ranks=2, n_microbatches=3)[1]]
        ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from unittest import mock

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.stage import PipelineStage

from .._checks import check_int

#: What a training step passes to torch's ``schedule.step``: no outputs returned, so the last
#: stage keeps none (``return_outputs``, torch 2.10 and later, pytorch/pytorch#165822). With an
#: older torch the last stage keeps every micro-batch's output and concatenates them at the
#: end of the step, and the planner charges that merge (:func:`training_merges_outputs`).
TRAINING_STEP_KWARGS: dict[str, Any] = (
    {"return_outputs": False}
    if "return_outputs" in inspect.signature(torch_schedules.PipelineScheduleSingle.step).parameters else {}
)


def training_merges_outputs() -> bool:
    """Whether a training step's last stage keeps and concatenates every micro-batch's output.

    Example:
        >>> training_merges_outputs() == ("return_outputs" not in TRAINING_STEP_KWARGS)
        True
    """
    return "return_outputs" not in TRAINING_STEP_KWARGS


#: Where a schedule puts a rank's stages: one stage per rank ("single", torch's
#: PipelineScheduleSingle), stage ``s`` on rank ``s % n_ranks`` ("looped"), or rank ``r``
#: holding stages ``r`` and ``2 * n_ranks - 1 - r`` ("v").
PLACEMENTS = ("single", "looped", "v")


@dataclass(frozen=True)
class ScheduleSpec:
    """What autopipe knows about one schedule: the one record every module reads.

    Attributes:
        name: the canonical spelling, torch's name without its ``Schedule`` prefix.
        torch_class: the class in ``torch.distributed.pipelining.schedules``.
        placement: one of :data:`PLACEMENTS`.
        split_backward: the backward is two actions, input-grad (I) and weight-grad (W).
            torch then detaches each stage's output in place, so autopipe's runtime sends a
            copy of it (``autopipe.runtime.compat.guard_stage_boundaries``), one more tensor
            per micro-batch.
        send_retention: when torch waits on a sent tensor (and so frees it): ``"next"``
            (1F1B: at its next send), ``"gpipe"`` (backward sends at the end of the step;
            forward sends after the last forward, before the backward that frees those
            outputs anyway, so they cost nothing extra) or ``"step"`` (every
            ``_PipelineScheduleRuntime``: at the end of the step). Read from torch's
            ``_step_microbatches`` of each class.
        default_stages_per_rank: stages per rank when none is given, in planning and at run
            time alike.
        auto_stages_per_rank: the stages per rank ``schedule="auto"`` compares.

    Example:
        >>> spec = schedule_spec("zbvzerobubble")
        >>> spec.name, spec.placement, spec.split_backward, spec.default_stages_per_rank
        ('ZBVZeroBubble', 'v', True, 2)
    """

    name: str
    torch_class: str
    placement: str
    split_backward: bool
    send_retention: str
    default_stages_per_rank: int
    auto_stages_per_rank: tuple[int, ...]


#: Every schedule autopipe can simulate and run, by canonical name, in torch's order of
#: appearance. An interleaved (looped) schedule with one stage per rank is 1F1B with a
#: deeper warm-up, so the looped ones default to 2 stages per rank.
SCHEDULE_SPECS: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("GPipe", "ScheduleGPipe", "single", False, "gpipe", 1, (1,)),
    ScheduleSpec("1F1B", "Schedule1F1B", "single", False, "next", 1, (1,)),
    ScheduleSpec("Interleaved1F1B", "ScheduleInterleaved1F1B", "looped", False, "step", 2, (2, 4)),
    ScheduleSpec("LoopedBFS", "ScheduleLoopedBFS", "looped", False, "step", 2, (2, 4)),
    ScheduleSpec("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", "looped", True, "step", 2, (2, 4)),
    ScheduleSpec("ZBVZeroBubble", "ScheduleZBVZeroBubble", "v", True, "step", 2, (2,)),
    ScheduleSpec("DualPipeV", "ScheduleDualPipeV", "v", True, "step", 2, (2,)),
)}

#: Canonical names of the schedules autopipe can simulate and run, in torch's spelling.
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_SPECS)

#: Most (stage, micro-batch) pairs one step may hold: ``n_ranks * stages_per_rank *
#: n_microbatches``. torch's order for a step, and the simulator's timeline of it, hold every
#: action of the step, so time and memory grow with the pairs: this bound keeps one
#: simulation to minutes and a few hundred MB on a small CPU host, while a count far past it
#: (10**7 micro-batches) would exhaust the host's memory.
MAX_SCHEDULE_SIZE = 2**18

# Action kinds, as in torch's _ComputationType: forward, full backward, input-grad, weight-grad.
FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
_KINDS = (FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


def schedule_spec(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of a schedule name (any case, ``Schedule`` prefix optional).

    Raises:
        TypeError / ValueError: as :func:`canonical_schedule_name`.

    Example:
        >>> schedule_spec("Schedule1F1B").send_retention
        'next'
    """
    return SCHEDULE_SPECS[canonical_schedule_name(name)]


class Action(NamedTuple):
    """One compute action of a schedule: run ``kind`` of ``stage`` on ``microbatch``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        # torch's own spelling ("2F0" = stage 2 forward of micro-batch 0), so orders compare by eye.
        return f"{self.stage}{self.kind}{self.microbatch}"


# ---------------------------------------------------------------------------------------
# Schedule names and torch's constraints
# ---------------------------------------------------------------------------------------


def canonical_schedule_name(name: str) -> str:
    """Map a schedule name, any case, with or without torch's "Schedule" prefix, to SCHEDULES.

    Example:
        >>> canonical_schedule_name("ScheduleZBVZeroBubble")
        'ZBVZeroBubble'
    """
    if not isinstance(name, str):
        raise TypeError(f"schedule must be a str, one of {list(SCHEDULES)}; got {name!r}")
    key = name.strip().lower()
    if key.startswith("schedule"):
        key = key[len("schedule"):]
    for canonical in SCHEDULES:
        if canonical.lower() == key:
            return canonical
    raise ValueError(
        f"schedule {name!r} is not known; valid schedules (any case, 'Schedule' prefix "
        f"optional): {list(SCHEDULES)}"
    )


def schedule_class(name: str) -> type:
    """torch's schedule class for a schedule name.

    Example:
        >>> schedule_class("gpipe").__name__
        'ScheduleGPipe'
    """
    return getattr(torch_schedules, schedule_spec(name).torch_class)


def default_stages_per_rank(schedule: str) -> int:
    """Stages per rank a schedule takes when none is given: 1 for GPipe and 1F1B, else 2.

    Example:
        >>> default_stages_per_rank("DualPipeV"), default_stages_per_rank("1F1B")
        (2, 1)
    """
    return schedule_spec(schedule).default_stages_per_rank


def validate_schedule(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None, *,
    check_order: bool = True,
) -> str:
    """Check that torch can run ``name`` on this many ranks, micro-batches and stages per rank.

    Example:
        >>> validate_schedule("schedule1f1b", 4, 8)
        '1F1B'
        >>> validate_schedule("1F1B", 4, 2)
        Traceback (most recent call last):
        ...
        ValueError: schedule '1F1B' needs n_microbatches >= n_ranks (4), got n_microbatches=2
    """
    schedule = canonical_schedule_name(name)
    check_count("n_ranks", n_ranks)
    check_count("n_microbatches", n_microbatches)
    if stages_per_rank is None:
        stages_per_rank = default_stages_per_rank(schedule)
    check_count("stages_per_rank", stages_per_rank)
    spec = SCHEDULE_SPECS[schedule]
    if spec.placement == "single" and stages_per_rank != 1:
        raise ValueError(
            f"schedule {schedule!r} runs exactly 1 stage per rank, got stages_per_rank="
            f"{stages_per_rank}; use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble "
            f"for more"
        )
    if spec.placement == "v" and stages_per_rank != 2:
        raise ValueError(
            f"schedule {schedule!r} places exactly 2 stages per rank in a V, got "
            f"stages_per_rank={stages_per_rank}"
        )
    if schedule == "1F1B" and n_microbatches < n_ranks:
        raise ValueError(
            f"schedule '1F1B' needs n_microbatches >= n_ranks ({n_ranks}), "
            f"got n_microbatches={n_microbatches}"
        )
    if schedule == "DualPipeV" and n_microbatches < 2 * n_ranks:
        raise ValueError(
            f"schedule 'DualPipeV' needs n_microbatches >= number of stages (2 * n_ranks = "
            f"{2 * n_ranks}), got n_microbatches={n_microbatches}"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        # torch runs micro-batches in rounds of n_microbatches // number_of_rounds.
        rounds = max(1, n_microbatches // n_ranks)
        if n_microbatches % rounds != 0:
            raise ValueError(
                f"schedule {schedule!r} needs n_microbatches to be a multiple of "
                f"max(1, n_microbatches // n_ranks) = {rounds}, got n_microbatches="
                f"{n_microbatches} with n_ranks={n_ranks}; a multiple of n_ranks always works"
            )
    if not check_order:
        return schedule
    check_schedule_size(n_ranks * stages_per_rank, n_microbatches)
    # torch may still produce an order that cannot run; building it (cached) finds out.
    action_order_and_source(schedule, n_ranks, n_microbatches, stages_per_rank)
    return schedule


def check_schedule_size(n_stages: int, n_microbatches: int) -> None:
    """Refuse a step of more than :data:`MAX_SCHEDULE_SIZE` (stage, micro-batch) pairs.

    Example:
        >>> check_schedule_size(4, 8)
        >>> check_schedule_size(4, 10**6)
        Traceback (most recent call last):
        ...
        ValueError: n_microbatches=1000000 on 4 stages makes 4000000 (stage, micro-batch) pairs per step; autopipe schedules at most MAX_SCHEDULE_SIZE=262144 pairs, i.e. n_microbatches <= 65536 on 4 stages
    """
    if n_stages * n_microbatches > MAX_SCHEDULE_SIZE:
        most = MAX_SCHEDULE_SIZE // n_stages
        raise ValueError(
            f"n_microbatches={n_microbatches} on {n_stages} stages makes {n_stages * n_microbatches} "
            f"(stage, micro-batch) pairs per step; autopipe schedules at most MAX_SCHEDULE_SIZE="
            f"{MAX_SCHEDULE_SIZE} pairs, i.e. "
            + (f"n_microbatches <= {most} on {n_stages} stages" if most else f"at most {MAX_SCHEDULE_SIZE} stages")
        )


def check_count(arg: str, value: Any) -> None:
    """Refuse a count (ranks, micro-batches, stages per rank) that is not an int >= 1.

    Example:
        >>> check_count("n_ranks", 0)
        Traceback (most recent call last):
        ...
        ValueError: n_ranks=0 must be an integer >= 1
    """
    check_int(arg, value, not_int=TypeError)


def stage_ranks(schedule: str, n_ranks: int, stages_per_rank: int | None = None) -> list[int]:
    """Which rank runs each stage under ``schedule``, as torch places them.

    Example:
        >>> stage_ranks("ZBVZeroBubble", 2)
        [0, 1, 1, 0]
    """
    schedule = canonical_schedule_name(schedule)
    check_count("n_ranks", n_ranks)
    if stages_per_rank is None:
        stages_per_rank = default_stages_per_rank(schedule)
    check_count("stages_per_rank", stages_per_rank)
    n_stages = n_ranks * stages_per_rank
    if SCHEDULE_SPECS[schedule].placement == "v":
        return [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages)]
    return [s % n_ranks for s in range(n_stages)]


# ---------------------------------------------------------------------------------------
# The action order, from torch
# ---------------------------------------------------------------------------------------


def action_order(
    schedule: str, *, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None
) -> list[list[Action]]:
    """The compute actions each rank runs, in order, as torch's schedule class orders them.

    Example:
        >>> [str(a) for a in action_order("1F1B", n_ranks=2, n_microbatches=3)[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    schedule = validate_schedule(schedule, n_ranks, n_microbatches, stages_per_rank)
    if stages_per_rank is None:
        stages_per_rank = default_stages_per_rank(schedule)
    order, _ = action_order_and_source(schedule, n_ranks, n_microbatches, stages_per_rank)
    return [list(rank_actions) for rank_actions in order]


@functools.lru_cache(maxsize=256)
def action_order_and_source(
    schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int
) -> tuple[tuple[tuple[Action, ...], ...], str]:
    """:func:`action_order` for a canonical name and explicit counts, with where it came from.

    Example:
        >>> order, source = action_order_and_source("GPipe", 2, 2, 1)
        >>> [str(a) for a in order[0]], source.rsplit(".", 2)[-2:]
        (['0F0', '0F1', '0B0', '0B1'], ['ScheduleGPipe', 'pipeline_order'])
    """
    ranks = stage_ranks(schedule, n_ranks, stages_per_rank)
    cls = schedule_class(schedule)
    source = f"torch.distributed.pipelining.schedules.{cls.__name__}.pipeline_order"
    try:
        order = _torch_pipeline_order(cls, n_ranks, n_microbatches, stages_per_rank)
    except ValueError as exc:  # torch's own constructor checks
        raise ValueError(
            f"torch refuses schedule {schedule!r} with n_ranks={n_ranks}, n_microbatches="
            f"{n_microbatches}, stages_per_rank={stages_per_rank}: {exc}"
        ) from exc
    problems = _order_problems(order, ranks, n_microbatches)
    if problems and schedule == "1F1B":
        # Schedule1F1B executes _step_microbatches, not its pipeline_order; on some torch
        # versions that IR is off by one on the last rank (it skips F0). Use the order the
        # executor runs instead, which every other rank's IR matches (tested).
        order = _one_f_one_b_order(n_ranks, n_microbatches)
        source = "autopipe fallback reproducing Schedule1F1B._step_microbatches"
        problems = _order_problems(order, ranks, n_microbatches)
    if problems:
        raise ValueError(
            f"torch's order for schedule {schedule!r} with n_ranks={n_ranks}, n_microbatches="
            f"{n_microbatches}, stages_per_rank={stages_per_rank} cannot run: "
            + "; ".join(problems[:3])
        )
    frozen = tuple(tuple(r) for r in order)
    _check_no_deadlock(frozen, len(ranks), schedule)
    return frozen, source


def action_inputs(action: Action, n_stages: int) -> tuple[tuple[str, int], ...]:
    """What an action waits for, as ``(kind, stage)`` pairs of its own micro-batch.

    Example:
        >>> action_inputs(Action(1, "I", 0), n_stages=3)
        (('F', 1), ('B', 2))
        >>> action_inputs(Action(0, "F", 4), n_stages=3)
        ()
    """
    s = action.stage
    if action.kind == FORWARD:
        return ((FORWARD, s - 1),) if s > 0 else ()
    if action.kind == WEIGHT_GRAD:
        return ((FULL_BACKWARD, s),)
    if s == n_stages - 1:
        return ((FORWARD, s),)
    return ((FORWARD, s), (FULL_BACKWARD, s + 1))


def _check_no_deadlock(order: Sequence[Sequence[Action]], n_stages: int, schedule: str) -> None:
    """Run the order on its dependencies alone; raise if the ranks wait on each other forever."""
    done: set[tuple[str, int, int]] = set()  # (kind, stage, micro-batch) of finished results
    next_index = [0] * len(order)
    remaining = sum(len(r) for r in order)
    while remaining:
        advanced = False
        for rank, actions in enumerate(order):
            while next_index[rank] < len(actions):
                a = actions[next_index[rank]]
                if any((kind, src, a.microbatch) not in done for kind, src in action_inputs(a, n_stages)):
                    break
                if a.kind == FORWARD:
                    done.add((FORWARD, a.stage, a.microbatch))
                elif a.kind in (FULL_BACKWARD, INPUT_GRAD):
                    done.add((FULL_BACKWARD, a.stage, a.microbatch))
                next_index[rank] += 1
                remaining -= 1
                advanced = True
        if not advanced:
            stuck = [f"rank {r} waits at {order[r][next_index[r]]}"
                     for r in range(len(order)) if next_index[r] < len(order[r])]
            raise ValueError(f"schedule {schedule!r} deadlocks: " + ", ".join(stuck))


def _torch_pipeline_order(
    cls: type, n_ranks: int, n_microbatches: int, stages_per_rank: int
) -> list[list[Action]]:
    """Instantiate torch's schedule on stand-in stages and read its pipeline_order."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = n_ranks
    stage.num_stages = n_ranks * stages_per_rank
    stage.submod = None
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        instance = cls(stage, n_microbatches)
    else:
        instance = cls([stage] * stages_per_rank, n_microbatches)
    order: list[list[Action]] = []
    for rank in range(n_ranks):
        rank_actions: list[Action] = []
        for action in instance.pipeline_order[rank]:
            if action is None:
                continue
            for sub in action.sub_actions or (action,):
                kind = sub.computation_type.value
                if kind in _KINDS:  # skip SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD
                    rank_actions.append(Action(sub.stage_index, kind, sub.microbatch_index))
        order.append(rank_actions)
    return order


def _one_f_one_b_order(n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """1F1B as Schedule1F1B._step_microbatches runs it: warm-up forwards, then B/F pairs."""
    order = []
    for rank in range(n_ranks):
        warmup = min(n_microbatches, n_ranks - rank)
        actions = [Action(rank, FORWARD, i) for i in range(warmup)]
        next_fwd = warmup
        for bwd in range(n_microbatches):
            actions.append(Action(rank, FULL_BACKWARD, bwd))
            if next_fwd < n_microbatches:
                actions.append(Action(rank, FORWARD, next_fwd))
                next_fwd += 1
        order.append(actions)
    return order


def _order_problems(order: list[list[Action]], ranks: list[int], n_mb: int) -> list[str]:
    """What is wrong with an order: missing/duplicate actions, stages on the wrong rank."""
    n_stages = len(ranks)
    problems = []
    seen: dict[Action, int] = {}
    for rank, actions in enumerate(order):
        for a in actions:
            in_range = 0 <= a.stage < n_stages and a.microbatch is not None
            if not (in_range and 0 <= a.microbatch < n_mb):
                problems.append(f"rank {rank} runs {a}, outside {n_stages} stages x {n_mb} "
                                f"micro-batches")
                continue
            if ranks[a.stage] != rank:
                problems.append(f"rank {rank} runs {a} but stage {a.stage} belongs to rank "
                                f"{ranks[a.stage]}")
            seen[a] = seen.get(a, 0) + 1
    for action, count in seen.items():
        if count > 1:
            problems.append(f"{action} runs {count} times")
    for s in range(n_stages):
        for i in range(n_mb):
            if Action(s, FORWARD, i) not in seen:
                problems.append(f"{Action(s, FORWARD, i)} never runs")
            full = Action(s, FULL_BACKWARD, i) in seen
            split = (Action(s, INPUT_GRAD, i) in seen, Action(s, WEIGHT_GRAD, i) in seen)
            if split != ((False, False) if full else (True, True)):
                problems.append(f"stage {s} micro-batch {i} needs one B or one I and one W")
    return problems

