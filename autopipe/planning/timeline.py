"""The timeline of one simulated training step: every action's start and end, per rank.

Example:
    >>> from autopipe.planning.simulator import simulate
    >>> print(simulate([1.0, 1.0], [2.0, 2.0], schedule="GPipe", n_microbatches=2).to_text())
    rank 0 |F0F1......B0--B1--|
    rank 1 |..F0F1B0--B1--....|
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._checks import check_int
from .schedules import FORWARD, FULL_BACKWARD, INPUT_GRAD, SCHEDULE_SPECS, WEIGHT_GRAD

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
    """What one simulated training step looks like: every action's start and end, per rank."""

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

        Example:
            >>> from autopipe.planning.simulator import simulate
            >>> t = simulate([1.0, 1.0], [2.0, 2.0], schedule="GPipe", n_microbatches=2)
            >>> [f"{e.kind}{e.microbatch}" for e in t.per_rank(1)]
            ['F0', 'F1', 'B0', 'B1']
        """
        check_int("rank", rank, 0, self.n_ranks - 1)
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: e.start_s)

    def peak_activation_bytes(self, act_bytes: Sequence[int],
                              send_bytes: tuple[Sequence[int], Sequence[int]] | None = None,
                              work_bytes: tuple[Sequence[int], Sequence[int]] | None = None,
                              grad_bytes: Sequence[int] | None = None) -> list[int]:
        """Peak bytes of saved activations per rank, weighting each stage by its own size.

        Example:
            >>> from autopipe.planning.simulator import simulate
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
            spec = SCHEDULE_SPECS.get(self.schedule)
            sends = (fwd, bwd, spec.send_retention if spec is not None else "step")
        if work_bytes is not None and (len(work_bytes) != 2 or any(
                len(w) != self.n_stages or any(b < 0 for b in w) for w in work_bytes)):
            raise ValueError(f"work_bytes must be (accumulating, first), each {self.n_stages} non-negative numbers "
                             f"(one per stage), got {work_bytes!r}")
        if grad_bytes is not None and (len(grad_bytes) != self.n_stages or any(b < 0 for b in grad_bytes)):
            raise ValueError(f"grad_bytes must hold {self.n_stages} non-negative numbers (one per stage), "
                             f"got {list(grad_bytes)!r}")
        peaks = inflight_peaks(self.events, self.stage_ranks, weights=act_bytes, sends=sends, work=work_bytes,
                               grads=grad_bytes)[0]
        return [int(p) for p in peaks]

    def to_text(self, *, s_per_char: float | None = None, max_width: int = 160) -> str:
        """A text Gantt chart: one row per rank, each action drawn as its label padded with
        "-" to its length; "." is idle.

        Example:
            >>> from autopipe.planning.simulator import simulate
            >>> t = simulate([1.0, 1.0], [2.0, 2.0], schedule="1F1B", n_microbatches=4)
            >>> print(t.to_text())
            rank 0 |F0F1....B0--F2B1--F3B2--..B3--|
            rank 1 |..F0B0--F1B1--F2B2--F3B3--....|
        """
        if s_per_char is not None and not s_per_char > 0:
            raise ValueError(f"s_per_char must be > 0 seconds, got {s_per_char!r}")
        check_int("max_width", max_width)
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

        Example:
            >>> from autopipe.planning.simulator import simulate
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


def inflight_peaks(
    events: list[Event], ranks: list[int], *, weights: Sequence[float],
    sends: tuple[list[int], list[int], str] | None = None,
    work: tuple[Sequence[float], Sequence[float]] | None = None,
    grads: Sequence[float] | None = None,
) -> tuple[list[float], list[float]]:
    """Peak weighted in-flight micro-batches per rank and per stage.

    Example:
        >>> from autopipe.planning.simulator import simulate
        >>> t = simulate([1.0, 1.0], [2.0, 2.0], schedule="1F1B", n_microbatches=4)
        >>> inflight_peaks(t.events, t.stage_ranks, weights=[1, 1])
        ([2.0, 1.0], [2.0, 1.0])
    """
    n_ranks = max(ranks) + 1
    rank_now = [0.0] * n_ranks
    for s, r in enumerate(ranks):  # gradients are None until a backward makes them
        rank_now[r] -= grads[s] if grads is not None else 0.0
    rank_peak = list(rank_now)
    stage_now = [0] * len(ranks)
    stage_peak = [0] * len(ranks)
    kept = [0.0] * n_ranks  # bytes of sent tensors torch still holds, per rank
    made_grads: set[int] = set()  # stages whose weight gradients exist (a B or W ran)
    last = len(ranks) - 1
    for e in sorted(events, key=lambda e: (e.rank, e.start_s)):  # stable: keeps run order
        s = e.stage
        if work is not None and e.kind in (FULL_BACKWARD, INPUT_GRAD, WEIGHT_GRAD):
            # The backward's working set comes on top of what the rank holds when it starts,
            # this micro-batch's saved tensors included (they go only as the action ends).
            # With ``grads`` the first B or W starts without them and makes them fresh, as a
            # later one does before adding them in: the same working set.
            later = e.kind != INPUT_GRAD and (s in made_grads or grads is not None)
            ws = work[0 if later else 1][s]
            if e.kind == WEIGHT_GRAD and grads is not None and s > 0:
                # torch (2.13, stage_backward_weight) makes a W's fresh weight gradients a group
                # at a time with torch.autograd.grad and adds them in after, the last group's
                # still referenced: up to the stage's gradients at once. Stage 0's W runs a
                # plain backward instead, as its working set was measured.
                ws = max(ws, grads[s])
            rank_peak[e.rank] = max(rank_peak[e.rank], rank_now[e.rank] + kept[e.rank] + ws)
        if e.kind in (FULL_BACKWARD, WEIGHT_GRAD) and s not in made_grads:
            made_grads.add(s)
            if grads is not None:  # its .grad tensors exist from the end of this action on
                rank_now[e.rank] += grads[s]
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
            if retention == "step":
                # A neighbour on the same rank (V schedules) is handed the tensor, not sent it:
                # torch (2.13, set_local_fwd_input / set_local_bwd_input) keeps it in that
                # stage's slot for the micro-batch until the next step refills the slot. The
                # output goes there once the stage's own saved tensors have gone with its last
                # backward; the input's gradient as this backward makes it.
                if s < last and not sends_on and e.kind in (FULL_BACKWARD, WEIGHT_GRAD):
                    sent += fwd[s]
                if s > 0 and not sends_back and e.kind in (FULL_BACKWARD, INPUT_GRAD):
                    sent += bwd[s]
            # 1F1B waits on each send before its next action's: it keeps at most the last one.
            kept[e.rank] = sent if retention == "next" else kept[e.rank] + sent
        stage_peak[s] = max(stage_peak[s], stage_now[s])
        rank_peak[e.rank] = max(rank_peak[e.rank], rank_now[e.rank] + kept[e.rank])
    return rank_peak, [float(p) for p in stage_peak]
