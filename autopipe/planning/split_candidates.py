"""The splits the planner compares by their predicted step, beyond those of the exact search.

Example:
    >>> from autopipe.planning.partitioner import PartitionProblem
    >>> problem = PartitionProblem.uniform([1.0, 2.0, 3.0], 2)
    >>> layer_problem(problem, [0, 2]).compute_s.tolist()
    [3.0, 3.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InfeasibleMemoryError
from .baselines import LayerUnits, evaluate_baselines
from .costgraph import SegmentCost
from .partitioner import PartitionProblem, PartitionResult, candidate_partitions, evaluate, every_split
from .tracing import TracedModel

if TYPE_CHECKING:
    from .plan import Plan

#: Splits into stages that a small problem has at most for all of them to be costed.
BRUTE_FORCE_MAX = 64
#: How much faster a cut inside a block must be predicted than the best split at layer
#: boundaries to be chosen, with measured costs: the spread of the predicted difference
#: between two splits over repeated profiles on a quiet host (about 1 point either way;
#: docs/design.md, finding 15). Counted costs have no noise: 0.
INSIDE_BLOCK_MARGIN = 0.01
# Thresholds on the geometric ladder of the layer-level search (candidate_partitions' steps).
_LAYER_STEPS = 4
#: Splits whose predicted steps differ by less than this share can run in either order: the
#: median error of a predicted real step on a CPU host is about this size, and real steps of
#: two such splits swap places from run to run there (docs/design.md, "Not explained yet").
CLOSE_CALL = 0.03


def layer_problem(problem: PartitionProblem, starts: Sequence[int]) -> PartitionProblem:
    """``problem`` with its segments merged into the layers that begin at ``starts``."""
    edges = [*starts, problem.num_segments]
    merge = lambda a: np.add.reduceat(a, starts) if len(a) else a  # noqa: E731
    at_cuts = lambda a: np.asarray(a)[edges]  # noqa: E731
    return PartitionProblem(**{
        **problem.__dict__,
        "compute_s": merge(problem.compute_s), "static_bytes": merge(problem.static_bytes),
        "act_bytes": merge(problem.act_bytes), "fwd_s": None if problem.fwd_s is None else merge(problem.fwd_s),
        "cut_fwd_bytes": at_cuts(problem.cut_fwd_bytes), "cut_bwd_bytes": at_cuts(problem.cut_bwd_bytes),
        "cut_fwd_messages": at_cuts(problem.cut_fwd_messages), "cut_bwd_messages": at_cuts(problem.cut_bwd_messages),
        "relay_gaps": _layer_gaps(problem.relay_gaps, starts, problem.num_segments),
    })


def _layer_gaps(gaps: np.ndarray, starts: Sequence[int], n: int) -> np.ndarray:
    """``gaps`` (rows of segment lo, hi, bytes) with lo and hi as the layers holding them; those a layer can lie in."""
    layer = lambda x: np.where(x < 0, -1, np.where(x >= n, len(starts),  # noqa: E731
                                                   np.searchsorted(starts, x, side="right") - 1))
    lo, hi = layer(gaps[:, 0]), layer(gaps[:, 1])
    keep = hi - lo >= 2
    return np.column_stack([lo[keep], hi[keep], gaps[keep, 2]])


def more_candidates(problem: PartitionProblem, traced: TracedModel, costs: Sequence[SegmentCost],
                    have: Sequence[PartitionResult], units: LayerUnits
                    ) -> tuple[list[PartitionResult], dict[str, PartitionResult | str]]:
    """The splits to cost beside ``have``: every split of a small problem, the layer-level ones, the peers'."""
    seen = {tuple(r.cuts) for r in have}
    out: list[PartitionResult] = []

    def add(cuts: Sequence[int]) -> None:
        if tuple(cuts) not in seen and len(cuts) == problem.num_stages - 1:
            seen.add(tuple(cuts))
            out.append(evaluate(problem, list(cuts)))

    n, p = problem.num_segments, problem.num_stages
    if p > 1 and math.comb(n - 1, p - 1) <= BRUTE_FORCE_MAX:
        for r in every_split(problem):
            add(r.cuts)
    starts = units.starts
    if p > 1 and len(starts) >= p:
        try:
            for r in candidate_partitions(layer_problem(problem, starts), steps=_LAYER_STEPS):
                add([starts[u] for u in r.cuts])
        except InfeasibleMemoryError:  # no layer-level split fits: the segment-level search stands
            pass
    peers = evaluate_baselines(traced, costs, problem, units)
    for cuts in peer_cuts(peers, p):
        add(cuts)
    return out, peers


def peer_cuts(peers: dict[str, PartitionResult | str], num_stages: int) -> list[list[int]]:
    """The cuts of every peer's split into ``num_stages`` stages (a peer whose rule gives none is left out)."""
    return [list(r.cuts) for r in peers.values() if not isinstance(r, str) and len(r.cuts) == num_stages - 1]


def prefer_layer_split(scored: Sequence[tuple[float, PartitionResult, bool]], starts: Sequence[int], *,
                       margin: float, peers: Sequence[Sequence[int]] = ()) -> int:
    """Index in ``scored`` of the split to choose: the fastest, or the fastest at layer boundaries within ``margin``.

    Example:
        >>> from types import SimpleNamespace as S
        >>> prefer_layer_split([(1.00, S(cuts=[3]), True), (1.02, S(cuts=[4]), True)], [0, 4], margin=0.03)
        1
    """
    def key(i: int) -> tuple[bool, float, float, list[int]]:  # ties: the lighter bottleneck, then the earlier cuts
        step, split, fits = scored[i]
        return (not fits, step, getattr(split, "bottleneck_s", 0.0), list(split.cuts))

    best = min(range(len(scored)), key=key)
    at_layers = set(starts)
    layered = [i for i in range(len(scored)) if scored[i][2] and set(scored[i][1].cuts) <= at_layers]
    if not layered or best in layered or not scored[best][2]:
        return best
    pick = min(layered, key=key)
    peer_steps = [s for s, r, fits in scored if fits and [int(c) for c in r.cuts] in [list(c) for c in peers]]
    if scored[pick][0] <= scored[best][0] * (1 + margin) and all(scored[pick][0] <= s for s in peer_steps):
        return pick
    return best


def close_call_note(plan: Plan) -> str | None:
    """The plan's note naming the reported split predicted closest to its own, when within :data:`CLOSE_CALL`.

    Example:
        >>> close_call_note(plan)  # doctest: +SKIP
        "a close call: flops_dp's split ['model.norm'] is predicted 1.8% slower than this one; ..."
    """
    own = list(plan.split_points)
    others = [b for b in plan.baselines if b.split_points and list(b.split_points) != own and b.fits_memory
              and not b.reason]
    if not others or plan.predicted_step_s <= 0:
        return None
    near = min(others, key=lambda b: abs(b.predicted_step_s - plan.predicted_step_s))
    gap = near.predicted_step_s / plan.predicted_step_s - 1.0
    if abs(gap) >= CLOSE_CALL:
        return None
    side = f"{abs(gap):.1%} {'slower' if gap >= 0 else 'faster'}"
    return (f"a close call: {near.name}'s split {list(near.split_points)} is predicted {side} than this one; "
            f"real steps of splits within {CLOSE_CALL:.0%} of each other can come out in either order, "
            "so measure both on the ranks with autopipe.tune before a long run")
