"""The splits users get today without autopipe, costed with autopipe's own model.

Each baseline works at the granularity its tool offers: *layers*, i.e. the top-level
modules of the model with the repeated block list (``layers``, ``h``, ``blocks`` ...)
expanded into its blocks. Anything before the first block (embeddings) goes with the first
block, anything after the last (final norm, head) with the last, as Megatron-LM and
torchtitan do.

* ``equal_layers`` — the same number of blocks per stage (Megatron-LM, torchtitan defaults;
  DeepSpeed ``partition_method="uniform"``).
* ``balanced_params`` — layers grouped to minimise the largest parameter count per stage
  (DeepSpeed ``partition_method="parameters"``).
* ``block_partition`` — layers grouped by measured time, each stage boundary at the layer
  boundary nearest an equal share of the total (what torchgpipe's ``balance_by_time`` aims
  for: balanced to within one layer, not min-max optimal).

Example:
    >>> from autopipe.planning.baselines import layer_units
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.trace import trace
    >>> model, args = seed_transformer(vocab_size=100, num_layers=4, seq_len=8)
    >>> units = layer_units(trace(model, args))
    >>> units.block_names
    ['layers.0', 'layers.1', 'layers.2', 'layers.3']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .partitioner import PartitionProblem, PartitionResult, evaluate, solve_bottleneck
from .trace import TracedModel, module_spans

__all__ = ["LayerUnits", "layer_units", "BASELINES", "baseline_cuts"]

#: name -> one-line description shown in reports.
BASELINES = {
    "equal_layers": "same number of blocks per stage (Megatron-LM / torchtitan default, DeepSpeed 'uniform')",
    "balanced_params": "layers balanced by parameter count (DeepSpeed partition_method='parameters')",
    "block_partition": "layers balanced by measured time to within one layer (torchgpipe balance_by_time)",
}


@dataclass
class LayerUnits:
    """The model's layers as segment ranges: the units a by-layer tool splits between."""

    names: list[str]  # one per unit, in order
    starts: list[int]  # first segment of each unit (starts[0] == 0)
    num_segments: int
    first_block: int  # index into names of the first repeated block
    last_block: int  # index of the last repeated block

    @property
    def block_names(self) -> list[str]:
        return self.names[self.first_block : self.last_block + 1]

    def unit_sums(self, per_segment: np.ndarray) -> np.ndarray:
        """Sum a per-segment quantity over each unit."""
        edges = [*self.starts, self.num_segments]
        return np.array([per_segment[edges[u] : edges[u + 1]].sum() for u in range(len(self.names))])


def _block_container(traced: TracedModel) -> tuple[str, list[str]]:
    """The parent module whose numbered children form the longest run of legal split points."""
    legal = {c.name for c in traced.candidates} | {a for c in traced.candidates for a in c.aliases}
    spans, _ = module_spans(traced.nodes)
    children: dict[str, list[tuple[int, str]]] = {}
    for fqn in spans:
        parent, _, leaf = fqn.rpartition(".")
        if re.fullmatch(r"\d+", leaf):
            children.setdefault(parent, []).append((int(leaf), fqn))
    best: tuple[str, list[str]] = ("", [])
    for parent, kids in children.items():
        kids.sort()
        names = [f for _, f in kids]
        # The first block may start the graph (position 0 is never a candidate); the rest must be legal.
        ok = all(n in legal for n in names[1:]) and (names[0] in legal or spans[names[0]][0] == 0)
        if ok and len(names) > len(best[1]):
            best = (parent, names)
    return best


def layer_units(traced: TracedModel) -> LayerUnits:
    """Split the model into the layers a by-layer tool would see (see module docstring).

    Falls back to the top-level modules when the model has no numbered block list.
    """
    seg_start = {traced.segments[0].name: 0}
    for k, c in enumerate(traced.candidates, start=1):
        seg_start[c.name] = k
        for a in c.aliases:
            seg_start[a] = k
    spans, _ = module_spans(traced.nodes)
    parent, blocks = _block_container(traced)
    # Top-level names in graph order; a ModuleList is never called itself, so derive them
    # from the first atom of every module that ran.
    first_seen: dict[str, int] = {}
    for f, idx in spans.items():
        head = f.split(".")[0]
        first_seen[head] = min(first_seen.get(head, idx[0]), idx[0])
    top = sorted(first_seen, key=first_seen.get)
    units: list[tuple[int, str]] = []

    def add(fqn: str) -> None:
        start = 0 if fqn in spans and spans[fqn][0] == 0 else seg_start.get(fqn)
        if start is not None and all(start != s for s, _ in units):
            units.append((start, fqn))

    for fqn in top:
        if blocks and (fqn == parent or parent.startswith(fqn + ".")):
            for b in blocks:
                add(b)
        else:
            add(fqn)
    if not units or units[0][0] != 0:
        units.append((0, traced.segments[0].name))
    units.sort()
    names = [u for _, u in units]
    block_idx = [i for i, n in enumerate(names) if n in set(blocks)]
    if not block_idx:  # no block list: every top-level module is a "layer"
        block_idx = list(range(len(names)))
    return LayerUnits(
        names=names,
        starts=[s for s, _ in units],
        num_segments=traced.num_segments,
        first_block=block_idx[0],
        last_block=block_idx[-1],
    )


def _equal_layers(units: LayerUnits, p: int) -> list[int] | None:
    n_blocks = units.last_block - units.first_block + 1
    if n_blocks < p:
        return None
    return [units.starts[units.first_block + (k * n_blocks) // p] for k in range(1, p)]


def _unit_cuts_minmax(weights: np.ndarray, units: LayerUnits, p: int) -> list[int] | None:
    if len(weights) < p:
        return None
    sub = PartitionProblem.uniform(compute_s=weights, num_stages=p)
    return [units.starts[c] for c in solve_bottleneck(sub).cuts]


def _block_quantiles(weights: np.ndarray, units: LayerUnits, p: int) -> list[int] | None:
    n = len(weights)
    if n < p:
        return None
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    total = prefix[-1]
    cuts: list[int] = []
    for k in range(1, p):
        lo = (cuts[-1] + 1) if cuts else 1
        hi = n - (p - k)  # leave at least one unit for each remaining stage
        c = int(np.argmin(np.abs(prefix[lo : hi + 1] - k * total / p))) + lo
        cuts.append(c)
    return [units.starts[c] for c in cuts]


def baseline_cuts(name: str, units: LayerUnits, problem: PartitionProblem, param_bytes: np.ndarray) -> list[int] | None:
    """Segment cuts of baseline ``name`` for ``problem.num_stages`` stages (None if it cannot split)."""
    p = problem.num_stages
    if p == 1:
        return []
    if name == "equal_layers":
        return _equal_layers(units, p)
    if name == "balanced_params":
        return _unit_cuts_minmax(units.unit_sums(param_bytes), units, p)
    if name == "block_partition":
        return _block_quantiles(units.unit_sums(problem.compute_s), units, p)
    raise ValueError(f"unknown baseline {name!r}; known: {list(BASELINES)}")


def evaluate_baselines(
    units: LayerUnits, problem: PartitionProblem, param_bytes: np.ndarray
) -> dict[str, PartitionResult]:
    """Cost every baseline that can produce a split, under the same problem."""
    out = {}
    for name in BASELINES:
        cuts = baseline_cuts(name, units, problem, param_bytes)
        if cuts is not None:
            out[name] = evaluate(problem, cuts)
    return out
