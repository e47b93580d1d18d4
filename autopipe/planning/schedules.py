"""Simulate a pipeline schedule: when each rank runs each stage and micro-batch, and the step time.

The simulator answers "how long does one training step take if stage ``s`` needs
``fwd_s[s]`` seconds forward and ``bwd_s[s]`` seconds backward per micro-batch?" for every
schedule in ``torch.distributed.pipelining``::

    >>> from autopipe.planning.schedules import simulate
    >>> timeline = simulate([1.0, 1.0], [2.0, 2.0], schedule="1F1B", n_microbatches=4)
    >>> timeline.step_s, round(timeline.bubble_fraction, 3), timeline.peak_inflight
    (15.0, 0.2, [2, 1])

The order in which each rank runs its forwards and backwards is torch's own: the schedule
class is instantiated on stand-in stages (no process group) and its ``pipeline_order`` is
read back. The simulator adds only time: an action starts when its rank is free and the
tensors it needs have arrived. See ``docs/simulator.md`` for the model and closed forms.

The planner calls :func:`simulate` to cost a split, the runtime calls
:func:`validate_schedule` before building a schedule, and the reports draw
:meth:`Timeline.to_chrome_trace`.
"""

from __future__ import annotations

import bisect
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from unittest import mock

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.stage import PipelineStage

__all__ = [
    "SCHEDULES",
    "MAX_SCHEDULE_SIZE",
    "Action",
    "Event",
    "Timeline",
    "action_order",
    "canonical_schedule_name",
    "check_schedule_size",
    "schedule_class",
    "simulate",
    "stage_ranks",
    "validate_schedule",
]

#: Canonical names of the schedules autopipe can simulate and run, in torch's spelling.
SCHEDULES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)

#: Most (stage, micro-batch) pairs one step may hold: ``n_ranks * stages_per_rank *
#: n_microbatches``. torch's order for a step, and the simulator's timeline of it, hold every
#: action of the step; measured on a 2-core CPU host, the simulator spends about 1 ms and
#: 2.2 KB per pair, so this bound keeps one simulation under about 600 MB and a few minutes,
#: while a count far past it (10**7 micro-batches) would exhaust the host's memory.
MAX_SCHEDULE_SIZE = 2**18

# torch's class for each schedule, looked up by name so a rename in torch fails loudly here.
_TORCH_CLASS_NAMES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
# One stage per rank: torch's PipelineScheduleSingle subclasses.
_SINGLE_STAGE = ("GPipe", "1F1B")
# Two stages per rank in a V: rank r holds stages r and 2 * n_ranks - 1 - r.
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")

# Action kinds, as in torch's _ComputationType: forward, full backward, input-grad, weight-grad.
FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
_KINDS = (FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


class Action(NamedTuple):
    """One compute action of a schedule: run ``kind`` of ``stage`` on ``microbatch``.

    ``kind`` is ``"F"`` (forward), ``"B"`` (full backward), ``"I"`` (backward for the
    input gradient only) or ``"W"`` (backward for the weight gradient only).
    """

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        # torch's own spelling ("2F0" = stage 2 forward of micro-batch 0), so orders compare by eye.
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Event:
    """One action placed in time by the simulator; times are seconds from the step's start."""

    rank: int  # the rank (device) that ran it
    stage: int  # pipeline stage, 0 = first
    microbatch: int  # micro-batch index, 0 = first
    kind: str  # "F", "B", "I" or "W", as in Action
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """How long the action ran."""
        return self.end_s - self.start_s


@dataclass
class Timeline:
    """What one simulated training step looks like: every action's start and end, per rank.

    Build it with :func:`simulate`. ``step_s`` is the makespan; ``bubble_fraction`` is the
    share of ``n_ranks * step_s`` during which ranks sit idle.
    """

    schedule: str  # canonical schedule name, one of SCHEDULES
    n_microbatches: int
    stage_ranks: list[int]  # stage_ranks[s] = the rank that runs stage s
    step_s: float  # time from the first action's start to the last action's end
    bubble_fraction: float  # 1 - sum(busy_s) / (n_ranks * step_s); 0.0 for an all-zero step
    busy_s: list[float]  # per rank: seconds spent computing
    peak_inflight: list[int]  # per rank: most micro-batches forwarded but not yet backwarded
    stage_peak_inflight: list[int]  # per stage: the same count, for that stage alone
    events: list[Event] = field(repr=False)  # every action, sorted by start time then rank
    order_source: str = ""  # where the per-rank action order came from (torch or a fallback)

    @property
    def n_ranks(self) -> int:
        """Number of ranks (devices) in the pipeline."""
        return len(self.busy_s)

    @property
    def n_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stage_ranks)

    def per_rank(self, rank: int) -> list[Event]:
        """The events one rank ran, in the order it ran them.

        Args:
            rank: rank index, ``0 <= rank < n_ranks``.

        Returns:
            That rank's events sorted by start time.

        Raises:
            ValueError: if ``rank`` is out of range.

        Example:
            >>> t = simulate([1.0, 1.0], [2.0, 2.0], schedule="GPipe", n_microbatches=2)
            >>> [f"{e.kind}{e.microbatch}" for e in t.per_rank(1)]
            ['F0', 'F1', 'B0', 'B1']
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank must be an int in [0, {self.n_ranks}), got {rank!r}")
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: e.start_s)

    def peak_activation_bytes(self, act_bytes: Sequence[int],
                              send_bytes: tuple[Sequence[int], Sequence[int]] | None = None) -> list[int]:
        """Peak bytes of saved activations per rank, weighting each stage by its own size.

        With several stages per rank the stages' in-flight counts peak at different times,
        so ``peak_inflight * act_bytes`` would overstate memory; this walks the timeline.

        torch also keeps every tensor a rank has sent alive until it waits on the send, and
        when it waits depends on the schedule class (:data:`SEND_RETENTION`): the
        multi-stage schedules (``_PipelineScheduleRuntime``) wait on all of a step's sends
        only at its end, GPipe on its backward sends at the end, 1F1B at its next send. A
        sent output is the stage's own output, which the stage keeps until that
        micro-batch's backward anyway, so it counts from then on. Pass ``send_bytes`` to
        add what is kept that way.

        Args:
            act_bytes: per stage, activation bytes saved for backward per micro-batch.
            send_bytes: optional ``(fwd, bwd)``, per stage: the bytes stage ``s`` sends on
                to stage ``s + 1`` per micro-batch (its output; 0 for the last stage) and
                the bytes it sends back to ``s - 1`` (its input's gradient; 0 for stage 0).
                Sends between two stages of one rank move nothing and are not counted.

        Returns:
            Per rank, the largest sum of ``act_bytes[s]`` over in-flight micro-batches (plus
            the sent tensors still kept at that moment).

        Raises:
            ValueError: if ``act_bytes`` or ``send_bytes`` has the wrong length or a
                negative entry.

        Example:
            >>> t = simulate([1.0, 1.0], [2.0, 2.0], schedule="1F1B", n_microbatches=4)
            >>> t.peak_activation_bytes([100, 100])
            [200, 100]
        """
        if len(act_bytes) != self.n_stages or any(b < 0 for b in act_bytes):
            raise ValueError(
                f"act_bytes must hold {self.n_stages} non-negative numbers (one per stage), "
                f"got {list(act_bytes)!r}"
            )
        sends = None
        if send_bytes is not None:
            fwd, bwd = (list(x) for x in send_bytes)
            if len(fwd) != self.n_stages or len(bwd) != self.n_stages or any(b < 0 for b in fwd + bwd):
                raise ValueError(f"send_bytes must be (fwd, bwd), each {self.n_stages} non-negative numbers "
                                 f"(one per stage), got {send_bytes!r}")
            sends = (fwd, bwd, SEND_RETENTION.get(self.schedule, "step"))
        peaks = _walk_inflight(self.events, self.stage_ranks, weights=act_bytes, sends=sends)[0]
        return [int(p) for p in peaks]

    def to_text(self, *, s_per_char: float | None = None, max_width: int = 160) -> str:
        """A text Gantt chart: one row per rank, each action drawn as its label padded with
        "-" to its length; "." is idle.

        Labels are ``F3`` (forward of micro-batch 3; ``B``, ``I``, ``W`` for the backward
        kinds) or, when a rank holds several stages, torch's ``2F3`` (stage 2 first).

        Args:
            s_per_char: seconds per character; None picks the shortest action's length
                divided by the label length, so labels fit, unless the chart would then
                be wider than ``max_width`` characters.
            max_width: widest row allowed when ``s_per_char`` is None.

        Returns:
            The chart, one line per rank.

        Raises:
            ValueError: if ``s_per_char`` is not positive or ``max_width`` < 1.

        Example:
            >>> t = simulate([1.0, 1.0], [2.0, 2.0], schedule="1F1B", n_microbatches=4)
            >>> print(t.to_text())
            rank 0 |F0F1....B0--F2B1--F3B2--..B3--|
            rank 1 |..F0B0--F1B1--F2B2--F3B3--....|
        """
        if s_per_char is not None and not s_per_char > 0:
            raise ValueError(f"s_per_char must be > 0 seconds, got {s_per_char!r}")
        if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 1:
            raise ValueError(f"max_width must be an int >= 1, got {max_width!r}")
        with_stage = self.n_stages > self.n_ranks

        def label(e: Event) -> str:
            return f"{e.stage if with_stage else ''}{e.kind}{e.microbatch}"

        if s_per_char is None:
            shortest = min((e.duration_s for e in self.events if e.duration_s > 0), default=1.0)
            s_per_char = max(shortest / (3 if with_stage else 2), self.step_s / max_width)
        width = max(1, round(self.step_s / s_per_char))
        rows = []
        for rank in range(self.n_ranks):
            cells = ["."] * width
            for e in self.per_rank(rank):
                first, last = round(e.start_s / s_per_char), round(e.end_s / s_per_char)
                text = label(e)
                for col in range(first, min(last, width)):
                    cells[col] = text[col - first] if col - first < len(text) else "-"
            rows.append(f"rank {rank} |{''.join(cells)}|")
        return "\n".join(rows)

    def to_chrome_trace(self) -> dict[str, Any]:
        """The timeline in Chrome's trace-event JSON format, one track per rank.

        Open the ``json.dump`` of it in ``chrome://tracing`` or https://ui.perfetto.dev.

        Returns:
            ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with one complete ("X")
            event per action (times in microseconds, ``tid`` = rank) and metadata events
            naming each rank's track.

        Example:
            >>> t = simulate([1e-3], [2e-3], schedule="GPipe", n_microbatches=1)
            >>> [(e["name"], e["ts"], e["dur"]) for e in t.to_chrome_trace()["traceEvents"]
            ...  if e["ph"] == "X"]
            [('F0 stage 0', 0.0, 1000.0), ('B0 stage 0', 1000.0, 2000.0)]
        """
        trace: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": self.schedule}}
        ]
        for rank in range(self.n_ranks):
            trace.append(
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                 "args": {"name": f"rank {rank}"}}
            )
        for e in self.events:
            trace.append(
                {
                    "name": f"{e.kind}{e.microbatch} stage {e.stage}",
                    "cat": _KIND_NAMES[e.kind],
                    "ph": "X",
                    "pid": 0,
                    "tid": e.rank,
                    "ts": e.start_s * 1e6,
                    "dur": (e.end_s - e.start_s) * 1e6,
                    "args": {"stage": e.stage, "microbatch": e.microbatch, "kind": e.kind},
                }
            )
        return {"traceEvents": trace, "displayTimeUnit": "ms"}


_KIND_NAMES = {
    FORWARD: "forward",
    FULL_BACKWARD: "backward",
    INPUT_GRAD: "backward input-grad",
    WEIGHT_GRAD: "backward weight-grad",
}


# ---------------------------------------------------------------------------------------
# Schedule names and torch's constraints
# ---------------------------------------------------------------------------------------


def canonical_schedule_name(name: str) -> str:
    """Map a schedule name, any case, with or without torch's "Schedule" prefix, to SCHEDULES.

    Args:
        name: e.g. ``"1f1b"``, ``"Schedule1F1B"``, ``"interleaved1f1b"``.

    Returns:
        The canonical spelling, an element of :data:`SCHEDULES`.

    Raises:
        TypeError: if ``name`` is not a string.
        ValueError: if it names no known schedule; the message lists the valid names.

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

    Args:
        name: a schedule name accepted by :func:`canonical_schedule_name`.

    Returns:
        The class in ``torch.distributed.pipelining.schedules``, e.g. ``Schedule1F1B``.

    Raises:
        ValueError: if the name is unknown.

    Example:
        >>> schedule_class("gpipe").__name__
        'ScheduleGPipe'
    """
    return getattr(torch_schedules, _TORCH_CLASS_NAMES[canonical_schedule_name(name)])


def _default_stages_per_rank(schedule: str) -> int:
    return 2 if schedule in _V_SHAPED else 1


def validate_schedule(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None, *,
    check_order: bool = True,
) -> str:
    """Check that torch can run ``name`` on this many ranks, micro-batches and stages per rank.

    Checks torch's own constructor rules (1F1B: ``n_microbatches >= n_ranks``; interleaved
    and zero-bubble: ``n_microbatches`` a multiple of ``max(1, n_microbatches // n_ranks)``;
    V-shaped: exactly 2 stages per rank; DualPipeV: ``n_microbatches >= 2 * n_ranks``), that
    the step holds at most :data:`MAX_SCHEDULE_SIZE` (stage, micro-batch) pairs, and then
    that the order torch computes runs every action once without deadlock.

    Args:
        name: schedule name (see :data:`SCHEDULES`).
        n_ranks: number of ranks (devices) in the pipeline, >= 1.
        n_microbatches: micro-batches per step, >= 1.
        stages_per_rank: stages each rank holds; None means 2 for V-shaped schedules
            (ZBVZeroBubble, DualPipeV) and 1 for the rest.
        check_order: False checks torch's counting rules alone, in constant time: neither
            the size bound nor torch's order (whose cost grows with the step).

    Returns:
        The canonical schedule name.

    Raises:
        TypeError: if a count is not an int, or the name not a str.
        ValueError: if the combination is impossible or the step too large; the message
            says what would work.

    Example:
        >>> validate_schedule("schedule1f1b", 4, 8)
        '1F1B'
        >>> validate_schedule("1F1B", 4, 2)
        Traceback (most recent call last):
        ...
        ValueError: schedule '1F1B' needs n_microbatches >= n_ranks (4), got n_microbatches=2
    """
    schedule = canonical_schedule_name(name)
    _check_count("n_ranks", n_ranks)
    _check_count("n_microbatches", n_microbatches)
    if stages_per_rank is None:
        stages_per_rank = _default_stages_per_rank(schedule)
    _check_count("stages_per_rank", stages_per_rank)
    if schedule in _SINGLE_STAGE and stages_per_rank != 1:
        raise ValueError(
            f"schedule {schedule!r} runs exactly 1 stage per rank, got stages_per_rank="
            f"{stages_per_rank}; use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble "
            f"for more"
        )
    if schedule in _V_SHAPED and stages_per_rank != 2:
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
    _order_and_source(schedule, n_ranks, n_microbatches, stages_per_rank)
    return schedule


def check_schedule_size(n_stages: int, n_microbatches: int) -> None:
    """Refuse a step of more than :data:`MAX_SCHEDULE_SIZE` (stage, micro-batch) pairs.

    Building torch's order or simulating a step takes time and memory in proportion to
    its pairs, so a count past the bound is refused before either starts.

    Raises:
        ValueError: naming both counts, their product and the bound.

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


def _check_count(arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{arg} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{arg} must be >= 1, got {value!r}")


def stage_ranks(schedule: str, n_ranks: int, stages_per_rank: int | None = None) -> list[int]:
    """Which rank runs each stage under ``schedule``, as torch places them.

    Looped schedules put stage ``s`` on rank ``s % n_ranks``; V-shaped ones (ZBVZeroBubble,
    DualPipeV) put stages ``r`` and ``2 * n_ranks - 1 - r`` on rank ``r``.

    Args:
        schedule: schedule name.
        n_ranks: number of ranks, >= 1.
        stages_per_rank: stages per rank; None = the schedule's default (2 for V, else 1).

    Returns:
        ``ranks`` with ``ranks[s]`` the rank of stage ``s``.

    Raises:
        ValueError / TypeError: for an unknown name or a count that is not an int >= 1.

    Example:
        >>> stage_ranks("ZBVZeroBubble", 2)
        [0, 1, 1, 0]
    """
    schedule = canonical_schedule_name(schedule)
    _check_count("n_ranks", n_ranks)
    if stages_per_rank is None:
        stages_per_rank = _default_stages_per_rank(schedule)
    _check_count("stages_per_rank", stages_per_rank)
    n_stages = n_ranks * stages_per_rank
    if schedule in _V_SHAPED:
        return [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages)]
    return [s % n_ranks for s in range(n_stages)]


# ---------------------------------------------------------------------------------------
# The action order, from torch
# ---------------------------------------------------------------------------------------


def action_order(
    schedule: str, *, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None
) -> list[list[Action]]:
    """The compute actions each rank runs, in order, as torch's schedule class orders them.

    Communication, FSDP and reduce-grad actions are dropped (the simulator charges
    communication on the dependency edges instead), idle slots (``None``) are dropped, and
    DualPipeV's overlapped forward+backward pairs are split into their two actions, in the
    order torch's runtime runs them.

    Args:
        schedule: schedule name.
        n_ranks: number of ranks, >= 1.
        n_microbatches: micro-batches per step, >= 1.
        stages_per_rank: stages per rank; None = the schedule's default (2 for V, else 1).

    Returns:
        ``order[rank]`` = that rank's actions in execution order.

    Raises:
        ValueError / TypeError: as :func:`validate_schedule`.

    Example:
        >>> [str(a) for a in action_order("1F1B", n_ranks=2, n_microbatches=3)[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    schedule = validate_schedule(schedule, n_ranks, n_microbatches, stages_per_rank)
    if stages_per_rank is None:
        stages_per_rank = _default_stages_per_rank(schedule)
    order, _ = _order_and_source(schedule, n_ranks, n_microbatches, stages_per_rank)
    return [list(rank_actions) for rank_actions in order]


@functools.lru_cache(maxsize=256)
def _order_and_source(
    schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int
) -> tuple[tuple[tuple[Action, ...], ...], str]:
    """Per-rank order (validated: complete, right ranks, deadlock-free) and where it came from."""
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
    # A dry run with unit times finds orders that wait on each other forever.
    n_stages = len(ranks)
    _place_in_time(frozen, ranks, [1.0] * n_stages, [1.0] * n_stages, [0.5] * n_stages,
                   [0.0] * max(0, n_stages - 1), [0.0] * n_stages, schedule=schedule)
    return frozen, source


def _torch_pipeline_order(
    cls: type, n_ranks: int, n_microbatches: int, stages_per_rank: int
) -> list[list[Action]]:
    """Instantiate torch's schedule on stand-in stages and read its pipeline_order.

    The schedule classes only ask a stage for its rank, group size and stage count while
    computing the order, so autospec'd stand-ins (as torch's _schedule_visualizer uses)
    are enough: no process group, no model.
    """
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


# ---------------------------------------------------------------------------------------
# The simulation
# ---------------------------------------------------------------------------------------


def simulate(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    *,
    schedule: str = "1F1B",
    n_microbatches: int,
    comm_s: float | Sequence[float] = 0.0,
    stages_per_rank: int | None = None,
    wgrad_s: Sequence[float] | None = None,
    action_overhead_s: float | Sequence[float] = 0.0,
    lazy_sends: bool = False,
) -> Timeline:
    """Simulate one training step of a pipeline schedule and return its timeline.

    Each rank runs its actions in torch's order (see :func:`action_order`). An action
    starts when its rank is free and its inputs have arrived:

    - forward of stage s > 0, micro-batch i: after forward of stage s - 1, i, plus comm;
    - backward (B, or input-grad I) of stage s: after its own forward, and for s < last
      after the backward/input-grad of stage s + 1, i, plus comm;
    - weight-grad W of stage s, i: after the input-grad I of stage s, i.

    Communication is a delay on the edge, overlapped with compute (no rank is blocked
    sending), and free between two stages on the same rank.

    Args:
        fwd_s: per stage, forward seconds per micro-batch; its length is the number of
            stages, ``n_ranks * stages_per_rank``.
        bwd_s: per stage, full-backward seconds per micro-batch (input-grad + weight-grad).

    Keyword Args:
        schedule: a name from :data:`SCHEDULES` (any case, "Schedule" prefix optional).
        n_microbatches: micro-batches per step, >= 1.
        comm_s: seconds for a stage's output (forward) or input gradient (backward) to
            reach the neighbouring stage: one float for every cut, or one per cut
            (``n_stages - 1`` values, cut c between stage c and c + 1).
        stages_per_rank: stages each rank holds; None = 2 for ZBVZeroBubble and DualPipeV
            (torch requires it), 1 otherwise. Interleaved1F1B, LoopedBFS and
            InterleavedZeroBubble take any value >= 1.
        wgrad_s: per stage, the weight-grad share of ``bwd_s`` used when a zero-bubble
            schedule splits the backward into I (``bwd_s - wgrad_s``) and W (``wgrad_s``).
            Default: half of ``bwd_s``, the split zero-bubble papers assume for a layer
            whose input-grad and weight-grad matmuls are the same size.
        action_overhead_s: seconds every action (F, B, I or W) costs on top of its compute:
            the runtime's own work per action (the schedule's bookkeeping, posting and
            waiting on its sends and receives, the autograd calls). One value for every
            stage, or one per stage. It is why schedules with more, shorter actions
            (interleaved, zero-bubble) gain less in practice than on paper;
            :func:`autopipe.machine.measure.measure_action_overhead` measures it.
        lazy_sends: model a communication library whose sends move only when the sending
            rank calls into it, as gloo (CPU) does: a tensor sent before its receiver has
            posted the receive is delivered when the sender's action running at that
            moment ends (it then posts its next sends and receives), not at once. NCCL
            moves data on the GPU by itself (False, the default). Placing sends lazily
            needs the sender's timeline, so the step is solved by repeating the placement
            until it no longer changes (at most :data:`LAZY_SEND_ROUNDS` times).

    Returns:
        A :class:`Timeline` with the step time, bubble fraction, per-rank busy time and
        activation in-flight counts, and every event.

    Raises:
        ValueError: for negative or non-finite times, length mismatches, ``wgrad_s`` above
            ``bwd_s``, ``n_microbatches < 1`` or a combination torch cannot schedule.
        TypeError: for non-numeric times or counts.

    Example:
        >>> t = simulate([1.0] * 4, [2.0] * 4, schedule="GPipe", n_microbatches=8)
        >>> t.step_s, round(t.bubble_fraction, 4), t.peak_inflight
        (33.0, 0.2727, [8, 8, 8, 8])
    """
    schedule = canonical_schedule_name(schedule)
    _check_count("n_microbatches", n_microbatches)
    fwd = _times("fwd_s", fwd_s)
    bwd = _times("bwd_s", bwd_s, length=len(fwd), length_of="fwd_s")
    n_stages = len(fwd)
    if n_stages == 0:
        raise ValueError("fwd_s must hold at least one stage time, got an empty sequence")
    if stages_per_rank is None:
        stages_per_rank = _default_stages_per_rank(schedule)
    _check_count("stages_per_rank", stages_per_rank)
    if n_stages % stages_per_rank != 0:
        raise ValueError(
            f"len(fwd_s) = {n_stages} stages must be a multiple of stages_per_rank="
            f"{stages_per_rank} (n_stages = n_ranks * stages_per_rank)"
        )
    if wgrad_s is None:
        wgrad = [b / 2 for b in bwd]
    else:
        wgrad = _times("wgrad_s", wgrad_s, length=n_stages, length_of="fwd_s")
        for s, (w, b) in enumerate(zip(wgrad, bwd)):
            if w > b:
                raise ValueError(
                    f"wgrad_s[{s}] = {w} exceeds bwd_s[{s}] = {b}; the weight-grad is part of "
                    f"the full backward, so 0 <= wgrad_s[s] <= bwd_s[s]"
                )
    if isinstance(comm_s, numbers.Real) and not isinstance(comm_s, bool):
        if not math.isfinite(comm_s) or comm_s < 0:
            raise ValueError(f"comm_s must be a finite time >= 0 seconds, got {comm_s!r}")
        comm = [float(comm_s)] * (n_stages - 1)
    else:
        comm = _times("comm_s", comm_s, length=n_stages - 1, length_of="the cuts (n_stages - 1)")
    if isinstance(action_overhead_s, numbers.Real) and not isinstance(action_overhead_s, bool):
        if not math.isfinite(action_overhead_s) or action_overhead_s < 0:
            raise ValueError(f"action_overhead_s must be a finite time >= 0 seconds, got {action_overhead_s!r}")
        overhead = [float(action_overhead_s)] * n_stages
    else:
        overhead = _times("action_overhead_s", action_overhead_s, length=n_stages, length_of="stage")
    if not isinstance(lazy_sends, bool):
        raise TypeError(f"lazy_sends must be True or False, got {lazy_sends!r}")
    n_ranks = n_stages // stages_per_rank
    validate_schedule(schedule, n_ranks, n_microbatches, stages_per_rank)

    order, source = _order_and_source(schedule, n_ranks, n_microbatches, stages_per_rank)
    ranks = stage_ranks(schedule, n_ranks, stages_per_rank)

    def place(sender_busy: list[list[tuple[float, float]]] | None = None) -> list[Event]:
        return _place_in_time(order, ranks, fwd, bwd, wgrad, comm, overhead, schedule=schedule,
                              sender_busy=sender_busy)

    events = place()
    if lazy_sends:
        events = _place_with_lazy_sends(events, place, n_ranks)

    step_s = max((e.end_s for e in events), default=0.0)
    busy = [0.0] * n_ranks
    for e in events:
        busy[e.rank] += e.end_s - e.start_s
    bubble = 1.0 - sum(busy) / (n_ranks * step_s) if step_s > 0 else 0.0
    rank_peaks, stage_peaks = _walk_inflight(events, ranks, weights=[1] * n_stages)
    return Timeline(
        schedule=schedule,
        n_microbatches=n_microbatches,
        stage_ranks=ranks,
        step_s=step_s,
        bubble_fraction=bubble,
        busy_s=busy,
        peak_inflight=[int(p) for p in rank_peaks],
        stage_peak_inflight=[int(p) for p in stage_peaks],
        events=events,
        order_source=source,
    )


def solve_increasing(fn: Callable[[float], float], target: float, *, hi: float = 1.0,
                     iterations: int = 60) -> float:
    """The x >= 0 at which a non-decreasing ``fn`` reaches ``target``, by doubling then bisection.

    Used to fit one unknown of a simulation to a measured step (a per-action overhead, a
    factor on compute). Returns 0.0 when ``fn(0)`` already reaches ``target``, and the
    largest x tried when ``fn`` never does within ``iterations`` doublings of ``hi``.

    Example:
        >>> round(solve_increasing(lambda x: 3 * x + 1, 7.0), 9)
        2.0
    """
    if fn(0.0) >= target:
        return 0.0
    for _ in range(iterations):
        if fn(hi) >= target:
            break
        hi *= 2.0
    else:
        return hi
    lo = 0.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fn(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _times(
    arg: str, values: Any, *, length: int | None = None, length_of: str = ""
) -> list[float]:
    """Check a sequence of seconds: finite, non-negative numbers, of the expected length."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{arg} must be a sequence of seconds (floats), got {values!r}")
    values = list(values)
    if length is not None and len(values) != length:
        raise ValueError(
            f"{arg} must have one value per {length_of or 'stage'} ({length}), "
            f"got {len(values)}: {values!r}"
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{arg}[{i}] must be a number of seconds, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{arg}[{i}] must be a finite time >= 0 seconds, got {v!r}")
        out.append(float(v))
    return out


def _place_in_time(
    order: Sequence[Sequence[Action]],
    ranks: list[int],
    fwd: list[float],
    bwd: list[float],
    wgrad: list[float],
    comm: list[float],
    overhead: list[float],
    *,
    schedule: str,
    sender_busy: list[list[tuple[float, float]]] | None = None,
) -> list[Event]:
    """Discrete-event simulation: give every action a start and end time.

    Each rank runs its actions in order. Start times depend only on the rank's previous
    action and on finished dependencies, so ranks can be advanced in any interleaving;
    a full pass in which no rank can advance means the order deadlocks.

    ``sender_busy`` (per rank, its actions' sorted (start, end) intervals, from an earlier
    placement) turns on lazy sends: see :func:`_place_with_lazy_sends`.
    """
    last = len(ranks) - 1
    compute = {
        FORWARD: fwd,
        FULL_BACKWARD: bwd,
        INPUT_GRAD: [b - w for b, w in zip(bwd, wgrad)],
        WEIGHT_GRAD: wgrad,
    }
    duration = {kind: [t + o for t, o in zip(times, overhead)] for kind, times in compute.items()}

    def cut_s(a: int, b: int) -> float:
        # Two stages on one rank (the turn of a V, or a single rank) share memory.
        return 0.0 if ranks[a] == ranks[b] else comm[min(a, b)]

    free_s = [0.0] * len(order)

    def arrival_s(sent_s: float, src: int, dst: int) -> float:
        """When a tensor stage ``src`` finished at ``sent_s`` is usable by stage ``dst``."""
        wire = cut_s(src, dst)
        if ranks[src] == ranks[dst] or sender_busy is None:
            return sent_s + wire
        posted = free_s[ranks[dst]]  # the receiver posts its receive once it is free
        if posted <= sent_s:  # the receive was waiting: the data moves at once
            return sent_s + wire
        # Sent first: it moves when the sender next calls into the library, i.e. when the
        # action it is running at ``posted`` ends (at once if it is idle, i.e. waiting).
        busy = sender_busy[ranks[src]]
        j = bisect.bisect_right(busy, (posted, math.inf)) - 1
        if j >= 0 and busy[j][0] <= posted < busy[j][1]:
            return busy[j][1] + wire
        return posted + wire

    fwd_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> forward end
    grad_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> input-grad ready (B or I end)

    def ready_s(a: Action) -> float | None:
        """When a's inputs are all available, or None if one is not computed yet."""
        s, i = a.stage, a.microbatch
        if a.kind == FORWARD:
            if s == 0:
                return 0.0
            t = fwd_end.get((s - 1, i))
            return None if t is None else arrival_s(t, s - 1, s)
        if a.kind == WEIGHT_GRAD:
            return grad_end.get((s, i))
        own = fwd_end.get((s, i))  # B or I: needs this stage's forward ...
        if own is None:
            return None
        if s == last:
            return own
        t = grad_end.get((s + 1, i))  # ... and the gradient from the next stage
        return None if t is None else max(own, arrival_s(t, s + 1, s))

    events: list[Event] = []
    next_index = [0] * len(order)
    remaining = sum(len(r) for r in order)
    while remaining:
        advanced = False
        for rank, actions in enumerate(order):
            while next_index[rank] < len(actions):
                a = actions[next_index[rank]]
                ready = ready_s(a)
                if ready is None:
                    break
                start = max(free_s[rank], ready)
                end = start + duration[a.kind][a.stage]
                if a.kind == FORWARD:
                    fwd_end[(a.stage, a.microbatch)] = end
                elif a.kind in (FULL_BACKWARD, INPUT_GRAD):
                    grad_end[(a.stage, a.microbatch)] = end
                events.append(Event(rank, a.stage, a.microbatch, a.kind, start, end))
                free_s[rank] = end
                next_index[rank] += 1
                remaining -= 1
                advanced = True
        if not advanced:
            stuck = [
                f"rank {r} waits at {order[r][next_index[r]]}"
                for r in range(len(order))
                if next_index[r] < len(order[r])
            ]
            raise ValueError(f"schedule {schedule!r} deadlocks: " + ", ".join(stuck))
    # Stable sort: a rank's zero-length actions at one instant keep their execution order.
    events.sort(key=lambda e: (e.start_s, e.rank))
    return events


#: Most placements :func:`simulate` repeats to settle a timeline with lazy sends.
LAZY_SEND_ROUNDS = 16


def _place_with_lazy_sends(
    events: list[Event], place: Callable[[list[list[tuple[float, float]]]], list[Event]], n_ranks: int,
) -> list[Event]:
    """Re-place ``events`` (an eager placement) until lazy deliveries stop moving them.

    When a send is delivered depends on what its sender is doing at the moment the
    receiver asks, which depends on the deliveries before it; each round re-places every
    action with the previous round's sender timelines. Deliveries only get later than
    eager ones, and most timelines settle in a few rounds. One that still changes after
    :data:`LAZY_SEND_ROUNDS` rounds (long interleaved pipelines can alternate between two
    close placements) keeps the later of its last two steps.
    """
    def step_s(evs: list[Event]) -> float:
        return max((e.end_s for e in evs), default=0.0)

    previous = events
    for _ in range(LAZY_SEND_ROUNDS):
        busy: list[list[tuple[float, float]]] = [[] for _ in range(n_ranks)]
        for e in events:
            busy[e.rank].append((e.start_s, e.end_s))
        for b in busy:
            b.sort()
        placed = place(busy)
        if [(e.start_s, e.end_s) for e in placed] == [(e.start_s, e.end_s) for e in events]:
            return placed
        previous, events = events, placed
    return events if step_s(events) >= step_s(previous) else previous


#: Schedules whose backward is two actions, input-grad (I) and weight-grad (W). torch then
#: detaches each stage's output in place, so autopipe's runtime sends a copy of it
#: (``autopipe.runtime.pipeline._guard_stage_boundaries``), one more tensor per micro-batch.
SPLIT_BACKWARD_SCHEDULES: tuple[str, ...] = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

#: When torch waits on a sent tensor (and so frees it), per schedule: "next" (1F1B: at its
#: next send), "gpipe" (backward sends at the end of the step; forward sends after the last
#: forward, before the backward that frees those outputs anyway, so they cost nothing
#: extra); every other schedule (``_PipelineScheduleRuntime``: "step") at the end of the
#: step. Read from torch's ``_step_microbatches`` of each class.
SEND_RETENTION: dict[str, str] = {"1F1B": "next", "GPipe": "gpipe"}


def _walk_inflight(
    events: list[Event], ranks: list[int], *, weights: Sequence[float],
    sends: tuple[list[int], list[int], str] | None = None,
) -> tuple[list[float], list[float]]:
    """Peak weighted in-flight micro-batches per rank and per stage.

    A micro-batch is in flight on a stage from the end of its forward to the end of its
    backward: B, or the weight-grad W when the backward is split, since W still needs the
    layers' saved inputs after the input-grad I (measured: a stage's live bytes barely fall
    at I and fall at W). Each rank's actions run one at a time, so walking them in start
    order visits every state the rank passes through.
    """
    n_ranks = max(ranks) + 1
    rank_now = [0.0] * n_ranks
    rank_peak = [0.0] * n_ranks
    stage_now = [0] * len(ranks)
    stage_peak = [0] * len(ranks)
    kept = [0.0] * n_ranks  # bytes of sent tensors torch still holds, per rank
    last = len(ranks) - 1
    for e in sorted(events, key=lambda e: (e.rank, e.start_s)):  # stable: keeps run order
        s = e.stage
        if e.kind == FORWARD:
            stage_now[s] += 1
            rank_now[e.rank] += weights[s]
        # The saved tensors go with the backward that uses them last: B, or W when the
        # backward is split (the weight-grad still needs the layers' inputs after I).
        elif e.kind in (FULL_BACKWARD, WEIGHT_GRAD):
            stage_now[s] -= 1
            rank_now[e.rank] -= weights[s]
        if sends is not None:
            fwd, bwd, retention = sends
            sends_on = s < last and ranks[s + 1] != ranks[s]
            sends_back = s > 0 and ranks[s - 1] != ranks[s]
            sent = 0.0  # what this action adds to the kept tensors
            if e.kind == FORWARD and sends_on and retention == "next":
                sent = fwd[s]
            elif e.kind in (FULL_BACKWARD, INPUT_GRAD):
                # A sent output is the stage's own output, which it keeps for this backward
                # anyway; from here on only the unwaited send holds it (multi-stage schedules).
                sent = (fwd[s] if sends_on and retention == "step" else 0.0) + (bwd[s] if sends_back else 0.0)
            # 1F1B waits on each send before its next action's: it keeps at most the last one.
            kept[e.rank] = sent if retention == "next" else kept[e.rank] + sent
        stage_peak[s] = max(stage_peak[s], stage_now[s])
        rank_peak[e.rank] = max(rank_peak[e.rank], rank_now[e.rank] + kept[e.rank])
    return rank_peak, [float(p) for p in stage_peak]
