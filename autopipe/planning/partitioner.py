"""Exact contiguous partition of segments into pipeline stages (min-max stage time).

Example:
    >>> import numpy as np
    >>> from autopipe.planning.partitioner import PartitionProblem, solve_bottleneck
    >>> prob = PartitionProblem.uniform(compute_s=[1, 1, 1, 4], num_stages=2)
    >>> solve_bottleneck(prob).cuts   # stage 0 = segments 0..2, stage 1 = segment 3
    [3]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import InfeasibleMemoryError
from ..machine.device import format_bytes
from .costmodel import link_busy_s, recompute_backward_s, stage_peak_bytes

@dataclass
class PartitionProblem:
    """The numbers the partitioner needs, one entry per segment, cut or stage.

    Attributes:
        compute_s: (n,) forward + backward seconds of each segment on a speed-1 device.
        static_bytes: (n,) bytes a segment pins for the whole step (params, grads, optimizer).
        act_bytes: (n,) bytes a segment saves for backward per micro-batch.
        cut_fwd_bytes / cut_bwd_bytes: (n+1,) bytes crossing the cut before segment k
            (entries 0 and n are ignored).
        num_stages: p.
        speed: (p,) relative compute speed of the device running each stage.
        bandwidth: (p-1,) bytes/s of the link between stage s and s+1.
        latency_s: (p-1,) fixed cost of one message on that link.
        inflight: (p,) micro-batches of activations stage s holds at its peak.
        capacity_bytes: (p,) memory of each stage's device (inf = unlimited).
        fwd_s: (n,) forward seconds of each segment on a speed-1 device (part of
            ``compute_s``): what a stage that recomputes its activations pays again in its
            backward. None: recomputation is not considered (:mod:`.recompute`).
        input_bytes: bytes of the model's inputs per micro-batch: what the first stage
            keeps per micro-batch in flight when it recomputes (a later stage keeps its cut's
            ``cut_fwd_bytes``).
        cut_fwd_messages / cut_bwd_messages: (n+1,) tensors crossing the cut before segment
            k each way; each pays the link's latency. None: one where bytes cross.
        relay_gaps: (k, 3) ``(lo, hi, gradient bytes)`` per stretch of segments a tensor
            crosses unread (:attr:`~autopipe.planning.costgraph.CostGraph.relay_gaps`); None: none.
    """

    compute_s: np.ndarray
    static_bytes: np.ndarray
    act_bytes: np.ndarray
    cut_fwd_bytes: np.ndarray
    cut_bwd_bytes: np.ndarray
    num_stages: int
    speed: np.ndarray
    bandwidth: np.ndarray
    latency_s: np.ndarray
    inflight: np.ndarray
    capacity_bytes: np.ndarray
    fwd_s: np.ndarray | None = None
    input_bytes: float = 0.0
    cut_fwd_messages: np.ndarray | None = None
    cut_bwd_messages: np.ndarray | None = None
    relay_gaps: np.ndarray | None = None

    def __post_init__(self) -> None:
        f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
        self.compute_s, self.static_bytes, self.act_bytes = f(self.compute_s), f(self.static_bytes), f(self.act_bytes)
        self.cut_fwd_bytes, self.cut_bwd_bytes = f(self.cut_fwd_bytes), f(self.cut_bwd_bytes)
        self.speed, self.bandwidth, self.latency_s = f(self.speed), f(self.bandwidth), f(self.latency_s)
        self.inflight, self.capacity_bytes = f(self.inflight), f(self.capacity_bytes)
        n, p = len(self.compute_s), self.num_stages
        if p < 1:
            raise ValueError(f"num_stages={p} must be >= 1")
        if p > n:
            raise ValueError(f"num_stages={p} exceeds the {n} segments available; at most {n} stages")
        for name, arr, size in [
            ("static_bytes", self.static_bytes, n), ("act_bytes", self.act_bytes, n),
            ("cut_fwd_bytes", self.cut_fwd_bytes, n + 1), ("cut_bwd_bytes", self.cut_bwd_bytes, n + 1),
            ("speed", self.speed, p), ("bandwidth", self.bandwidth, p - 1), ("latency_s", self.latency_s, p - 1),
            ("inflight", self.inflight, p), ("capacity_bytes", self.capacity_bytes, p),
        ]:
            if arr.shape != (size,):
                raise ValueError(f"{name} must have {size} entries, got shape {arr.shape}")
        if np.any(self.speed <= 0) or np.any(self.bandwidth <= 0):
            raise ValueError("speed and bandwidth must be > 0")
        if np.any(self.compute_s < 0) or np.any(self.latency_s < 0):
            raise ValueError("compute_s and latency_s must be >= 0")
        if self.fwd_s is not None:
            self.fwd_s = f(self.fwd_s)
            if self.fwd_s.shape != (n,) or np.any(self.fwd_s < 0):
                raise ValueError(f"fwd_s must hold {n} seconds >= 0 (one per segment), got {self.fwd_s!r}")
        for name in ("cut_fwd_messages", "cut_bwd_messages"):
            given = getattr(self, name)
            nbytes = self.cut_fwd_bytes if name == "cut_fwd_messages" else self.cut_bwd_bytes
            value = (nbytes > 0).astype(np.float64) if given is None else f(given)
            if value.shape != (n + 1,) or np.any(value < 0):
                raise ValueError(f"{name} must hold {n + 1} message counts >= 0 (one per cut), got {given!r}")
            setattr(self, name, value)
        gaps = np.zeros((0, 3)) if self.relay_gaps is None else f(self.relay_gaps).reshape(-1, 3)
        if len(gaps) and (np.any(gaps[:, 0] < -1) or np.any(gaps[:, 1] > n) or np.any(gaps[:, 2] < 0)):
            raise ValueError(f"relay_gaps must hold (lo >= -1, hi <= {n}, bytes >= 0) rows, got {self.relay_gaps!r}")
        self.relay_gaps = gaps
        if not float(self.input_bytes) >= 0:
            raise ValueError(f"input_bytes={self.input_bytes!r} must be a byte count >= 0")
        self.input_bytes = float(self.input_bytes)

    def stage_input_bytes(self) -> np.ndarray:
        """(n,) bytes a stage starting at segment ``i`` receives per micro-batch: the model's inputs for ``i = 0``."""
        out = self.cut_fwd_bytes[:-1].copy()
        out[0] = self.input_bytes
        return out

    @classmethod
    def uniform(
        cls,
        compute_s,
        num_stages: int,
        *,
        static_bytes=None,
        act_bytes=None,
        cut_bytes=None,
        bandwidth: float = float("inf"),
        latency_s: float = 0.0,
        inflight=None,
        capacity_bytes: float = float("inf"),
    ) -> "PartitionProblem":
        """Identical devices and links; handy in tests and examples."""
        n = len(compute_s)
        cut = np.zeros(n + 1) if cut_bytes is None else np.asarray(cut_bytes, dtype=float)
        return cls(
            compute_s=compute_s,
            static_bytes=np.zeros(n) if static_bytes is None else static_bytes,
            act_bytes=np.zeros(n) if act_bytes is None else act_bytes,
            cut_fwd_bytes=cut,
            cut_bwd_bytes=np.zeros(n + 1),
            num_stages=num_stages,
            speed=np.ones(num_stages),
            bandwidth=np.full(num_stages - 1, bandwidth),
            latency_s=np.full(num_stages - 1, latency_s),
            inflight=np.ones(num_stages) if inflight is None else inflight,
            capacity_bytes=np.full(num_stages, capacity_bytes),
        )

    @property
    def num_segments(self) -> int:
        return len(self.compute_s)

    def link_s(self, link: int) -> np.ndarray:
        """(n+1,) seconds to move every cut's tensors (both directions) over ``link``."""
        t = link_busy_s(self.cut_fwd_bytes, self.cut_bwd_bytes, self.bandwidth[link], self.latency_s[link],
                        self.cut_fwd_messages, self.cut_bwd_messages)
        t[0] = t[-1] = 0.0  # the model's own inputs and outputs cross no link
        return t

    def link_at_s(self, link: int, cut: int) -> float:
        """Seconds to move cut ``cut``'s tensors (both directions) over ``link``: one entry of :meth:`link_s`."""
        if cut <= 0 or cut >= self.num_segments:
            return 0.0
        return float(link_busy_s(self.cut_fwd_bytes[cut], self.cut_bwd_bytes[cut], self.bandwidth[link],
                                 self.latency_s[link], self.cut_fwd_messages[cut], self.cut_bwd_messages[cut]))


@dataclass
class PartitionResult:
    """A partition: ``cuts`` are segment indices where stages 1..p-1 begin."""

    cuts: list[int]
    stage_time_s: list[float]
    stage_compute_s: list[float]
    stage_comm_s: list[float]
    stage_mem_bytes: list[float]
    fits_memory: bool = True
    searched: dict = field(default_factory=dict)  # iterations, tolerance: how the answer was found
    recompute: list[int] = field(default_factory=list)  # stages that recompute their activations

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_time_s)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """(first, last + 1) segment range of each stage."""
        edges = [0, *self.cuts, len(self.stage_time_s) and None]
        return [(edges[s], edges[s + 1]) for s in range(len(self.cuts) + 1)]


def evaluate(problem: PartitionProblem, cuts: list[int], recompute: Sequence[int] = ()) -> PartitionResult:
    """Stage times and memory of the partition with the given ``cuts`` (no search)."""
    n, p = problem.num_segments, problem.num_stages
    cuts = [int(c) for c in cuts]
    if len(cuts) != p - 1 or any(b <= a for a, b in zip([0, *cuts], [*cuts, n])):
        raise ValueError(f"cuts={cuts} must be {p - 1} strictly increasing segment indices in 1..{n - 1}")
    again = sorted(set(int(s) for s in recompute))
    if again and (problem.fwd_s is None or not set(again) <= set(range(p))):
        raise ValueError(f"recompute={again} must be stage indices in 0..{p - 1} of a problem with fwd_s "
                         "(the forward seconds a recomputing stage pays again)")
    F = np.concatenate([[0.0], np.cumsum(problem.fwd_s)]) if problem.fwd_s is not None else None
    into = problem.stage_input_bytes()
    C = np.concatenate([[0.0], np.cumsum(problem.compute_s)])
    S = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
    A = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
    edges = [0, *cuts, n]
    times, comps, comms, mems = [], [], [], []
    for s in range(p):
        i, j = edges[s], edges[s + 1]
        again_s = s in again
        comp = recompute_backward_s(F[j] - F[i] if again_s else 0.0, C[j] - C[i], again_s) / problem.speed[s]
        comm = (problem.link_at_s(s - 1, i) if s > 0 else 0.0) + (problem.link_at_s(s, j) if s < p - 1 else 0.0)
        comps.append(float(comp))
        comms.append(float(comm))
        times.append(float(comp + comm))
        mems.append(stage_peak_bytes(S[j] - S[i], A[j] - A[i], problem.inflight[s], recompute=again_s,
                                     input_bytes=into[i]))
    fits = all(m <= c for m, c in zip(mems, problem.capacity_bytes))
    return PartitionResult(cuts, times, comps, comms, mems, fits_memory=fits, recompute=again)


# --------------------------------------------------------------------------- search


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo[k] .. hi[k]]) for every k (inclusive; -inf where lo > hi), via a sparse table."""
    out = np.full(lo.shape, -np.inf)
    valid = lo <= hi
    if not valid.any():
        return out
    lo_v, hi_v = lo[valid], hi[valid]
    length = hi_v - lo_v + 1
    level = np.frexp(length)[1].astype(np.int64) - 1  # floor(log2(length)), exact for integers
    table = [values]
    for k in range(1, int(level.max()) + 1):
        prev, half = table[-1], 1 << (k - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    if len(table) == 1:
        res = values[lo_v]
    else:
        res = np.empty(len(lo_v))
        for k, row in enumerate(table):
            sel = level == k
            if sel.any():
                res[sel] = np.maximum(row[lo_v[sel]], row[hi_v[sel] - (1 << k) + 1])
    out[valid] = res
    return out


class _Search:
    """Precomputed prefix sums and windows shared by every feasibility test."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.pb = problem
        n, p = problem.num_segments, problem.num_stages
        self.n, self.p = n, p
        self.C = np.concatenate([[0.0], np.cumsum(problem.compute_s)])
        S = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
        A = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
        alike: dict[tuple[float, float], np.ndarray] = {}  # links of equal bandwidth and latency (most) share one
        links = []
        for s in range(p - 1):
            key = (float(problem.bandwidth[s]), float(problem.latency_s[s]))
            if key not in alike:
                alike[key] = problem.link_s(s)
            links.append(alike[key])
        zero = np.zeros(n + 1)
        self.link_in = [links[s - 1] if s > 0 else zero for s in range(p)]
        self.link_out = [links[s] if s < p - 1 else zero for s in range(p)]
        self.S, self.A = S, A
        # speed_after[s]: the summed speed of stages s .. p-1 (how much compute they can take per second).
        self.speed_after = np.concatenate([np.cumsum(problem.speed[::-1])[::-1], [0.0]])

    def window_lo(self, s: int, js: np.ndarray, base: int = 0) -> np.ndarray:
        """For each end ``j`` in ``js``: the first start ``i >= base`` whose stage ``s`` fits its memory (``<= j``)."""
        if not np.isfinite(self.pb.capacity_bytes[s]):
            return np.minimum(np.full(len(js), base), js)
        top = int(js.max()) + 1 if len(js) else base
        M = self.S[base:top] + self.pb.inflight[s] * self.A[base:top]
        lo = base + np.searchsorted(M, M[js - base] - self.pb.capacity_bytes[s] * (1 + 1e-12), side="left")
        return np.minimum(lo, js)

    def reachable(self, T: float) -> list[np.ndarray] | None:
        """Boolean reach[s][i]: stages 0..s-1 can end exactly at cut i with every stage <= T."""
        n, p, C, pb = self.n, self.p, self.C, self.pb
        reach = [np.zeros(n + 1, dtype=bool)]
        reach[0][0] = True
        tol = 1e-12 * max(T, 1e-300)
        for s in range(p):
            sp = pb.speed[s]
            starts = np.flatnonzero(reach[s])
            a, b = int(starts[0]), int(starts[-1])
            if a >= n:
                return None  # every reachable cut is already at the end: no segment left
            # Only ends j in (a, hi] can be reached; near the optimum this band is narrow,
            # which keeps each test far below O(n) per stage.
            hi = n if not np.isfinite(T) else min(n, int(np.searchsorted(C, C[b] + sp * T * (1 + 1e-12), side="right")) - 1)
            hi = min(n, max(hi, a + 1))
            js = np.arange(a + 1, hi + 1)
            V = np.where(reach[s][a : b + 1], C[a : b + 1] - sp * self.link_in[s][a : b + 1], -np.inf)
            lo = self.window_lo(s, js, a)
            if np.isfinite(T):
                # Links cost >= 0, so a stage ending at j cannot start before C[j] - speed*T.
                lo = np.maximum(lo, np.searchsorted(C, C[js] - sp * T * (1 + 1e-12), side="left"))
            lo = np.maximum(lo, a) - a
            up = np.minimum(js - 1, b) - a
            best = _range_max(V, lo, up)
            need = C[js] + sp * (self.link_out[s][js] - T)
            ok_band = np.isfinite(best) & (best >= need - sp * tol)
            ok = np.zeros(n + 1, dtype=bool)
            ok[js] = ok_band
            if np.isfinite(T) and s + 1 < p:
                # The stages after this one take at most T each: an end that leaves them more
                # compute than that can lead nowhere. Dropping it keeps the next band narrow.
                left = T * self.speed_after[s + 1] * (1 + 1e-12)
                ok[: int(np.searchsorted(C, C[n] - left, side="left"))] = False
            if not ok.any():
                return None
            reach.append(ok)
        return reach if reach[p][n] else None

    def backtrack(self, T: float, reach: list[np.ndarray], mode: str = "balance") -> list[int]:
        """Cuts of one partition with every stage <= T."""
        cuts = []
        j = self.n
        tol = 1e-12 * max(T, 1e-300)
        for s in range(self.p - 1, 0, -1):
            sp = self.pb.speed[s]
            lo = int(self.window_lo(s, np.array([j]))[0])
            cand = np.arange(lo, j)
            cand = cand[reach[s][cand]]
            value = self.C[cand] - sp * self.link_in[s][cand]
            need = self.C[j] + sp * (self.link_out[s][j] - T) - sp * tol
            cand = cand[value >= need]
            stage_time = (self.C[j] - self.C[cand]) / sp + self.link_in[s][cand] + self.link_out[s][j]
            # Equal share of the compute left for stages 0..s, at this stage's speed.
            share = self.C[j] / self.pb.speed[: s + 1].sum()
            gap = np.abs(stage_time - share)
            if mode == "min_comm":
                link = self.link_in[s][cand]
                keep = link <= link.min() * (1 + 1e-12)
                cand, gap = cand[keep], gap[keep]
            i = int(cand[np.flatnonzero(gap == gap.min())[-1]])  # ties: the later cut
            cuts.append(i)
            j = i
        return cuts[::-1]


#: Thresholds (times the lower bound on the heaviest stage) tried for a first split, in order.
_FIRST_THRESHOLDS = (1.001, 1.01, 1.1, 1.5, 2.0, 4.0, 16.0)


def solve_bottleneck(problem: PartitionProblem, *, rel_tol: float = 1e-9, max_iter: int = 200) -> PartitionResult:
    """The contiguous partition minimising the heaviest stage time within every memory limit.

    Args:
        problem: Costs per segment, cut and stage.

    Keyword Args:
        rel_tol: Stop when the optimum is bracketed within this relative gap.
        max_iter: Safety bound on bisection steps.

    Returns:
        A :class:`PartitionResult`; ``searched`` records the iterations and the final gap.

    Raises:
        InfeasibleMemoryError: no partition fits; the message says the smallest capacity
            (with the same ratios between devices) that would fit.

    Example:
        >>> prob = PartitionProblem.uniform(compute_s=[3, 1, 1, 1, 3], num_stages=3)
        >>> r = solve_bottleneck(prob)
        >>> r.cuts, r.bottleneck_s
        ([1, 4], 3.0)
    """
    search = _Search(problem)
    # No stage can be lighter than the ideal share of compute or the heaviest single segment.
    lo = max(search.C[-1] / problem.speed.sum(), (problem.compute_s / problem.speed.max()).max()) * (1 - 1e-12)
    # A first split from thresholds a little above that bound: near the optimum the bands of
    # reachable cuts are narrow and each test is cheap, where an unbounded one visits every cut.
    reach, T = None, float("inf")
    for factor in _FIRST_THRESHOLDS:
        reach = search.reachable(lo * factor)
        if reach is not None:
            T = lo * factor
            break
        lo = lo * factor  # infeasible at this threshold: the optimum lies above it
    else:
        reach = search.reachable(T)
    if reach is None:
        need = solve_min_memory(problem)
        raise InfeasibleMemoryError(
            f"no split into {problem.num_stages} stages fits the memory given "
            f"({format_capacities(problem.capacity_bytes)}); the smallest per-device memory that fits is "
            f"{format_bytes(need)} (with {problem.num_stages} stages, this schedule and optimizer). "
            "Give more memory, more devices, a schedule that holds fewer micro-batches (1F1B), "
            "or enable activation checkpointing.",
            min_memory_bytes=int(np.ceil(need)),
        )
    hi_cuts = search.backtrack(T, reach)
    hi = evaluate(problem, hi_cuts).bottleneck_s
    best_cuts = hi_cuts
    it = 0
    while hi - lo > rel_tol * hi and it < max_iter:
        it += 1
        mid = 0.5 * (lo + hi)
        reach = search.reachable(mid)
        if reach is None:
            lo = mid
        else:
            best_cuts = search.backtrack(mid, reach)
            hi = min(mid, evaluate(problem, best_cuts).bottleneck_s)
    result = evaluate(problem, best_cuts)
    result.searched = {"iterations": it, "lower": float(lo), "upper": float(hi), "rel_tol": rel_tol}
    return result


def rank_work_lower_bound_s(problem: PartitionProblem, stages_per_rank: int, rank_speed: Sequence[float]) -> float:
    """The least work per micro-batch some rank must do, on any split of ``problem``.

    Example:
        >>> rank_work_lower_bound_s(PartitionProblem.uniform(compute_s=[1.0, 1.0, 1.0, 1.0], num_stages=2), 1,
        ...                         [1.0, 1.0])
        2.0
    """
    if stages_per_rank > 1:
        return float(problem.compute_s.sum() / sum(rank_speed))
    free = replace(problem, cut_fwd_bytes=np.zeros_like(problem.cut_fwd_bytes),
                   cut_bwd_bytes=np.zeros_like(problem.cut_bwd_bytes),
                   capacity_bytes=np.full_like(problem.capacity_bytes, np.inf))
    return solve_bottleneck(free).bottleneck_s


def candidate_partitions(
    problem: PartitionProblem, *, max_ratio: float = 1.5, steps: int = 16
) -> list[PartitionResult]:
    """Good partitions trading a slightly heavier bottleneck for cheaper or better-placed cuts.

    Example:
        >>> # The middle cut balances compute but costs 0.5 s to cross; the cut at 3 is free.
        >>> prob = PartitionProblem.uniform([1, 1, 1, 1], 2, cut_bytes=[0, 0, 0.5, 0, 0], bandwidth=1.0)
        >>> [(r.cuts, r.bottleneck_s) for r in candidate_partitions(prob, max_ratio=1.5, steps=4)]
        [([2], 2.5), ([3], 3.0)]
    """
    if max_ratio < 1 or steps < 1:
        raise ValueError(f"max_ratio={max_ratio} must be >= 1 and steps={steps} >= 1")
    best = solve_bottleneck(problem)
    search = _Search(problem)
    seen = {tuple(best.cuts)}
    out = [best]
    for T in best.bottleneck_s * np.geomspace(1.0, max_ratio, steps):
        reach = search.reachable(float(T))
        if reach is None:
            continue
        for mode in ("balance", "min_comm"):
            cuts = search.backtrack(float(T), reach, mode=mode)
            if tuple(cuts) not in seen:
                seen.add(tuple(cuts))
                out.append(evaluate(problem, cuts))
    return out


def solve_min_memory(problem: PartitionProblem) -> float:
    """Smallest ``c`` such that some partition fits when every capacity is scaled to ``c·cap_s/max(cap)``."""
    ratio = capacity_shares(problem)

    def partition_at(c: float) -> list[int] | None:
        trial = PartitionProblem(**{**problem.__dict__, "capacity_bytes": ratio * c})
        search = _Search(trial)
        reach = search.reachable(float("inf"))
        return None if reach is None else search.backtrack(float("inf"), reach)

    S_total = float(np.sum(problem.static_bytes) + problem.inflight.max() * np.sum(problem.act_bytes))
    if not (ratio > 0).all():
        return float("inf")  # a device with no memory holds no stage at any scale
    lo, hi = 0.0, max(S_total / ratio.min(), 1.0) * 1.01
    cuts = partition_at(hi)
    for _ in range(100):
        if hi - lo <= 1e-9 * hi:
            break
        mid = 0.5 * (lo + hi)
        found = partition_at(mid)
        if found is None:
            lo = mid
        else:
            hi, cuts = mid, found
    # Report the memory the partition found actually needs: an exact, achievable figure.
    mems = np.array(evaluate(problem, cuts).stage_mem_bytes)
    return float((mems / ratio).max())


def every_split(problem: PartitionProblem) -> list[PartitionResult]:
    """Every split of ``problem`` into its stages, evaluated (check the count with :func:`math.comb` first).

    Example:
        >>> [r.cuts for r in every_split(PartitionProblem.uniform([1.0, 1.0, 1.0, 1.0], 2))]
        [[1], [2], [3]]
    """
    n, p = problem.num_segments, problem.num_stages
    return [evaluate(problem, list(cuts)) for cuts in itertools.combinations(range(1, n), p - 1)]


def brute_force(problem: PartitionProblem) -> PartitionResult | None:
    """The optimum by trying every set of cuts; for tests on small problems only."""
    best = None
    for r in every_split(problem):
        if r.fits_memory and (best is None or r.bottleneck_s < best.bottleneck_s):
            best = r
    return best


def capacity_shares(problem: PartitionProblem) -> np.ndarray:
    """Each stage's device memory as a share of the largest: how a least-memory figure scales per device.

    Example:
        >>> capacity_shares(PartitionProblem.uniform([1.0, 1.0], 2, capacity_bytes=[4.0, 8.0])).tolist()
        [0.5, 1.0]
    """
    caps = problem.capacity_bytes
    if np.isfinite(caps).all() and caps.max() > 0:
        return caps / caps.max()
    return np.ones(problem.num_stages)


def format_capacities(caps: np.ndarray) -> str:
    """The distinct device memories, smallest first, for a message.

    Example:
        >>> format_capacities(np.array([2.0**30, 2.0**29, 2.0**30]))
        '512.0 MiB, 1.0 GiB'
    """
    return ", ".join(format_bytes(c) for c in sorted(set(float(c) for c in caps)))
