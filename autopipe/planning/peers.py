"""The split rules of the tools a user would pick instead of autopipe, on plain per-layer numbers.

Example:
    >>> from autopipe.planning.peers import deepspeed_partition_uniform, torchgpipe_solve
    >>> deepspeed_partition_uniform(7, 3)
    [0, 3, 5, 7]
    >>> torchgpipe_solve([1.0, 1.0, 1.0, 10.0], 2)
    [0, 2, 4]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._checks import check_int

def deepspeed_partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed 0.19.8 ``partition_method="uniform"``: equal layer counts, the remainder first.

    Example:
        >>> deepspeed_partition_uniform(10, 4)
        [0, 3, 6, 8, 10]
    """
    check_int("num_parts", num_parts)
    if num_items <= num_parts:
        return [min(k, num_items) for k in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + size + (1 if k < extra else 0))
    return bounds


def deepspeed_partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed 0.19.8 ``partition_method="parameters"``: the parts' spread (max - min) made small.

    Example:
        >>> deepspeed_partition_balanced([4, 1, 1, 1, 1], 2)
        [0, 1, 5]
    """
    check_int("num_parts", num_parts)
    w = np.asarray(weights, dtype=float)
    n, m = len(w), num_parts
    if n <= m:
        return deepspeed_partition_uniform(n, m)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    hi = np.full((n + 1, m + 1), np.inf)  # largest part sum on the kept path
    lo = np.full((n + 1, m + 1), np.inf)  # smallest part sum on the kept path
    back = np.zeros((n + 1, m + 1), dtype=int)
    hi[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            part = prefix[i] - prefix[:i]  # sum of layers k..i-1 for every split k < i
            new_hi = np.maximum(hi[:i, j - 1], part)
            new_lo = np.minimum(lo[:i, j - 1], part)
            cost = new_hi - new_lo
            # DeepSpeed scans k upwards and replaces on <=, so the last k with the least cost wins.
            k = int(np.flatnonzero(cost == cost.min())[-1])
            hi[i, j], lo[i, j], back[i, j] = new_hi[k], new_lo[k], k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(int(back[bounds[-1], j]))
    return bounds[::-1]


def torchgpipe_solve(costs: Sequence[float], partitions: int) -> list[int]:
    """torchgpipe 0.0.7 ``balance_by_time``'s partition of per-layer costs.

    Example:
        >>> torchgpipe_solve([5, 1, 1, 1, 1, 1], 2)
        [0, 3, 6]
    """
    check_int("partitions", partitions)
    n = len(costs)
    if n < partitions:
        raise ValueError(f"costs has {n} layers, fewer than partitions={partitions}")
    low = min(costs)
    span = max(costs) - low
    norm = [0.0] * n if span == 0 else [(c - low) / span for c in costs]
    ends = [(n // partitions) * (k + 1) for k in range(partitions - 1)] + [n]

    def sizes() -> list[tuple[float, int]]:
        starts = [0, *ends[:-1]]
        return [(sum(norm[a:b]), k) for k, (a, b) in enumerate(zip(starts, ends))]

    while True:
        largest, p = max(sizes())  # ties: the highest index, as Python's max over (size, index)
        while True:
            smallest, q = min(sizes())  # ties: the lowest index
            if largest <= smallest + 1:
                return [0, *ends]
            if p < q:
                h = q - 1
                ends[h] -= 1  # the last layer of block q-1 moves into q
            else:
                h = q + 1
                ends[q] += 1  # the first layer of block q+1 moves into q
            if h == p:
                break


def torchtitan_stage_layers(num_stages: int, num_layers: int, input_weight: int = 1,
                            output_weight: int = 1) -> list[int]:
    """How many blocks each stage holds under torchtitan 0.3.0's default LLM split.

    Example:
        >>> torchtitan_stage_layers(4, 8)
        [2, 3, 2, 1]
    """
    check_int("num_stages", num_stages)
    if num_stages == 1:
        return [num_layers]
    units = num_layers + input_weight + output_weight
    if num_stages > units:
        raise ValueError(f"torchtitan 0.3.0 needs at least one unit per stage: {num_stages} stages for "
                         f"{num_layers} blocks + embedding + head")
    per_stage, extra = divmod(units, num_stages)
    if input_weight > per_stage or output_weight > per_stage:
        raise ValueError(f"torchtitan 0.3.0 refuses {num_stages} stages of {per_stage} units: fewer than the "
                         f"embedding's weight {input_weight} or the head's {output_weight}")
    counts, left = [], num_layers
    for s in range(num_stages):
        share = per_stage + (1 if s < extra else 0)
        if s == 0:
            share -= input_weight
        elif s == num_stages - 1:
            share -= output_weight
        take = min(share, left)
        counts.append(take)
        left -= take
    return counts


def pippy_equal_size_cuts(node_params: Sequence[dict[str, int]], total_size: int, nstages: int) -> list[int]:
    """Where torchpippy 0.2.0's ``split_into_equal_size(nstages)`` inserts its ``pipe_split`` calls.

    Example:
        >>> pippy_equal_size_cuts([{"a": 4}, {}, {"b": 4}, {"c": 4}], 12, 3)
        [2, 3]
    """
    check_int("nstages", nstages)
    threshold = total_size // nstages
    cuts: list[int] = []
    size, seen = 0, set()
    for i, params in enumerate(node_params):
        if not params:
            continue
        new = {k: v for k, v in params.items() if k not in seen}
        repeated = {k: v for k, v in params.items() if k in seen}
        new_size = sum(new.values())
        if size + new_size <= threshold:
            size += new_size
            seen.update(new)
        elif size == 0 and new_size > threshold:
            cuts.append(i + 1)
        else:
            cuts.append(i)
            size = sum(repeated.values()) + new_size
            seen = set(repeated) | set(new)
    return cuts[: nstages - 1]


def simulate_1f1b_s(fwd: Sequence[float], bwd: Sequence[float], n_microbatches: int) -> float:
    """Makespan of a 1F1B schedule with these per-stage forward/backward times, no communication.

    Example:
        >>> simulate_1f1b_s([1.0, 1.0], [2.0, 2.0], 2)
        9.0
    """
    p, m = len(fwd), n_microbatches
    if p == 0 or m < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {p} stages and n_microbatches={m}")
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        acts = [("F", i) for i in range(warm)]
        f = warm
        for b in range(m):
            if f < m:
                acts.append(("F", f))
                f += 1
            acts.append(("B", b))
        orders.append(acts)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    pos = [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s < p - 1 else None
            if kind == "B" and s == p - 1:
                dep = ("F", s, i)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep is not None else 0.0)
            clock[s] = start + (fwd[s] if kind == "F" else bwd[s])
            done[(kind, s, i)] = clock[s]
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation deadlocked")  # cannot happen for the order above
    return max(clock)


def _minmax_dp(costs: np.ndarray, k: int) -> list[int]:
    """Contiguous boundaries of ``costs`` into ``k`` non-empty parts minimising the largest sum."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = np.full((n + 1, k + 1), np.inf)
    back = np.zeros((n + 1, k + 1), dtype=int)
    best[0, 0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            cand = np.maximum(best[j - 1:i, j - 1], prefix[i] - prefix[j - 1:i])
            a = int(np.argmin(cand))
            best[i, j], back[i, j] = cand[a], a + j - 1
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(int(back[bounds[-1], j]))
    return bounds[::-1]


def flops_dp_partition(fwd_flops: Sequence[float], num_stages: int, *, bwd_factor: float = 3.0,
                       n_microbatches: int | None = None) -> list[int]:
    """The FLOPs-balanced split of torchtitan PR #2113 / torch PR #179212 (open, no release).

    Example:
        >>> flops_dp_partition([1, 1, 1, 1, 4], 2)
        [0, 4, 5]
    """
    check_int("num_stages", num_stages)
    f = np.asarray(fwd_flops, dtype=float)
    if len(f) < num_stages:
        raise ValueError(f"fwd_flops has {len(f)} layers, fewer than num_stages={num_stages}")
    m = n_microbatches if n_microbatches is not None else 2 * num_stages
    prefix = np.concatenate([[0.0], np.cumsum(f)])

    def makespan(bounds: list[int]) -> tuple[float, int]:
        fw = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        bw = [bwd_factor * x for x in fw]
        crit = int(np.argmax([a + b for a, b in zip(fw, bw)]))
        return simulate_1f1b_s(fw, bw, m), crit

    bounds = _minmax_dp(f * (1.0 + bwd_factor), num_stages)
    span, crit = makespan(bounds)
    while crit > 0:
        trials = []
        for move in (-1, 1):
            start = bounds[crit] + move
            if start < crit or start >= bounds[crit + 1]:
                continue  # every stage keeps at least one layer
            head = _minmax_dp(f[:start] * (1.0 + bwd_factor), crit)
            trials.append(head + bounds[crit + 1:])  # head ends at the new start
        scored = [(makespan(t), t) for t in trials]
        better = [(s, t) for s, t in scored if s[0] < span - 1e-12 * max(span, 1.0)]
        if not better:
            break
        (span, crit), bounds = min(better, key=lambda x: x[0][0])
    return bounds
