"""Splits where some stages recompute their activations: the search when memory binds.

Example:
    >>> import numpy as np
    >>> prob = PartitionProblem.uniform([3.0, 3.0, 3.0, 3.0], 2, act_bytes=[10, 10, 10, 10],
    ...                                 inflight=[2, 1], capacity_bytes=25.0)
    >>> prob.fwd_s = np.full(4, 1.0)
    >>> r = solve_recompute(prob)       # stage 0 holds 2 micro-batches: 40 bytes kept, 20 recomputing
    >>> r.cuts, r.recompute, r.bottleneck_s
    ([2], [0], 8.0)
"""

from __future__ import annotations

import itertools

import numpy as np

from .costmodel import recompute_backward_s, stage_peak_bytes
from .partitioner import PartitionProblem, PartitionResult, capacity_shares, evaluate

def stage_tables(problem: PartitionProblem, s: int, capacity: float | None = None,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage ``s`` starting at segment ``i`` and ending before ``j``, for every ``(i, j)``.

    Example:
        >>> prob = PartitionProblem.uniform([1.0, 1.0], 1, act_bytes=[4, 4], inflight=[3], capacity_bytes=10.0)
        >>> prob.fwd_s = np.array([0.5, 0.5])
        >>> t, rc, mem = stage_tables(prob, 0)
        >>> float(t[0, 2]), bool(rc[0, 2]), float(mem[0, 2])
        (3.0, True, 8.0)
    """
    if problem.fwd_s is None:
        raise ValueError("the problem has no fwd_s (forward seconds per segment); recomputation cannot be costed")
    n = problem.num_segments
    cap = problem.capacity_bytes[s] if capacity is None else capacity
    C = np.concatenate([[0.0], np.cumsum(problem.compute_s)])
    F = np.concatenate([[0.0], np.cumsum(problem.fwd_s)])
    S = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
    A = np.concatenate([[0.0], np.cumsum(problem.act_bytes)])
    into = np.concatenate([problem.stage_input_bytes(), [0.0]])[:, None]
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    zero = np.zeros(n + 1)
    link_in = problem.link_s(s - 1) if s > 0 else zero
    link_out = problem.link_s(s) if s < problem.num_stages - 1 else zero
    comm = link_in[:, None] + link_out[None, :]
    static, act, inflight = S[j] - S[i], A[j] - A[i], problem.inflight[s]
    keep_mem = stage_peak_bytes(static, act, inflight)
    rc_mem = stage_peak_bytes(static, act, inflight, recompute=np.ones_like(act, dtype=bool), input_bytes=into)
    sp = problem.speed[s]
    keep_t = (C[j] - C[i]) / sp + comm
    rc_t = recompute_backward_s(F[j] - F[i], C[j] - C[i], np.ones_like(act, dtype=bool)) / sp + comm
    limit = cap * (1 + 1e-12)
    keep_ok, rc_ok, valid = keep_mem <= limit, rc_mem <= limit, i < j
    time = np.where(keep_ok, keep_t, np.where(rc_ok, rc_t, np.inf))
    time[~valid] = np.inf
    memory = np.where(valid, np.minimum(keep_mem, rc_mem), np.inf)
    return time, valid & ~keep_ok & rc_ok, memory


class _Tables:
    """Every stage's tables, built once per problem."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.pb = problem
        tables = [stage_tables(problem, s) for s in range(problem.num_stages)]
        self.time = [t for t, _, _ in tables]
        self.rc = [r for _, r, _ in tables]
        self.C = np.concatenate([[0.0], np.cumsum(problem.compute_s)])

    def optimum(self) -> float:
        """The least heaviest-stage time of any split that fits (inf: none fits)."""
        n = self.pb.num_segments
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        for t in self.time:
            best = np.maximum(best[:, None], t).min(axis=0)
        return float(best[n])

    def partition_at(self, T: float, mode: str = "balance") -> PartitionResult | None:
        """One split with every stage ``<= T``: balanced, or the cheapest cuts to send (``mode``)."""
        n, p = self.pb.num_segments, self.pb.num_stages
        limit = T * (1 + 1e-12)
        reach = [np.zeros(n + 1, dtype=bool)]
        reach[0][0] = True
        for t in self.time:
            reach.append((reach[-1][:, None] & (t <= limit)).any(axis=0))
        if not reach[p][n]:
            return None
        cuts, again, j = [], [], n
        for s in range(p - 1, -1, -1):
            cand = np.flatnonzero(reach[s] & (self.time[s][:, j] <= limit))
            if s > 0:
                stage_time = self.time[s][cand, j]
                gap = np.abs(stage_time - self.C[j] / self.pb.speed[: s + 1].sum())
                if mode == "min_comm":
                    link = self.pb.link_s(s - 1)[cand]
                    keep = link <= link.min() * (1 + 1e-12)
                    cand, gap = cand[keep], gap[keep]
                i = int(cand[np.flatnonzero(gap == gap.min())[-1]])  # ties: the later cut
                cuts.append(i)
            else:
                i = 0
            if self.rc[s][i, j]:
                again.append(s)
            j = i
        return evaluate(self.pb, cuts[::-1], sorted(again))


def solve_recompute(problem: PartitionProblem) -> PartitionResult | None:
    """The split whose heaviest stage is lightest, each stage recomputing only if it does not fit otherwise.

    Example:
        >>> prob = PartitionProblem.uniform([1.0, 1.0], 1, act_bytes=[4, 4], inflight=[3], capacity_bytes=10.0)
        >>> prob.fwd_s = np.array([0.5, 0.5])
        >>> solve_recompute(prob).recompute
        [0]
    """
    tables = _Tables(problem)
    T = tables.optimum()
    if not np.isfinite(T):
        return None
    result = tables.partition_at(T)
    result.searched = {"iterations": 0, "lower": T, "upper": T, "rel_tol": 0.0, "recompute_search": True}
    return result


def recompute_candidates(problem: PartitionProblem, *, max_ratio: float = 1.5,
                         steps: int = 16) -> list[PartitionResult]:
    """Splits with recomputation where needed, from the optimum to ``max_ratio`` times its heaviest stage.

    Example:
        >>> prob = PartitionProblem.uniform([1.0, 1.0], 1, act_bytes=[4, 4], inflight=[3], capacity_bytes=10.0)
        >>> prob.fwd_s = np.array([0.5, 0.5])
        >>> [(r.cuts, r.recompute) for r in recompute_candidates(prob)]
        [([], [0])]
    """
    if max_ratio < 1 or steps < 1:
        raise ValueError(f"max_ratio={max_ratio} must be >= 1 and steps={steps} >= 1")
    tables = _Tables(problem)
    T0 = tables.optimum()
    if not np.isfinite(T0):
        return []
    out, seen = [], set()
    for T in T0 * np.geomspace(1.0, max_ratio, steps):
        for mode in ("balance", "min_comm"):
            r = tables.partition_at(float(T), mode)
            if r is not None and (tuple(r.cuts), tuple(r.recompute)) not in seen:
                seen.add((tuple(r.cuts), tuple(r.recompute)))
                out.append(r)
    return out


def min_memory_with_recompute(problem: PartitionProblem) -> float:
    """Least per-device memory (the devices' ratios kept) at which some split fits, recomputing where it helps.

    Example:
        >>> prob = PartitionProblem.uniform([1.0, 1.0], 1, act_bytes=[4, 4], inflight=[3])
        >>> prob.fwd_s = np.array([0.5, 0.5])
        >>> min_memory_with_recompute(prob)   # 3 x no input bytes + one micro-batch recomputed (8)
        8.0
    """
    ratio = capacity_shares(problem)
    n = problem.num_segments
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for s in range(problem.num_stages):
        _, _, mem = stage_tables(problem, s, capacity=np.inf)
        best = np.maximum(best[:, None], mem / ratio[s]).min(axis=0)
    return float(best[n])


def brute_force_recompute(problem: PartitionProblem) -> PartitionResult | None:
    """The min-max split over every set of cuts and every subset of recomputing stages; small problems only.

    Example:
        >>> prob = PartitionProblem.uniform([1.0, 1.0], 1, act_bytes=[4, 4], inflight=[3], capacity_bytes=10.0)
        >>> prob.fwd_s = np.array([0.5, 0.5])
        >>> brute_force_recompute(prob).recompute
        [0]
    """
    n, p = problem.num_segments, problem.num_stages
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        for k in range(p + 1):
            for again in itertools.combinations(range(p), k):
                r = evaluate(problem, list(cuts), again)
                if r.fits_memory and (best is None or (r.bottleneck_s, len(again)) < (best.bottleneck_s,
                                                                                        len(best.recompute))):
                    best = r
    return best
