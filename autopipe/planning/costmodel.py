"""The cost model: the one place that turns stage numbers into times and bytes.

Example:
    >>> from autopipe.planning.costmodel import cut_time_s, step_backward_s
    >>> cut_time_s(fwd_bytes=4e6, bwd_bytes=2e6, bandwidth=2e9, latency_s=1e-4)  # 2 ms + 0.1 ms
    0.0021
    >>> step_backward_s(bwd_s=2.0, accum_s=0.5, n_microbatches=4)
    2.375
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np


if TYPE_CHECKING:
    from .timeline import Timeline

class SegmentTimes(Protocol):
    """What the stage times read of a segment: a profile's ``SegmentCost`` or a plan's ``PlanSegment``."""

    fwd_s: float
    bwd_s: float
    accum_s: float


@dataclass(frozen=True)
class StepTail:
    """Seconds of the work a training step does once, around the schedule's actions.

    Example:
        >>> StepTail(merge_outputs_s=0.002, loss_broadcast_s=0.0001).total_s
        0.0021
    """

    merge_outputs_s: float = 0.0
    loss_broadcast_s: float = 0.0
    shared_grads_s: float = 0.0
    start_agreement_s: float = 0.0

    @property
    def total_s(self) -> float:
        """All of the tail: what the predicted step adds to the simulated schedule."""
        return self.any_split_s + self.shared_grads_s

    @property
    def any_split_s(self) -> float:
        """The part every split pays (merging outputs, the loss broadcast, the start); tied gradients may not."""
        return self.merge_outputs_s + self.loss_broadcast_s + self.start_agreement_s


# --------------------------------------------------------------------------- stage and cut times


def step_backward_s(bwd_s: float, accum_s: float, n_microbatches: int) -> float:
    """Backward seconds per micro-batch inside a step of ``n_microbatches``.

    Example:
        >>> step_backward_s(2.0, 0.5, 1)
        2.0
    """
    m = max(int(n_microbatches), 1)
    return bwd_s + accum_s * (m - 1) / m


def recompute_backward_s(fwd_s: Any, bwd_s: Any, recompute: Any = True) -> Any:
    """Backward seconds of a stage that recomputes (``recompute`` true): its forward again, then its backward.

    Example:
        >>> recompute_backward_s(1.0, 2.0), recompute_backward_s(1.0, 2.0, recompute=False)
        (3.0, 2.0)
    """
    if isinstance(fwd_s, np.ndarray) or isinstance(bwd_s, np.ndarray) or isinstance(recompute, np.ndarray):
        return np.asarray(bwd_s, dtype=float) + np.where(recompute, np.asarray(fwd_s, dtype=float), 0.0)
    return float(bwd_s + (fwd_s if recompute else 0.0))


def held_act_bytes(act_bytes: Any, input_bytes: Any, recompute: Any) -> Any:
    """Bytes a stage keeps per micro-batch in flight: its saved activations, or its inputs when it recomputes.

    Example:
        >>> held_act_bytes(500, 20, recompute=True), held_act_bytes(500, 20, recompute=False)
        (20, 500)
    """
    if isinstance(act_bytes, np.ndarray) or isinstance(input_bytes, np.ndarray) or isinstance(recompute, np.ndarray):
        return np.where(recompute, input_bytes, act_bytes)
    return input_bytes if recompute else act_bytes


def stage_times_s(segments: Sequence[SegmentTimes], cuts: Sequence[int], n_microbatches: int,
                  speed: Sequence[float] | None = None,
                  recompute: Sequence[int] = ()) -> tuple[list[float], list[float]]:
    """Per stage, forward and backward seconds per micro-batch of the split at ``cuts``.

    Args:
        segments: the profile, one entry per segment (anything with ``fwd_s``, ``bwd_s``,
            ``accum_s``).
        cuts: the segment indices where stages 1 .. p-1 begin.
        n_microbatches: micro-batches per step (the gradient accumulation depends on it).
        speed: per stage, the relative speed of its device; None = all 1.
        recompute: the stages that recompute their activations in the backward
            (:func:`recompute_backward_s`).

    Returns:
        ``(fwd_s, bwd_s)``, one entry per stage each.

    Example:
        >>> from types import SimpleNamespace as Seg
        >>> segs = [Seg(fwd_s=1.0, bwd_s=2.0, accum_s=0.0)] * 3
        >>> stage_times_s(segs, [1], n_microbatches=4)
        ([1.0, 2.0], [2.0, 4.0])
    """
    edges = [0, *cuts, len(segments)]
    p = len(edges) - 1
    speeds = [1.0] * p if speed is None else [float(x) for x in speed]
    if len(speeds) != p:
        raise ValueError(f"speed has {len(speeds)} entries but cuts={list(cuts)} make {p} stages; give one per stage")
    fwd, bwd = [], []
    for s in range(p):
        part = segments[edges[s]:edges[s + 1]]
        fwd.append(sum(seg.fwd_s for seg in part) / speeds[s])
        bwd.append(sum(step_backward_s(seg.bwd_s, seg.accum_s, n_microbatches) for seg in part) / speeds[s])
    again = set(int(s) for s in recompute)
    if again - set(range(p)):
        raise ValueError(f"recompute={sorted(again)} names stages outside 0..{p - 1}; give stage indices of this split")
    bwd = [recompute_backward_s(f, b, s in again) for s, (f, b) in enumerate(zip(fwd, bwd))]
    return fwd, bwd


def cut_bytes(fwd_bytes: float, bwd_bytes: float) -> float:
    """Bytes one transfer over a stage boundary moves: ``max(fwd_bytes, bwd_bytes)``.

    Example:
        >>> cut_bytes(4096, 1024)
        4096
    """
    return max(fwd_bytes, bwd_bytes)


def cut_time_s(fwd_bytes: float, bwd_bytes: float, bandwidth: float, latency_s: float,
               messages: float = 1) -> float:
    """One-way seconds of one stage boundary: ``max(fwd_bytes, bwd_bytes) / bandwidth + latency_s * messages``.

    Example:
        >>> cut_time_s(0, 0, bandwidth=1e9, latency_s=1e-4)
        0.0
        >>> round(cut_time_s(1000, 1000, bandwidth=1e9, latency_s=1e-4, messages=4), 9)  # 1 us + 4 x 100 us
        0.000401
    """
    nbytes = cut_bytes(fwd_bytes, bwd_bytes)
    return float(nbytes / bandwidth + (latency_s * max(messages, 1) if nbytes else 0.0))


def cut_times_s(fwd_bytes: Sequence[float], bwd_bytes: Sequence[float], bandwidth: Sequence[float],
                latency_s: Sequence[float], messages: Sequence[float] | None = None) -> list[float]:
    """:func:`cut_time_s` of every stage boundary; each argument has one entry per cut (``messages``: 1 each).

    Example:
        >>> cut_times_s([1e9, 0], [5e8, 0], bandwidth=[1e9, 1e9], latency_s=[0.5, 0.5])
        [1.5, 0.0]
    """
    n = len(fwd_bytes)
    msgs = [1] * n if messages is None else list(messages)
    if not len(bwd_bytes) == len(bandwidth) == len(latency_s) == len(msgs) == n:
        raise ValueError(f"fwd_bytes, bwd_bytes, bandwidth, latency_s and messages must have one entry per cut; "
                         f"got lengths {n}, {len(bwd_bytes)}, {len(bandwidth)}, {len(latency_s)}, {len(msgs)}")
    return [cut_time_s(f, b, bw, lat, k) for f, b, bw, lat, k in zip(fwd_bytes, bwd_bytes, bandwidth, latency_s, msgs)]


def link_busy_s(fwd_bytes: Any, bwd_bytes: Any, bandwidth: float, latency_s: float,
                fwd_messages: Any = None, bwd_messages: Any = None) -> Any:
    """Seconds one micro-batch keeps a stage boundary's link busy: both directions summed.

    Example:
        >>> link_busy_s(1e9, 5e8, bandwidth=1e9, latency_s=0.5)
        2.5
        >>> link_busy_s(1e9, 5e8, bandwidth=1e9, latency_s=0.5, fwd_messages=3, bwd_messages=1)
        3.5
    """
    fwd, bwd = np.asarray(fwd_bytes, dtype=float), np.asarray(bwd_bytes, dtype=float)
    f_msgs = (fwd > 0).astype(float) if fwd_messages is None else np.maximum(np.asarray(fwd_messages, float), fwd > 0)
    b_msgs = (bwd > 0).astype(float) if bwd_messages is None else np.maximum(np.asarray(bwd_messages, float), bwd > 0)
    t = (fwd + bwd) / bandwidth + latency_s * np.where(fwd + bwd > 0, f_msgs + b_msgs, 0.0)
    return float(t) if t.ndim == 0 else t


def step_tail(*, n_microbatches: int, out_bytes: float, n_ranks: int, bandwidth: float, latency_s: float,
              copy_bandwidth: float, shared_bytes: Sequence[tuple[float, int]] = ()) -> StepTail:
    """The :class:`StepTail` of one split.

    Example:
        >>> step_tail(n_microbatches=4, out_bytes=1e6, n_ranks=2, bandwidth=1e9, latency_s=1e-4,
        ...           copy_bandwidth=1e10).merge_outputs_s
        0.0004
    """
    merge = n_microbatches * out_bytes / copy_bandwidth
    message = latency_s if n_ranks > 1 else 0.0  # one small collective: the loss broadcast, the agreement to start
    shared = 0.0
    for nbytes, h in shared_bytes:
        if h > 1:  # ring all-reduce: 2(h-1)/h of the bytes each way, 2(h-1) hops
            shared += 2 * nbytes / copy_bandwidth + 2 * (h - 1) / h * nbytes / bandwidth + 2 * (h - 1) * latency_s
    return StepTail(merge_outputs_s=float(merge), loss_broadcast_s=float(message), shared_grads_s=float(shared),
                    start_agreement_s=float(message))


# --------------------------------------------------------------------------- the step


def simulate_step(fwd_s: Sequence[float], bwd_s: Sequence[float], comm_s: Sequence[float] | float, *,
                  schedule: str, n_microbatches: int, stages_per_rank: int,
                  action_overhead_s: float | Sequence[float] = 0.0, lazy_sends: bool = False) -> Timeline:
    """The schedule's actions on these stage and cut times: the simulated :class:`~autopipe.planning.timeline.Timeline`.

    Example:
        >>> simulate_step([1.0, 1.0], [2.0, 2.0], [], schedule="1F1B", n_microbatches=4,
        ...               stages_per_rank=1).step_s
        15.0
    """
    from .simulator import simulate  # the simulator reads torch's schedule orders: loaded when first needed

    if not isinstance(comm_s, (int, float)):
        comm_s = [float(c) for c in comm_s] or 0.0
    return simulate(list(fwd_s), list(bwd_s), schedule=schedule, n_microbatches=n_microbatches, comm_s=comm_s,
                    stages_per_rank=stages_per_rank, action_overhead_s=action_overhead_s, lazy_sends=lazy_sends)


def predicted_step_s(fwd_s: Sequence[float], bwd_s: Sequence[float], comm_s: Sequence[float] | float, *,
                     schedule: str, n_microbatches: int, stages_per_rank: int,
                     action_overhead_s: float | Sequence[float] = 0.0, lazy_sends: bool = False,
                     tail: StepTail | None = None) -> float:
    """Predicted seconds of one training step: the simulated schedule (:func:`simulate_step`) + ``tail``.

    Example:
        >>> predicted_step_s([1.0, 1.0], [2.0, 2.0], [], schedule="1F1B", n_microbatches=4,
        ...                  stages_per_rank=1, tail=StepTail(merge_outputs_s=0.5))
        15.5
    """
    timeline = simulate_step(fwd_s, bwd_s, comm_s, schedule=schedule, n_microbatches=n_microbatches,
                             stages_per_rank=stages_per_rank, action_overhead_s=action_overhead_s,
                             lazy_sends=lazy_sends)
    return timeline.step_s + (tail.total_s if tail is not None else 0.0)


# --------------------------------------------------------------------------- memory


def state_bytes(param_bytes: float, trainable_bytes: float, optimizer_factor: float) -> float:
    """Bytes pinned for the whole step: ``param_bytes + trainable_bytes * (1 + optimizer_factor)``.

    Example:
        >>> state_bytes(param_bytes=100, trainable_bytes=80, optimizer_factor=2.0)
        340.0
    """
    return float(param_bytes + trainable_bytes * (1.0 + optimizer_factor))


def stage_peak_bytes(static_bytes: Any, act_bytes: Any, inflight: Any, *, recompute: Any = False,
                     input_bytes: Any = 0) -> Any:
    """A stage's peak on its own, with ``inflight`` micro-batches in flight at its peak.

    Example:
        >>> stage_peak_bytes(340, 50, inflight=2)
        440.0
        >>> stage_peak_bytes(340, 50, inflight=2, recompute=True, input_bytes=5)
        400.0
    """
    held = held_act_bytes(act_bytes, input_bytes, recompute)
    extra = np.where(recompute, act_bytes, 0) if isinstance(recompute, np.ndarray) else (act_bytes if recompute else 0)
    peak = static_bytes + inflight * held + extra
    return peak if isinstance(peak, np.ndarray) else float(peak)


def rank_peak_bytes(timeline: Timeline, *, stage_static_bytes: Sequence[float], stage_act_bytes: Sequence[int],
                    cut_fwd_bytes: Sequence[int], cut_bwd_bytes: Sequence[int], split_backward: bool,
                    merge_bytes: float = 0.0, overcount: Sequence[float] | None = None,
                    recompute: Sequence[int] = (), stage_input_bytes: Sequence[float] | None = None,
                    stage_work_bytes: tuple[Sequence[int], Sequence[int]] | None = None,
                    stage_grad_bytes: Sequence[float] | None = None,
                    relayed_grad_bytes: Sequence[float] | None = None) -> list[float]:
    """Per rank, the predicted peak bytes of one step of ``timeline``.

    ``relayed_grad_bytes``: per stage, the part of the gradient it sends back that it only
    relays (:func:`relayed_gradient_bytes`). Under a split backward torch computes input
    gradients with ``torch.autograd.grad``, which hands a relayed one back in the storage it
    arrived in (a receive buffer kept across steps, or what the stage beside it on the same
    rank handed over and was charged for), so the kept sends leave it out; a full backward
    accumulates it into the input's ``.grad``, a fresh copy, and counts it.

    Example:
        >>> t = simulate_step([1.0, 1.0], [2.0, 2.0], [], schedule="1F1B", n_microbatches=4, stages_per_rank=1)
        >>> rank_peak_bytes(t, stage_static_bytes=[1000, 1000], stage_act_bytes=[100, 100],
        ...                 cut_fwd_bytes=[0], cut_bwd_bytes=[0], split_backward=False)
        [1200.0, 1100.0]
    """
    ranks = list(timeline.stage_ranks)
    p = len(ranks)
    sent_fwd, sent_bwd = [0] * p, [0] * p
    relayed = [0.0] * p if relayed_grad_bytes is None or not split_backward else [float(b) for b in relayed_grad_bytes]
    for c in range(p - 1):  # stage c sends forward over cut c; stage c + 1 sends the gradient back
        sent_fwd[c], sent_bwd[c + 1] = int(cut_fwd_bytes[c]), int(max(0.0, cut_bwd_bytes[c] - relayed[c + 1]))
    act = [int(a) for a in stage_act_bytes]
    again = sorted(set(int(s) for s in recompute))
    if again and (stage_input_bytes is None or len(stage_input_bytes) != p):
        raise ValueError(f"recompute={again} needs stage_input_bytes, one entry per stage ({p}); "
                         f"got {stage_input_bytes!r}")
    transient = {}  # rank -> one micro-batch's activations of its largest recomputing stage
    for s in again:
        transient[ranks[s]] = max(transient.get(ranks[s], 0), act[s])
        act[s] = int(held_act_bytes(act[s], int(stage_input_bytes[s]), True))
    if split_backward:
        act = [a + f for a, f in zip(act, sent_fwd)]
    held = timeline.peak_activation_bytes(act, send_bytes=(sent_fwd, sent_bwd), work_bytes=(
        None if stage_work_bytes is None else tuple([int(w) for w in ws] for ws in stage_work_bytes)),
        grad_bytes=None if stage_grad_bytes is None else [int(g) for g in stage_grad_bytes])
    n_ranks = max(ranks) + 1
    static = [0.0] * n_ranks
    for s, r in enumerate(ranks):
        static[r] += float(stage_static_bytes[s])
    if overcount is not None:
        static = [st - o for st, o in zip(static, overcount)]
    peak = [float(h) + st + transient.get(r, 0) for r, (h, st) in enumerate(zip(held[:n_ranks], static))]
    last = ranks[-1]
    peak[last] = max(peak[last], static[last] + merge_bytes)
    return peak


def relayed_gradient_bytes(relay_gaps: np.ndarray, cuts: Sequence[int], num_segments: int) -> list[float]:
    """Per stage of the split at ``cuts``, the bytes of gradients it passes back for tensors it only relays.

    A tensor made before a stage and read after it, but not inside it, crosses the stage
    unread (``relay_gaps``: :attr:`~autopipe.planning.costgraph.CostGraph.relay_gaps`); the
    stage's input gradient for it is the gradient its output received, in the same storage,
    so sending or handing it back allocates nothing.

    Example:
        >>> relayed_gradient_bytes(np.array([[0, 3, 64]]), [1, 2], 4)  # made in 0, read in 3: stage 1 relays it
        [0.0, 64.0, 0.0]
    """
    edges = np.array([0, *[int(c) for c in cuts], num_segments])
    gaps = np.asarray(relay_gaps, dtype=float).reshape(-1, 3)
    inside = (gaps[:, :1] < edges[None, :-1]) & (gaps[:, 1:2] >= edges[None, 1:])  # (gap, stage)
    return [float(x) for x in gaps[:, 2] @ inside]


def stage_work_bytes(work: Sequence[int], cuts: Sequence[int], cut_bwd_bytes: Sequence[int],
                     act_bytes: Sequence[int]) -> list[int]:
    """Per stage, what its backward allocates beyond its saved activations, from its segments'
    working sets (:attr:`~autopipe.planning.costgraph.SegmentCost.bwd_peak_bytes`, or
    ``bwd_input_peak_bytes``), each measured alone with the gradient arriving at its output.

    Example:
        >>> stage_work_bytes([10, 50, 30, 20], [2], [0, 5, 40, 8, 0], [0, 0, 0, 25])
        [10, 20]
    """
    n = len(work)
    edges = [0, *[int(c) for c in cuts], n]
    out = []
    for i, j in zip(edges, edges[1:]):
        best, freed = 0, 0
        for k in range(j - 1, i - 1, -1):  # backward order: the freed activations grow
            arriving = int(cut_bwd_bytes[j]) if k == j - 1 and j < n else 0
            best = max(best, int(work[k]) - arriving - freed)
            freed += int(act_bytes[k])
        out.append(best)
    return out


# --------------------------------------------------------------------------- lower bounds


def bottleneck_lower_bound_s(compute_s: Sequence[float], speed: Sequence[float]) -> float:
    """No split's heaviest stage is lighter: ``max(sum(C) / sum(speed), max(C) / max(speed))``.

    Example:
        >>> bottleneck_lower_bound_s([1.0, 1.0, 4.0], [1.0, 1.0])
        4.0
    """
    c, v = np.asarray(compute_s, dtype=float), np.asarray(speed, dtype=float)
    return max(float(c.sum() / v.sum()), float((c / v.max()).max()))


def step_lower_bound_s(rank_work_s: float, whole_s: float, timeline: Timeline, *, n_microbatches: int,
                       action_overhead_s: Sequence[float], tail: StepTail) -> float:
    """A step time no split can beat under this schedule: ``max(m * rank_work_s + overhead, whole_s) + tail``.

    Example:
        >>> t = simulate_step([1.0, 1.0], [1.0, 1.0], [], schedule="1F1B", n_microbatches=4, stages_per_rank=1)
        >>> step_lower_bound_s(2.0, 4.0, t, n_microbatches=4, action_overhead_s=[0.0, 0.0], tail=StepTail())
        8.0
    """
    # Every action of a rank also pays the runtime's overhead, one action after another.
    overhead = min(sum(action_overhead_s[e.stage] for e in timeline.per_rank(r)) for r in range(timeline.n_ranks))
    return float(max(n_microbatches * rank_work_s + overhead, whole_s) + tail.any_split_s)


# --------------------------------------------------------------------------- data parallel

#: How the gradients of a stage are reduced over its data-parallel replicas (the runtime's ``dp_mode``).
DP_MODES = ("fsdp", "replicate")


def ring_collective_s(nbytes: float, n: int, bandwidth: float, latency_s: float, *, passes: int = 1) -> float:
    """Seconds of ``passes`` ring passes over ``n`` ranks: ``passes (n-1)/n * nbytes / bandwidth + passes (n-1) * latency_s``.

    Example:
            >>> ring_collective_s(8e9, 4, 1e11, 1e-5, passes=2)  # all-reduce of 8 GB over 4 ranks
            0.12006
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    return passes * ((n - 1) / n * nbytes / bandwidth + (n - 1) * latency_s)


def dp_reduction_s(mode: str, grad_bytes: float, dp: int, bandwidth: float, latency_s: float) -> float:
    """Seconds one stage spends per step on its data-parallel collectives, not overlapped with the pipeline.

    Example:
            >>> dp_reduction_s("fsdp", 1e9, 2, 1e10, 0.0) == dp_reduction_s("replicate", 1e9, 2, 1e10, 0.0) == 0.1
            True
    """
    if mode not in DP_MODES:
        raise ValueError(f"mode={mode!r} is not a data-parallel mode; use one of {list(DP_MODES)}")
    return ring_collective_s(grad_bytes, dp, bandwidth, latency_s, passes=2)


def dp_optimizer_factor(optimizer_factor: float, dp: int, mode: str) -> float:
    """The ``optimizer_factor`` that makes :func:`state_bytes` count a stage replicated ``dp`` times.

    Example:
            >>> dp_optimizer_factor(2.0, 4, "fsdp"), dp_optimizer_factor(2.0, 4, "replicate")
            (1.0, 2.0)
    """
    if mode not in DP_MODES:
        raise ValueError(f"mode={mode!r} is not a data-parallel mode; use one of {list(DP_MODES)}")
    return optimizer_factor if mode == "replicate" or dp <= 1 else (2.0 + optimizer_factor) / dp
