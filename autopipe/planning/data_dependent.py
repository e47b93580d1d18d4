"""Tensors whose size depends on the data: how big they are counted, and which cuts they rule out.

Example:
    >>> class Positive(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x[x > 0] * 2
    >>> program = torch.export.export(Positive(), (torch.randn(5),))
    >>> unbacked_note({"u0"}, unbacked_sizes(Positive(), {"u0"}, {}, program), {})
    'data-dependent sizes counted as: u0 = 5 (their upper bound)'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch.export import ExportedProgram

from ..errors import ModelExportError


def unbacked_symbols(nodes: Sequence[fx.Node]) -> set[str]:
    """The data-dependent size symbols (``u0``, ...) any node's value has, by name.

    Example:
        >>> class Positive(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x[x > 0] * 2
        >>> sorted(unbacked_symbols(torch.export.export(Positive(), (torch.randn(5),)).graph.nodes))
        ['u0']
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found: set[str] = set()
    for node in nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.Tensor, torch.SymInt, tuple, list)):
            found |= {str(s) for s in free_unbacked_symbols(val)}
    return found


def unbacked_sizes(model: torch.nn.Module, symbols: set[str], measured: Mapping[str, int],
                    exported: ExportedProgram) -> dict[str, int]:
    """Each symbol's size: measured on the example where the model ran, else the trace's upper bound.

    Raises:
        ModelExportError: a symbol neither measured nor bounded, naming what to do.
    """
    bounds = {str(sym): r.upper for sym, r in exported.range_constraints.items()}
    sizes: dict[str, int] = {}
    for name in sorted(symbols):
        if name in measured:
            sizes[name] = measured[name]
            continue
        upper = bounds.get(name)
        try:
            sizes[name] = int(upper)
        except (TypeError, ValueError, OverflowError):
            raise ModelExportError(
                f"{type(model).__name__} makes a tensor whose size depends on the data (symbol {name}, from "
                f"nonzero, a boolean mask or similar), and autopipe can neither measure it (the model is on the "
                f"meta device) nor bound it (the trace allows any size). What to do: plan with the model on a real "
                f"device, so the example micro-batch gives the size; or bound it in forward with "
                f"torch._check(n <= bound) on the size; or give the split yourself with split_points=.",
                kind="data-dependent") from None
    return sizes


def unbacked_note(symbols: set[str], sizes: Mapping[str, int], measured: Mapping[str, int]) -> str:
    """The plan's note on how the data-dependent sizes were counted (a range where there are many).

    Example:
        >>> unbacked_note({"u0", "u1"}, {"u0": 3, "u1": 5}, {"u0": 3, "u1": 5})
        'data-dependent sizes counted as: u0 = 3, u1 = 5 (on the example micro-batch)'
    """
    ordered = sorted(symbols, key=lambda n: (len(n), n))
    groups = []
    for how, names in (("on the example micro-batch", [n for n in ordered if n in measured]),
                       ("their upper bound", [n for n in ordered if n not in measured])):
        if not names:
            continue
        if len(names) <= 4:
            listed = ", ".join(f"{n} = {sizes[n]}" for n in names)
        else:
            values = [sizes[n] for n in names]
            listed = f"{len(names)} sizes ({names[0]} to {names[-1]}) from {min(values)} to {max(values)}"
        groups.append(f"{listed} ({how})")
    return f"data-dependent sizes counted as: {'; '.join(groups)}"


def excluded_note(excluded: Mapping[str, str]) -> str:
    """The plan's note naming the split points a data-dependent tensor rules out (the first few, and how many)."""
    names = list(excluded)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more (TracedModel.excluded_cuts)" if len(names) > 3 else "")
    return f"split points not offered, as a tensor of data-dependent size would cross them: {shown}"


def without_unbacked_cuts(nodes: Sequence[fx.Node], candidates: list[SplitCandidate]
                           ) -> tuple[list[SplitCandidate], dict[str, str]]:
    """The candidates no data-dependent tensor crosses, and the others with why: a pipeline stage
    receives into buffers of a fixed shape, and such a tensor's shape changes with every batch.

    Example:
        >>> class Positive(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.scale = torch.nn.Linear(1, 1)
        ...     def forward(self, x):
        ...         return self.scale(x[x > 0].unsqueeze(1))
        >>> from autopipe.planning.tracing import trace
        >>> trace(Positive(), (torch.randn(5),)).excluded_cuts
        {'scale': 'unsqueeze has a data-dependent size'}
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    index = {node: i for i, node in enumerate(nodes)}
    live: list[tuple[int, int, str]] = []  # (made at, last read at, name)
    for i, node in enumerate(nodes):
        val = node.meta.get("val")
        if isinstance(val, (torch.Tensor, tuple, list)) and free_unbacked_symbols(val):
            last = max((index.get(u, len(nodes)) for u in node.users), default=i)
            live.append((i, last, node.name))
    kept, excluded = [], {}
    for c in candidates:
        crossing = [name for made, last, name in live if made < c.position <= last]
        if crossing:
            excluded[c.name] = f"{crossing[0]} has a data-dependent size"
        else:
            kept.append(c)
    return kept, excluded
