"""Segment costs as functions of the micro-batch size, so other sizes need no re-profiling.

Example:
    >>> from autopipe.models import seed_transformer
    >>> from autopipe.planning.scaling import profile_scaling
    >>> model, args = seed_transformer(vocab_size=100, d_model=16, num_layers=1, batch=2, seq_len=8)
    >>> scaled = profile_scaling(model, args, sizes=(1, 2), cost="flops", device_flops=1e9,
    ...                          progress=False)
    >>> k = scaled.segment_names.index("layers.0")
    >>> scaled.cut_fwd_bytes[k]  # the residual stream: b x 8 x 16 float32
    512*b
    >>> scaled.cut_bytes_at(4)[0][k]
    2048
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch
from torch.utils._pytree import tree_leaves, tree_map

from .._checks import check_distinct_sizes, check_int
from .affine_fit import evaluate, fit_affine, parse_expr
from .costgraph import SegmentCost, build_cost_graph
from ..machine.speed import counting_flops
from ..machine.timing import resolve_device
from .cost_sources import CostSource, cost_source
from .profile import check_fit_to_whole, check_flush_cache, check_runs, profile_segments
from .tracing import TracedModel, resolve_example_inputs, trace

#: Bumped whenever the JSON layout of :meth:`ScaledProfile.to_dict` changes incompatibly.
SCALED_PROFILE_FORMAT_VERSION = 1

#: Per-segment quantities that are fitted, and whether each one is a count (bytes, FLOPs),
#: whose fit is snapped to integer coefficients when those reproduce every sample exactly.
_SEGMENT_QUANTITIES = {"fwd_s": False, "bwd_s": False, "act_bytes": True, "out_bytes": True, "flops": True}
_CUT_QUANTITIES = ("cut_fwd_bytes", "cut_bwd_bytes")


# --------------------------------------------------------------------------- results


@dataclass
class SegmentScaling:
    """One segment's costs per micro-batch as functions of the micro-batch size ``b``."""

    name: str  # the split point the segment starts at ("<input>" for the first)
    fwd_s: sympy.Expr  # forward seconds
    bwd_s: sympy.Expr  # backward seconds
    act_bytes: sympy.Expr  # bytes saved for backward
    out_bytes: sympy.Expr  # bytes later segments read
    flops: sympy.Expr  # forward + backward FLOPs
    param_bytes: int  # independent of b
    trainable_param_bytes: int  # independent of b
    accum_s: float = 0.0  # gradient accumulation seconds: the parameters' size, so independent of b

    def cost_at(self, b: int) -> SegmentCost:
        """The segment's :class:`~autopipe.planning.costgraph.SegmentCost` at micro-batch size ``b``."""
        return SegmentCost(
            fwd_s=evaluate(self.fwd_s, b),
            bwd_s=evaluate(self.bwd_s, b),
            param_bytes=self.param_bytes,
            act_bytes=int(round(evaluate(self.act_bytes, b))),
            out_bytes=int(round(evaluate(self.out_bytes, b))),
            flops=evaluate(self.flops, b),
            trainable_param_bytes=self.trainable_param_bytes,
            accum_s=self.accum_s,
        )


def _check_size(b: Any) -> int:
    return check_int("b", b, what="a micro-batch size")


@dataclass
class ScaledProfile:
    """Per-segment costs and per-cut bytes as functions of the micro-batch size ``b``.

    Made by :func:`profile_scaling`. Evaluate it at any size with :meth:`costs_at` and
    :meth:`cut_bytes_at`; the results plug in where ``profile_segments`` and
    ``build_cost_graph`` results do (``PlannerOptions(cost=scaled.costs_at(b))``).

    Attributes:
        sizes: The micro-batch sizes that were profiled, ascending.
        base_size: The size of the example micro-batch the caller gave.
        batch_dim: The input dimension that was resized.
        cost: The cost source (``"measured"``, ``"flops"``, ``"params"``).
        device: The device the profile ran on.
        segments: One :class:`SegmentScaling` per segment, in graph order.
        cut_fwd_bytes / cut_bwd_bytes: Bytes crossing the cut before segment ``k`` (index
            ``num_segments`` is the model output), as expressions in ``b``.
        fit_error: Quantity name -> relative error of each segment's (or cut's) fit; see
            :func:`~autopipe.planning.affine_fit.fit_affine`.
        clamped: ``"quantity[segment]"`` for every fit that had to be clamped.
        measured: Size -> the raw ``profile_segments`` result at that size.
        measured_cut_bytes: Size -> (forward, backward) cut bytes measured at that size.
    """

    sizes: list[int]
    base_size: int
    batch_dim: int
    cost: str
    device: str
    segments: list[SegmentScaling]
    cut_fwd_bytes: list[sympy.Expr]
    cut_bwd_bytes: list[sympy.Expr]
    fit_error: dict[str, list[float]]
    clamped: list[str] = field(default_factory=list)
    measured: dict[int, list[SegmentCost]] = field(default_factory=dict)
    measured_cut_bytes: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

    @property
    def segment_names(self) -> list[str]:
        """Split point names of the segments, in graph order."""
        return [s.name for s in self.segments]

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def param_bytes(self) -> list[int]:
        """Parameter and buffer bytes per segment (independent of the micro-batch size)."""
        return [s.param_bytes for s in self.segments]

    def costs_at(self, b: int) -> list[SegmentCost]:
        """Every segment's cost at micro-batch size ``b``, as ``profile_segments`` returns them.

        Raises:
            ValueError: ``b`` is not an integer >= 1.
        """
        b = _check_size(b)
        return [s.cost_at(b) for s in self.segments]

    def cut_bytes_at(self, b: int) -> tuple[list[int], list[int]]:
        """(forward, backward) bytes crossing each cut at micro-batch size ``b``.

        Index ``k`` is the cut before segment ``k``, as ``CostGraph.cut_fwd_bytes``.

        Raises:
            ValueError: ``b`` is not an integer >= 1.
        """
        b = _check_size(b)
        fwd = [int(round(evaluate(e, b))) for e in self.cut_fwd_bytes]
        bwd = [int(round(evaluate(e, b))) for e in self.cut_bwd_bytes]
        return fwd, bwd

    def worst_fit_errors(self) -> dict[str, tuple[float, str]]:
        """Quantity -> (worst relative error, the segment or cut it belongs to)."""
        out = {}
        names = self.segment_names
        for quantity, errors in self.fit_error.items():
            if not errors:
                continue
            k = int(np.argmax(errors))
            where = names[k] if quantity in _SEGMENT_QUANTITIES else f"cut before {names[k]}" if k < len(names) else "output"
            out[quantity] = (float(errors[k]), where)
        return out

    def report(self) -> str:
        """A short text: what was profiled and the worst fit error of each quantity."""
        lines = [
            f"Costs as functions of the micro-batch size b: {self.num_segments} segments profiled at "
            f"b = {', '.join(map(str, self.sizes))} ({self.cost} on {self.device}); fits are a + c*b.",
        ]
        if len(self.sizes) == 2:
            lines.append("Only two sizes: each fit passes through both, so a zero error says nothing. "
                         "Profile three or more sizes to check the fit.")
        lines.append(f"{'quantity':<14} {'worst error':>11}  where")
        for quantity, (err, where) in self.worst_fit_errors().items():
            shown = "exact" if err == 0 else f"{100 * err:.1f}%" if math.isfinite(err) else "inf"
            lines.append(f"{quantity:<14} {shown:>11}  {where if err else '-'}")
        # Small segments are noisy on their own; the whole model's time is what a plan sums.
        totals = []
        for b, costs in sorted(self.measured.items()):
            fitted = sum(c.time_s for c in self.costs_at(b))
            actual = sum(c.time_s for c in costs)
            totals.append(f"b={b}: {1e3 * actual:.3g} ms measured, {1e3 * fitted:.3g} ms fitted")
        if totals:
            lines.append("Whole model, forward + backward: " + "; ".join(totals))
        if self.clamped:
            more = f" (+{len(self.clamped) - 5} more)" if len(self.clamped) > 5 else ""
            lines.append(f"Clamped to stay >= 0 and non-decreasing in b: {', '.join(self.clamped[:5])}{more}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; expressions are strings in ``b`` (``str(expr)``)."""
        def cost_dict(c: SegmentCost) -> dict[str, Any]:
            return {k: getattr(c, k) for k in SegmentCost.__dataclass_fields__}

        return {
            "format_version": SCALED_PROFILE_FORMAT_VERSION,
            "sizes": list(self.sizes),
            "base_size": self.base_size,
            "batch_dim": self.batch_dim,
            "cost": self.cost,
            "device": self.device,
            "segments": [
                {
                    "name": s.name,
                    **{q: str(getattr(s, q)) for q in _SEGMENT_QUANTITIES},
                    "param_bytes": s.param_bytes,
                    "trainable_param_bytes": s.trainable_param_bytes,
                    "accum_s": s.accum_s,
                }
                for s in self.segments
            ],
            "cut_fwd_bytes": [str(e) for e in self.cut_fwd_bytes],
            "cut_bwd_bytes": [str(e) for e in self.cut_bwd_bytes],
            "fit_error": {k: list(v) for k, v in self.fit_error.items()},
            "clamped": list(self.clamped),
            "measured": {str(b): [cost_dict(c) for c in costs] for b, costs in self.measured.items()},
            "measured_cut_bytes": {str(b): [list(f), list(w)] for b, (f, w) in self.measured_cut_bytes.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ScaledProfile":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: an unknown format version, or an expression that is not affine in ``b``.
        """
        version = data.get("format_version")
        if version != SCALED_PROFILE_FORMAT_VERSION:
            raise ValueError(
                f"format_version={version!r} is not supported; this autopipe reads version "
                f"{SCALED_PROFILE_FORMAT_VERSION}"
            )
        return cls(
            sizes=[int(b) for b in data["sizes"]],
            base_size=int(data["base_size"]),
            batch_dim=int(data["batch_dim"]),
            cost=str(data["cost"]),
            device=str(data["device"]),
            segments=[
                SegmentScaling(
                    name=s["name"],
                    **{q: parse_expr(s[q], q) for q in _SEGMENT_QUANTITIES},
                    param_bytes=int(s["param_bytes"]),
                    trainable_param_bytes=int(s["trainable_param_bytes"]),
                    accum_s=float(s.get("accum_s", 0.0)),
                )
                for s in data["segments"]
            ],
            cut_fwd_bytes=[parse_expr(e, "cut_fwd_bytes") for e in data["cut_fwd_bytes"]],
            cut_bwd_bytes=[parse_expr(e, "cut_bwd_bytes") for e in data["cut_bwd_bytes"]],
            fit_error={k: [float(x) for x in v] for k, v in data["fit_error"].items()},
            clamped=list(data.get("clamped", [])),
            measured={int(b): [SegmentCost(**c) for c in costs] for b, costs in data.get("measured", {}).items()},
            measured_cut_bytes={
                int(b): (list(fw[0]), list(fw[1])) for b, fw in data.get("measured_cut_bytes", {}).items()
            },
        )


# --------------------------------------------------------------------------- inputs at other sizes


def resize_batch(value: Any, *, batch_dim: int, from_size: int, to_size: int) -> Any:
    """``value`` (a tensor or a nested structure of them) with its batch dimension resized.

    Example:
        >>> import torch
        >>> resize_batch(torch.tensor([[1], [2]]), batch_dim=0, from_size=2, to_size=3).tolist()
        [[1], [2], [1]]
    """
    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= batch_dim or t.shape[batch_dim] != from_size:
            return t
        if to_size == from_size:
            return t
        index = torch.arange(to_size, device=t.device) % from_size
        out = t.detach().index_select(batch_dim, index)
        if t.requires_grad:
            out.requires_grad_(True)  # a fresh leaf, as the caller's input was
        return out

    return tree_map(resize, value)


def _base_size(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> int:
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
            if leaf.shape[batch_dim] < 1:
                raise ValueError(f"the example micro-batch is empty along batch_dim={batch_dim} (shape {tuple(leaf.shape)})")
            return int(leaf.shape[batch_dim])
    raise ValueError(
        f"batch_dim={batch_dim} but no example input tensor has that many dimensions; "
        "pass the dimension that indexes the samples of a micro-batch (usually 0)"
    )


def _check_sizes(sizes: Any, base: int) -> list[int]:
    if sizes is None:
        return sorted({max(1, base // 2), base, 2 * base})
    return check_distinct_sizes("sizes", sizes, unit="micro-batch size",
                                why="to fit costs as functions of the size", example="(1, 2, 4)")


# --------------------------------------------------------------------------- entry point


def profile_scaling(
    model: torch.nn.Module,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    sizes: Sequence[int] | None = None,
    batch_dim: int = 0,
    cost: str | CostSource = "measured",
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device_flops: float | None = None,
    progress: bool = True,
    flush_cache: bool = True,
    fit_to_whole: bool | None = None,
    traced: TracedModel | None = None,
) -> ScaledProfile:
    """Profile ``model`` at several micro-batch sizes and fit each cost as ``a + c*b``.

    The example inputs are one micro-batch; its size ``b0`` is the length of ``batch_dim``
    of the first input tensor that has that dimension. For every size in ``sizes`` the
    inputs are resized (see :func:`resize_batch`), the model is traced with
    :func:`autopipe.planning.tracing.trace` (static shapes, as ``pipeline()`` traces it) and profiled
    with :func:`autopipe.planning.profile.profile_segments`; the cut bytes come from
    :func:`autopipe.planning.costgraph.build_cost_graph`. Then every quantity of every segment and
    cut is fitted with :func:`~autopipe.planning.affine_fit.fit_affine` (least squares, clamped
    so it stays >= 0 and non-decreasing at every ``b >= 1``).

    Args:
        model: Any ``nn.Module`` that ``torch.export`` can capture. It is not modified.
        example_args: One micro-batch of positional inputs.
        example_kwargs: One micro-batch of keyword inputs.

    Keyword Args:
        sizes: Micro-batch sizes to profile, at least two distinct integers >= 1; default
            ``(max(1, b0 // 2), b0, 2 * b0)``.
        batch_dim: The input dimension that indexes samples (>= 0).
        cost: ``"measured"``, ``"flops"`` or ``"params"`` (as in ``profile_segments``).
        device: Where to profile; default CUDA when present, else CPU.
        warmup: Untimed runs per segment and size.
        repeats: Timed runs per segment and size; their mean is kept (:func:`autopipe.machine.timing.per_run_s`).
        device_flops: FLOP/s for the estimated sources; measured once when omitted.
        progress: Show progress bars.
        flush_cache: Empty the device's caches between the profile's passes, as
            :func:`autopipe.planning.profile.profile_segments` does by default; ``False`` keeps them warm.
        fit_to_whole: Scale each size's segments to its whole graph, as
            :func:`autopipe.planning.profile.profile_segments` does (default: on CUDA only).
        traced: ``model`` already traced on these example inputs
            (:func:`autopipe.planning.tracing.trace`): when ``sizes`` holds ``b0``, that size
            is profiled on this graph instead of exporting the model once more.

    Returns:
        A :class:`ScaledProfile`; evaluate it with ``costs_at(b)`` / ``cut_bytes_at(b)``.

    Raises:
        ValueError: bad ``sizes``, ``batch_dim``, ``cost``, ``warmup`` or ``repeats``, or a
            ``traced`` of another model or micro-batch size (before any tracing), or the
            segments differ between two sizes (the model's graph depends on the batch size,
            so no single split list fits every size).
        ModelExportError: torch.export cannot capture the model at some size.
        TypeError: ``traced`` is not a :class:`~autopipe.planning.tracing.TracedModel`.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> model, args = seed_transformer(vocab_size=100, d_model=16, num_layers=1, batch=2, seq_len=8)
        >>> scaled = profile_scaling(model, args, cost="flops", device_flops=1e9, progress=False)
        >>> scaled.sizes
        [1, 2, 4]
        >>> scaled.costs_at(8)[-1].act_bytes == 8 * scaled.costs_at(1)[-1].act_bytes
        True
    """
    check_int("batch_dim", batch_dim, 0, what="the input dimension that indexes samples")
    source = cost_source(cost)
    check_runs(warmup, repeats)
    check_flush_cache(flush_cache)
    check_fit_to_whole(fit_to_whole)
    if device_flops is not None and not (isinstance(device_flops, (int, float)) and device_flops > 0):
        raise ValueError(f"device_flops={device_flops!r} must be > 0 FLOP/s")
    args, kwargs = resolve_example_inputs(model, example_args, example_kwargs)
    base = _base_size(args, kwargs, int(batch_dim))
    sizes = _check_sizes(sizes, base)
    _check_traced(traced, model, base, int(batch_dim))
    dev = resolve_device(device)
    if not source.measured and device_flops is None:
        device_flops = counting_flops(dev)  # once, so every size uses the same figure

    measured: dict[int, list[SegmentCost]] = {}
    measured_cuts: dict[int, tuple[list[int], list[int]]] = {}
    names: list[str] | None = None
    for b in sizes:
        args_b = resize_batch(args, batch_dim=batch_dim, from_size=base, to_size=b)
        kwargs_b = resize_batch(kwargs, batch_dim=batch_dim, from_size=base, to_size=b)
        traced_b = traced if traced is not None and b == base else trace(model, args_b, kwargs_b)
        seg_names = [s.name for s in traced_b.segments]
        if names is None:
            names = seg_names
        elif seg_names != names:
            raise ValueError(_mismatch_message(sizes[0], names, b, seg_names))
        measured[b] = profile_segments(traced_b, cost=source, device=dev, warmup=warmup, repeats=repeats,
                                       device_flops=device_flops, progress=progress, flush_cache=flush_cache,
                                       fit_to_whole=fit_to_whole)
        cost_graph = build_cost_graph(traced_b)
        measured_cuts[b] = (list(cost_graph.cut_fwd_bytes), list(cost_graph.cut_bwd_bytes))

    assert names is not None  # sizes holds at least two entries
    fit_error: dict[str, list[float]] = {q: [] for q in (*_SEGMENT_QUANTITIES, *_CUT_QUANTITIES)}
    clamped: list[str] = []
    segments = []
    first = measured[sizes[0]]
    for k, name in enumerate(names):
        exprs = {}
        for quantity, is_count in _SEGMENT_QUANTITIES.items():
            fit = fit_affine(sizes, [getattr(measured[b][k], quantity) for b in sizes], integer=is_count)
            exprs[quantity] = fit.expr
            fit_error[quantity].append(fit.rel_error)
            if fit.clamped:
                clamped.append(f"{quantity}[{name}]")
        # Accumulation adds gradients of the parameters' size whatever b is: the mean of its timings.
        accum_s = float(np.mean([measured[b][k].accum_s for b in sizes]))
        segments.append(SegmentScaling(name=name, **exprs, param_bytes=first[k].param_bytes,
                                       trainable_param_bytes=first[k].trainable_param_bytes, accum_s=accum_s))
    cut_exprs: dict[str, list[sympy.Expr]] = {}
    for j, quantity in enumerate(_CUT_QUANTITIES):
        cut_exprs[quantity] = []
        for k in range(len(names) + 1):
            fit = fit_affine(sizes, [measured_cuts[b][j][k] for b in sizes], integer=True)
            cut_exprs[quantity].append(fit.expr)
            fit_error[quantity].append(fit.rel_error)
            if fit.clamped:
                clamped.append(f"{quantity}[{k}]")
    return ScaledProfile(
        sizes=sizes,
        base_size=base,
        batch_dim=int(batch_dim),
        cost=source.name,
        device=str(dev),
        segments=segments,
        cut_fwd_bytes=cut_exprs["cut_fwd_bytes"],
        cut_bwd_bytes=cut_exprs["cut_bwd_bytes"],
        fit_error=fit_error,
        clamped=clamped,
        measured=measured,
        measured_cut_bytes=measured_cuts,
    )


def _check_traced(traced: Any, model: torch.nn.Module, base: int, batch_dim: int) -> None:
    """Refuse a ``traced`` that is not this model on a micro-batch of ``base`` samples."""
    if traced is None:
        return
    if not isinstance(traced, TracedModel):
        raise TypeError(f"traced must be a TracedModel (from autopipe.planning.tracing.trace) or None, "
                        f"got {type(traced).__name__}")
    if traced.model_name != type(model).__name__:
        raise ValueError(f"traced is a trace of {traced.model_name}, not of the model given ({type(model).__name__})")
    traced_size = _base_size(traced.example_args, traced.example_kwargs, batch_dim)
    if traced_size != base:
        raise ValueError(f"traced holds a micro-batch of {traced_size} samples along batch_dim={batch_dim}, but the "
                         f"example inputs have {base}; pass the trace of these example inputs")


def _mismatch_message(b_a: int, names_a: list[str], b_b: int, names_b: list[str]) -> str:
    k = next((i for i, (x, y) in enumerate(zip(names_a, names_b)) if x != y), min(len(names_a), len(names_b)))
    first_a = names_a[k] if k < len(names_a) else "<end>"
    first_b = names_b[k] if k < len(names_b) else "<end>"
    return (
        f"the model's segments differ between micro-batch sizes {b_a} ({len(names_a)} segments) and "
        f"{b_b} ({len(names_b)} segments); first difference at segment {k}: {first_a!r} vs {first_b!r}. "
        "torch.export traced a different graph at each size (Python code that branches on the batch "
        "size?), so costs cannot be carried from one size to another. Pass sizes= that avoid the "
        "special case (often b=1), or profile each micro-batch size on its own with profile_segments."
    )
