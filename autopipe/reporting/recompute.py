"""The report's lines on activation recomputation: which stages recompute, and why.

A stage recomputes (activation checkpointing) when the planner found that the fastest
plan within the devices' memory needs it: the lines give, per stage, its predicted peak
keeping its activations and recomputing them, against the memory it may use.

Example:
    >>> MiB = 2**20
    >>> stages = [{"index": 0, "peak_bytes_kept": 3 * MiB, "peak_bytes_recomputed": MiB, "capacity_bytes": 2 * MiB},
    ...           {"index": 1, "peak_bytes_kept": MiB, "peak_bytes_recomputed": MiB, "capacity_bytes": 2 * MiB}]
    >>> print("\\n".join(recompute_lines(stages, [0])))  # doctest: +NORMALIZE_WHITESPACE
    Recomputation: stage 0 recomputes its activations in the backward, running the forward again,
    to fit memory; the other stages keep theirs.
      stage 0: 3.0 MiB keeping activations, 1.0 MiB recomputing, 2.0 MiB available -> recomputes
      stage 1: 1.0 MiB keeping activations, 1.0 MiB recomputing, 2.0 MiB available -> keeps
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..machine.device import format_bytes

def recompute_lines(stages: Sequence[Mapping[str, Any]], recompute_stages: Sequence[int]) -> list[str]:
    """Lines saying which stages recompute their activations and each stage's memory with and without.

    Example:
        >>> recompute_lines([{"index": 0, "peak_bytes_kept": 8, "peak_bytes_recomputed": 8}], [])
        []
    """
    if not recompute_stages:
        return []
    again = set(recompute_stages)
    names = ", ".join(str(s) for s in sorted(again))
    rest = "the other stages keep theirs" if len(again) < len(stages) else "every stage does"
    out = [f"Recomputation: stage{'s' if len(again) > 1 else ''} {names} recompute{'' if len(again) > 1 else 's'} "
           f"{'their' if len(again) > 1 else 'its'} activations in the backward, running the forward again, to fit "
           f"memory; {rest}."]
    for st in stages:
        kept, redone = st.get("peak_bytes_kept") or 0, st.get("peak_bytes_recomputed") or 0
        if not kept and not redone:
            continue  # a plan that records no per-stage figures
        cap = st.get("capacity_bytes")
        out.append(f"  stage {st['index']}: {format_bytes(kept)} keeping activations, {format_bytes(redone)} "
                   f"recomputing, {format_bytes(cap) + ' available' if cap else 'no memory limit'} -> "
                   + ("recomputes" if st["index"] in again else "keeps"))
    return out
