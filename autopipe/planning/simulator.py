"""Simulate a pipeline schedule: when each rank runs each stage and micro-batch, and the step time.

Example:
        >>> from autopipe.planning.simulator import simulate
        >>> timeline = simulate([1.0, 1.0], [2.0, 2.0], schedule="1F1B", n_microbatches=4)
        >>> timeline.step_s, round(timeline.bubble_fraction, 3), timeline.peak_inflight
        (15.0, 0.2, [2, 1])
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from .schedules import (FORWARD, FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD, Action, action_order_and_source,
                        canonical_schedule_name, check_count, default_stages_per_rank, stage_ranks,
                        validate_schedule)
from .timeline import Event, Timeline, inflight_peaks

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

    Each rank runs its actions in torch's order (see
    :func:`~autopipe.planning.schedules.action_order`). An action
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
        schedule: a name from :data:`~autopipe.planning.schedules.SCHEDULES` (any case, "Schedule" prefix optional).
        n_microbatches: micro-batches per step, >= 1.
        comm_s: seconds for a stage's output (forward) or input gradient (backward) to
            reach the neighbouring stage: one float for every cut, or one per cut
            (``n_stages - 1`` values, cut c between stage c and c + 1).
        stages_per_rank: stages each rank holds; None = the schedule's default
            (:func:`~autopipe.planning.schedules.default_stages_per_rank`: 1 for GPipe and 1F1B,
            else 2). ZBVZeroBubble and DualPipeV need exactly 2; Interleaved1F1B, LoopedBFS
            and InterleavedZeroBubble take any value >= 1.
        wgrad_s: per stage, the weight-grad share of ``bwd_s`` used when a zero-bubble
            schedule splits the backward into I (``bwd_s - wgrad_s``) and W (``wgrad_s``).
            Default: half of ``bwd_s``, the split zero-bubble papers assume for a layer
            whose input-grad and weight-grad matmuls are the same size.
        action_overhead_s: seconds every action (F, B, I or W) costs on top of its compute:
            the runtime's own work per action (the schedule's bookkeeping, posting and
            waiting on its sends and receives, the autograd calls). One value for every
            stage, or one per stage. It is why schedules with more, shorter actions
            (interleaved, zero-bubble) gain less in practice than on paper;
            :func:`autopipe.runtime.overhead_probe.measure_action_overhead` measures it.
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
    check_count("n_microbatches", n_microbatches)
    fwd = _times("fwd_s", fwd_s)
    bwd = _times("bwd_s", bwd_s, length=len(fwd), length_of="fwd_s")
    n_stages = len(fwd)
    if n_stages == 0:
        raise ValueError("fwd_s must hold at least one stage time, got an empty sequence")
    if stages_per_rank is None:
        stages_per_rank = default_stages_per_rank(schedule)
    check_count("stages_per_rank", stages_per_rank)
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

    order, source = action_order_and_source(schedule, n_ranks, n_microbatches, stages_per_rank)
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
    rank_peaks, stage_peaks = inflight_peaks(events, ranks, weights=[1] * n_stages)
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
    """Discrete-event simulation: give every action a start and end time."""
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
        # action it is running at ``posted`` ends (at once if it is idle, i.e. waiting). An
        # action that starts at that very instant was waiting in the library until then.
        busy = sender_busy[ranks[src]]
        j = bisect.bisect_right(busy, (posted, math.inf)) - 1
        if j >= 0 and busy[j][0] < posted < busy[j][1]:
            return busy[j][1] + wire
        return posted + wire

    fwd_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> forward end
    grad_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> input-grad ready (B or I end)

    # The edges of schedules.action_inputs, spelled out: this is the simulator's inner loop,
    # and the generic walk over action_inputs' pairs makes a simulation about 12% slower.
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
    """Re-place ``events`` (an eager placement) until lazy deliveries stop moving them."""
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
