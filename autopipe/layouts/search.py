"""Search the layouts of a Transformer on N GPUs: the fastest that fits, and why the others lose.

:func:`search_layouts` enumerates every layout of ``n_gpus`` for a global batch:

- tp: divisors of the GPUs per node (sequence parallelism on whenever tp > 1);
- pp: divisors of ``n_gpus / tp``; dp what remains;
- the micro-batch size (a divisor of the batch each data-parallel rank takes, up to
  ``max_micro_batch``), so the micro-batch count;
- the schedule: 1F1B, and Interleaved 1F1B with 2 or 4 stages per rank;
- checkpointing: none, selective, or full on all blocks or on the fewest that fit;
- data parallelism replicated, ZeRO-1 or FSDP;

turns away, counting each reason, those the model cannot take (a tp that does not divide its
heads, more stages than blocks: :func:`~autopipe.layouts.step.layout_problem`), charges the
others with :func:`~autopipe.layouts.step.predict_step` and ranks those within the device's
memory by tokens/s per GPU. Identical blocks are costed once per layout, so a
search takes seconds even for thousands of GPUs.

Example:
    >>> from autopipe.layouts.shapes import TransformerShape
    >>> from autopipe.layouts.gpu import GpuCosts
    >>> from autopipe.machine.topology import Topology
    >>> gpu = GpuCosts("H100", Topology(gpus_per_node=8))
    >>> result = search_layouts(TransformerShape.named("llama3-8b"), 8, global_batch=16, gpu=gpu)
    >>> best = result.best
    >>> best.layout.n_gpus, best.memory_bytes <= gpu.memory_bytes
    (8, True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from .._checks import check_int
from .gpu import GpuCosts
from .shapes import TransformerShape
from .layout import Layout
from .step import StepPrediction, layout_problem, predict_step


@dataclass
class LayoutSearch:
    """What :func:`search_layouts` found: the ranked layouts that fit, and how many did not."""

    ranked: list[StepPrediction]
    considered: int
    over_memory: int
    not_runnable: dict[str, int] = field(default_factory=dict)  # reason -> layouts

    @property
    def best(self) -> StepPrediction:
        if not self.ranked:
            raise ValueError(f"no layout of the {self.considered} considered fits in memory "
                             f"({self.over_memory} over it; {self.not_runnable or 'none unrunnable'})")
        return self.ranked[0]

    def why_slower(self, other: StepPrediction) -> str:
        """What costs ``other`` more than the best: its largest parts beyond the best's."""
        gaps = {k: other.parts_s.get(k, 0.0) - self.best.parts_s.get(k, 0.0) for k in other.parts_s}
        worst = sorted(((g, k) for k, g in gaps.items() if g > 0), reverse=True)[:2]
        if not worst:
            return "as fast"
        return ", ".join(f"{k.replace('_', ' ')} +{g:.3g} s" for g, k in worst)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: TransformerShape, n_gpus: int, global_batch: int, gpus_per_node: int, *,
                      base: Layout, max_micro_batch: int = 8) -> list[Layout]:
    """Every layout :func:`search_layouts` considers (see the module docstring)."""
    out = []
    # Degrees the model cannot take (heads that do not divide tp, more stages than blocks)
    # are kept: layout_problem turns each away with its reason, which the search reports.
    for tp in _divisors(gpus_per_node):
        if n_gpus % tp:
            continue
        for pp in _divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            schedules = [("1F1B", 1)] + [("Interleaved1F1B", v) for v in (2, 4) if pp > 1]
            for mb in _divisors(per_rank):
                if mb > max_micro_batch:
                    break
                for (schedule, v), recompute, dp_mode in itertools.product(
                        schedules, ("none", "selective", "full"), ("replicate", "zero1", "fsdp") if dp > 1 else ("replicate",)):
                    out.append(replace(base, tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=global_batch,
                                       schedule=schedule, virtual_stages=v, recompute=recompute,
                                       recompute_layers=None, sequence_parallel=tp > 1, dp_mode=dp_mode))
    return out


def search_layouts(shape: TransformerShape, n_gpus: int, *, global_batch: int, gpu: GpuCosts,
                   base: Layout | None = None, max_micro_batch: int = 8, keep: int = 10) -> LayoutSearch:
    """Rank the layouts of ``shape`` on ``n_gpus`` GPUs for ``global_batch`` sequences a step.

    Args:
        shape: the model.
        n_gpus: GPUs in all.
        global_batch: sequences per step.
        gpu: the accelerator, its memory and links, and the efficiency shares.
        base: the runtime's fixed options (flash attention, float8, compile, async TP,
            whether data parallelism overlaps); its degrees and batch sizes are searched.
        max_micro_batch: the largest micro-batch size tried.
        keep: how many of the fastest layouts to return.

    Returns:
        A :class:`LayoutSearch`; ``.best`` is the fastest layout within memory. Where fully
        checkpointing every block fits, so does checkpointing fewer: the fewest full-checkpointed
        blocks per rank that fit are tried too.

    Raises:
        ValueError: ``n_gpus`` or ``global_batch`` not a positive integer.
    """
    check_int("n_gpus", n_gpus)
    check_int("global_batch", global_batch)
    base = base or Layout()
    considered = over = 0
    unrunnable: dict[str, int] = {}
    fits: list[StepPrediction] = []
    for layout in candidate_layouts(shape, n_gpus, global_batch, gpu.topology.gpus_per_node, base=base,
                                    max_micro_batch=max_micro_batch):
        considered += 1
        why = layout_problem(shape, layout, gpu.topology.gpus_per_node)
        if why:
            unrunnable[why] = unrunnable.get(why, 0) + 1
            continue
        prediction = predict_step(shape, layout, gpu)
        if prediction.memory_bytes > gpu.memory_bytes:
            over += 1
            continue
        fits.append(prediction)
        if layout.recompute == "full":
            fewer = _fewest_checkpointed_blocks(shape, layout, gpu)
            if fewer is not None:
                fits.append(fewer)
    fits.sort(key=lambda p: -p.tokens_per_s_per_gpu)
    return LayoutSearch(fits[:keep], considered, over, unrunnable)


def _fewest_checkpointed_blocks(shape: TransformerShape, layout: Layout, gpu: GpuCosts) -> StepPrediction | None:
    """The layout with the fewest fully checkpointed blocks per rank that still fits (a
    bisection: memory falls as blocks checkpoint), or None when all of them must."""
    blocks = layout.blocks_per_rank(shape.layers)
    lo, hi = 0, blocks  # hi fits (all checkpointed), lo is tried
    best = None
    while lo < hi:
        mid = (lo + hi) // 2
        p = predict_step(shape, replace(layout, recompute_layers=mid), gpu)
        if p.memory_bytes <= gpu.memory_bytes:
            best, hi = p, mid
        else:
            lo = mid + 1
    # None checkpointed is the layout without recomputation, and all of them the one given.
    return best if best is not None and 0 < best.layout.recompute_layers < blocks else None
