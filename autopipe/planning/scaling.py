"""Segment costs as functions of the micro-batch size, so other sizes need no re-profiling.

A plan's micro-batch count ``m`` sets the micro-batch size (global batch / m), and every
per-segment cost depends on it. :func:`profile_scaling` profiles the model at a few
micro-batch sizes and fits each quantity as an affine function ``a + c*b`` of the size
symbol ``b`` (a :class:`sympy.Symbol`, the language torch.export speaks for dynamic
shapes)::

    profile_scaling(model, (x_mb,)) -> ScaledProfile
    scaled.costs_at(b)              -> [SegmentCost]      what profile_segments would say at size b
    scaled.cut_bytes_at(b)          -> (fwd, bwd) bytes   what build_cost_graph would say at size b

Fitted per segment: ``fwd_s``, ``bwd_s``, ``act_bytes``, ``out_bytes``, ``flops``; per cut:
forward and backward bytes. Parameter bytes do not depend on the size and are kept as
numbers. Byte and FLOP counts are usually exactly affine in ``b`` (each activation is
``b`` times a per-sample shape), and their fits then have integer coefficients and zero
error; times are only roughly affine (small sizes under-use the device), so every fit keeps
its relative error (``ScaledProfile.fit_error``) and :meth:`ScaledProfile.report` lists the
worst ones.

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

import contextlib
import difflib
import functools
import inspect
import io
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import sympy
import torch
from torch.utils._pytree import tree_leaves, tree_map

from . import hf_compat
from .costgraph import SegmentCost, build_cost_graph, requires_grad_map, tensor_bytes
from .profile import (COST_SOURCES, check_fit_to_whole, check_flush_cache, check_runs, measure_device_flops,
                      profile_segments, resolve_device)
from .trace import resolve_example_inputs, trace

__all__ = [
    "B",
    "AffineFit",
    "fit_affine",
    "SegmentScaling",
    "ScaledProfile",
    "profile_scaling",
    "resize_batch",
    "symbolic_cut_bytes",
    "SCALED_PROFILE_FORMAT_VERSION",
]

#: The micro-batch size symbol every fitted expression is written in.
B = sympy.Symbol("b", positive=True, integer=True)

#: Bumped whenever the JSON layout of :meth:`ScaledProfile.to_dict` changes incompatibly.
SCALED_PROFILE_FORMAT_VERSION = 1

#: Per-segment quantities that are fitted, and whether each one is a count (bytes, FLOPs),
#: whose fit is snapped to integer coefficients when those reproduce every sample exactly.
_SEGMENT_QUANTITIES = {"fwd_s": False, "bwd_s": False, "act_bytes": True, "out_bytes": True, "flops": True}
_CUT_QUANTITIES = ("cut_fwd_bytes", "cut_bwd_bytes")


# --------------------------------------------------------------------------- the fit


@dataclass(frozen=True)
class AffineFit:
    """One quantity as ``a + c*b``: the expression, how well it matches, and whether it was clamped."""

    expr: sympy.Expr  # in the symbol B
    rel_error: float  # max over sizes of |fit - measured| / measured (see fit_affine)
    clamped: bool  # True when the least-squares fit was moved to keep it >= 0 and non-decreasing


def _rel_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    """max |predicted - measured| / |measured|; a zero sample is compared with the largest one."""
    scale = float(np.max(np.abs(measured))) if len(measured) else 0.0
    if scale == 0.0:
        return 0.0 if np.all(predicted == 0) else math.inf
    denom = np.where(measured != 0, np.abs(measured), scale)
    with np.errstate(over="ignore"):  # a subnormal sample gives inf, which is the honest answer
        return float(np.max(np.abs(predicted - measured) / denom))


def _affine_expr(intercept: float | int, slope: float | int) -> sympy.Expr:
    to_sym = sympy.Integer if isinstance(intercept, int) and isinstance(slope, int) else sympy.Float
    expr = sympy.Integer(0)
    if slope != 0:
        expr += to_sym(slope) * B
    if intercept != 0:
        expr += to_sym(intercept)
    return expr


def fit_affine(sizes: Sequence[int], values: Sequence[float], *, integer: bool = False) -> AffineFit:
    """Least-squares fit of ``values`` measured at micro-batch ``sizes`` as ``a + c*b``.

    The fit is constrained to ``c >= 0`` and ``a + c >= 0``: a cost never shrinks as the
    micro-batch grows, and must not be negative at any size ``b >= 1``. A least-squares fit
    that breaks either (measurement noise on a tiny segment) is replaced by the best fit on
    the boundary of those constraints: a constant (``c = 0``) or a line that is zero at
    ``b = 1`` (``c*(b - 1)``), whichever is closer to the samples; ``clamped`` says so.

    With exactly two sizes the unclamped fit passes through both samples, so its error is
    0 by construction: use three or more sizes for an error that means something.

    Args:
        sizes: Micro-batch sizes, at least two distinct.
        values: The quantity measured at each size.

    Keyword Args:
        integer: The quantity is a count (bytes, FLOPs): when integer coefficients
            reproduce every sample exactly, use them (the fit is then exact, error 0).

    Returns:
        An :class:`AffineFit` in the symbol :data:`B`.

    Raises:
        ValueError: ``sizes`` and ``values`` differ in length, or fewer than two distinct sizes.

    Example:
        >>> fit_affine([1, 2, 4], [1024 + 256, 1024 + 512, 1024 + 1024], integer=True).expr
        256*b + 1024
    """
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(values, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"sizes ({len(sizes)} entries) and values ({len(values)} entries) must be equal-length lists")
    if len(set(x.tolist())) < 2:
        raise ValueError(f"sizes={list(sizes)!r} must hold at least two distinct micro-batch sizes to fit a slope")
    design = np.stack([np.ones_like(x), x], axis=1)
    (a, c), *_ = np.linalg.lstsq(design, y, rcond=None)
    clamped = False
    # A relative tolerance so round-off on exact data does not count as a violation.
    tol = 1e-12 * max(float(np.max(np.abs(y))), 1e-300)
    if c < -tol or a + c < -tol:
        clamped = True
        # The feasible set is the cone c >= 0, a + c >= 0; the optimum lies on one of its rays.
        const = (max(float(np.mean(y)), 0.0), 0.0)
        w = x - 1.0
        ray_slope = max(float(np.dot(w, y) / np.dot(w, w)), 0.0)
        through_one = (-ray_slope, ray_slope)
        a, c = min((const, through_one), key=lambda ac: float(np.sum((ac[0] + ac[1] * x - y) ** 2)))
    # Within the round-off tolerance: snap onto the constraints so they hold exactly.
    c = max(float(c), 0.0)
    a = max(float(a), -c)
    if integer:
        ai, ci = int(round(a)), int(round(c))
        if np.array_equal(ai + ci * x, y) and ci >= 0 and ai + ci >= 0:
            return AffineFit(expr=_affine_expr(ai, ci), rel_error=0.0, clamped=clamped)
    return AffineFit(expr=_affine_expr(a, c), rel_error=_rel_error(a + c * x, y), clamped=clamped)


@functools.lru_cache(maxsize=4096)
def _evaluator(expr: sympy.Expr) -> Callable[[float], float]:
    """A fast numeric function of b for ``expr`` (the planner evaluates many sizes)."""
    return sympy.lambdify(B, expr, modules="math")


def _evaluate(expr: sympy.Expr, b: int) -> float:
    return float(_evaluator(expr)(b))


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
            fwd_s=_evaluate(self.fwd_s, b),
            bwd_s=_evaluate(self.bwd_s, b),
            param_bytes=self.param_bytes,
            act_bytes=int(round(_evaluate(self.act_bytes, b))),
            out_bytes=int(round(_evaluate(self.out_bytes, b))),
            flops=_evaluate(self.flops, b),
            trainable_param_bytes=self.trainable_param_bytes,
            accum_s=self.accum_s,
        )


def _check_size(b: Any) -> int:
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"b={b!r} must be a micro-batch size: an integer >= 1")
    return int(b)


@dataclass
class ScaledProfile:
    """Per-segment costs and per-cut bytes as functions of the micro-batch size ``b``.

    Made by :func:`profile_scaling`. Evaluate it at any size with :meth:`costs_at` and
    :meth:`cut_bytes_at`; the results plug in where ``profile_segments`` and
    ``build_cost_graph`` results do (``partition(costs=scaled.costs_at(b))``).

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
            :func:`fit_affine`.
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
        fwd = [int(round(_evaluate(e, b))) for e in self.cut_fwd_bytes]
        bwd = [int(round(_evaluate(e, b))) for e in self.cut_bwd_bytes]
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
                    **{q: _parse_expr(s[q], q) for q in _SEGMENT_QUANTITIES},
                    param_bytes=int(s["param_bytes"]),
                    trainable_param_bytes=int(s["trainable_param_bytes"]),
                    accum_s=float(s.get("accum_s", 0.0)),
                )
                for s in data["segments"]
            ],
            cut_fwd_bytes=[_parse_expr(e, "cut_fwd_bytes") for e in data["cut_fwd_bytes"]],
            cut_bwd_bytes=[_parse_expr(e, "cut_bwd_bytes") for e in data["cut_bwd_bytes"]],
            fit_error={k: [float(x) for x in v] for k, v in data["fit_error"].items()},
            clamped=list(data.get("clamped", [])),
            measured={int(b): [SegmentCost(**c) for c in costs] for b, costs in data.get("measured", {}).items()},
            measured_cut_bytes={
                int(b): (list(fw[0]), list(fw[1])) for b, fw in data.get("measured_cut_bytes", {}).items()
            },
        )


def _parse_expr(text: str, what: str) -> sympy.Expr:
    """Parse an expression written by ``to_dict``, with ``b`` read back as :data:`B`."""
    try:
        expr = sympy.sympify(text, locals={"b": B})
    except (sympy.SympifyError, TypeError, SyntaxError) as e:
        raise ValueError(f"{what}={text!r} is not an expression in b") from e
    if not expr.free_symbols <= {B}:
        raise ValueError(f"{what}={text!r} uses symbols other than b: {sorted(map(str, expr.free_symbols))}")
    return expr


# --------------------------------------------------------------------------- inputs at other sizes


def resize_batch(value: Any, *, batch_dim: int, from_size: int, to_size: int) -> Any:
    """``value`` (a tensor or a nested structure of them) with its batch dimension resized.

    Tensors whose ``batch_dim`` has length ``from_size`` are cut to the first ``to_size``
    samples, or grown by repeating the samples cyclically (so token ids, masks and labels
    stay valid inputs). Other tensors and non-tensors are returned as they are.

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
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ValueError(f"sizes={sizes!r} must be a list of micro-batch sizes (integers >= 1), e.g. (1, 2, 4)")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(f"sizes={list(sizes)!r}: {s!r} is not a micro-batch size; use integers >= 1")
    distinct = sorted({int(s) for s in sizes})
    if len(distinct) < 2:
        raise ValueError(
            f"sizes={list(sizes)!r} must hold at least two distinct micro-batch sizes to fit costs "
            "as functions of the size, e.g. (1, 2, 4)"
        )
    return distinct


# --------------------------------------------------------------------------- entry point


def profile_scaling(
    model: torch.nn.Module,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    sizes: Sequence[int] | None = None,
    batch_dim: int = 0,
    cost: str = "measured",
    device: str | torch.device | None = None,
    warmup: int = 2,
    repeats: int = 5,
    device_flops: float | None = None,
    progress: bool = True,
    flush_cache: bool = True,
    fit_to_whole: bool | None = None,
) -> ScaledProfile:
    """Profile ``model`` at several micro-batch sizes and fit each cost as ``a + c*b``.

    The example inputs are one micro-batch; its size ``b0`` is the length of ``batch_dim``
    of the first input tensor that has that dimension. For every size in ``sizes`` the
    inputs are resized (see :func:`resize_batch`), the model is traced with
    :func:`autopipe.planning.trace.trace` (static shapes, as ``pipeline()`` traces it) and profiled
    with :func:`autopipe.planning.profile.profile_segments`; the cut bytes come from
    :func:`autopipe.planning.costgraph.build_cost_graph`. Then every quantity of every segment and
    cut is fitted with :func:`fit_affine` (least squares, clamped so it stays >= 0 and
    non-decreasing at every ``b >= 1``).

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
        repeats: Timed runs per segment and size; their mean is kept (:func:`autopipe.planning.profile.per_run_s`).
        device_flops: FLOP/s for the estimated sources; measured once when omitted.
        progress: Show progress bars.
        flush_cache: Empty the device's caches between the profile's passes, as
            :func:`autopipe.planning.profile.profile_segments` does by default; ``False`` keeps them warm.
        fit_to_whole: Scale each size's segments to its whole graph, as
            :func:`autopipe.planning.profile.profile_segments` does (default: on CUDA only).

    Returns:
        A :class:`ScaledProfile`; evaluate it with ``costs_at(b)`` / ``cut_bytes_at(b)``.

    Raises:
        ValueError: bad ``sizes``, ``batch_dim``, ``cost``, ``warmup`` or ``repeats``
            (before any tracing), or the segments differ between two sizes (the model's
            graph depends on the batch size, so no single split list fits every size).
        ModelExportError: torch.export cannot capture the model at some size.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> model, args = seed_transformer(vocab_size=100, d_model=16, num_layers=1, batch=2, seq_len=8)
        >>> scaled = profile_scaling(model, args, cost="flops", device_flops=1e9, progress=False)
        >>> scaled.sizes
        [1, 2, 4]
        >>> scaled.costs_at(8)[-1].act_bytes == 8 * scaled.costs_at(1)[-1].act_bytes
        True
    """
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, numbers.Integral) or batch_dim < 0:
        raise ValueError(f"batch_dim={batch_dim!r} must be an integer >= 0 (the input dimension that indexes samples)")
    if cost not in COST_SOURCES:
        raise ValueError(f"cost={cost!r} is not a cost source; use one of {list(COST_SOURCES)}")
    check_runs(warmup, repeats)
    check_flush_cache(flush_cache)
    check_fit_to_whole(fit_to_whole)
    if device_flops is not None and not (isinstance(device_flops, (int, float)) and device_flops > 0):
        raise ValueError(f"device_flops={device_flops!r} must be > 0 FLOP/s")
    args, kwargs = resolve_example_inputs(model, example_args, example_kwargs)
    base = _base_size(args, kwargs, int(batch_dim))
    sizes = _check_sizes(sizes, base)
    dev = resolve_device(device)
    if cost != "measured" and device_flops is None:
        device_flops = measure_device_flops(dev)  # once, so every size uses the same figure

    measured: dict[int, list[SegmentCost]] = {}
    measured_cuts: dict[int, tuple[list[int], list[int]]] = {}
    names: list[str] | None = None
    for b in sizes:
        args_b = resize_batch(args, batch_dim=batch_dim, from_size=base, to_size=b)
        kwargs_b = resize_batch(kwargs, batch_dim=batch_dim, from_size=base, to_size=b)
        traced = trace(model, args_b, kwargs_b)
        seg_names = [s.name for s in traced.segments]
        if names is None:
            names = seg_names
        elif seg_names != names:
            raise ValueError(_mismatch_message(sizes[0], names, b, seg_names))
        measured[b] = profile_segments(traced, cost=cost, device=dev, warmup=warmup, repeats=repeats,
                                       device_flops=device_flops, progress=progress, flush_cache=flush_cache,
                                       fit_to_whole=fit_to_whole)
        cost_graph = build_cost_graph(traced)
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
        cost=cost,
        device=str(dev),
        segments=segments,
        cut_fwd_bytes=cut_exprs["cut_fwd_bytes"],
        cut_bwd_bytes=cut_exprs["cut_bwd_bytes"],
        fit_error=fit_error,
        clamped=clamped,
        measured=measured,
        measured_cut_bytes=measured_cuts,
    )


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


# --------------------------------------------------------------------------- symbolic cut bytes


def _dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int,
                    base: int, dim: Any) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes``, by argument name: the batch dimension of batch tensors."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > batch_dim and t.shape[batch_dim] == base:
            return {batch_dim: dim}
        return None

    return {name: tree_map(spec, value) for name, value in bound.arguments.items()}


def _tensor_ops(exported: Any) -> list[Any]:
    """Graph nodes that compute tensors, in order (size arithmetic on SymInts left out)."""
    return [
        n for n in exported.graph.nodes
        if n.op == "call_function" and any(isinstance(v, torch.Tensor) for v in tree_leaves(n.meta.get("val")))
    ]


def _match_nodes(static: Any, dynamic: Any) -> dict[str, Any]:
    """Static graph node name -> the same value's node in the dynamic-shape graph.

    Names are not stable between the two exports (the dynamic one adds size arithmetic,
    which shifts torch's ``mul_3``-style numbering, and keeps slices that a static export
    drops as no-ops), so the two sequences of tensor ops are aligned by operator with
    difflib and only ops in identical runs are paired; model inputs are paired in order.
    """
    pairs = dict(zip(static.graph_signature.user_inputs, dynamic.graph_signature.user_inputs))
    by_name = {n.name: n for n in dynamic.graph.nodes}
    # A Python constant input (use_cache=False) appears as its value, not as a graph node.
    matched = {s: by_name[d] for s, d in pairs.items() if isinstance(d, str) and d in by_name}
    ops_s, ops_d = _tensor_ops(static), _tensor_ops(dynamic)
    aligner = difflib.SequenceMatcher(a=[str(n.target) for n in ops_s], b=[str(n.target) for n in ops_d],
                                      autojunk=False)
    for tag, i0, i1, j0, j1 in aligner.get_opcodes():
        # "replace" runs of equal length pair too: a static alias is a full slice when dynamic.
        if tag == "equal" or (tag == "replace" and i1 - i0 == j1 - j0):
            for i, j in zip(range(i0, i1), range(j0, j1)):
                matched[ops_s[i].name] = ops_d[j]
    return matched


def _bytes_expr(value: Any, batch_symbol: sympy.Symbol) -> sympy.Expr:
    """Bytes of a (fake) tensor whose shape may hold SymInts, in the symbol B."""
    total = sympy.Integer(0)
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            numel = sympy.Integer(1)
            for size in leaf.shape:
                numel *= size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
            total += numel * leaf.element_size()
    return sympy.expand(total.subs(batch_symbol, B))


def symbolic_cut_bytes(
    model: torch.nn.Module,
    example_args: Sequence[Any] | Any | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    batch_dim: int = 0,
) -> tuple[list[sympy.Expr], list[sympy.Expr]]:
    """Bytes crossing every cut as exact expressions in ``b``, read from torch.export's shapes.

    A check on :func:`profile_scaling`'s fitted cut bytes that needs no profiling: the model
    is exported once more with the batch dimension marked dynamic (``torch.export.Dim``),
    and the symbolic shape of every tensor that :func:`autopipe.planning.costgraph.build_cost_graph`
    finds crossing a cut is turned into bytes.

    Args:
        model: The model, as for :func:`profile_scaling`.
        example_args / example_kwargs: One micro-batch of at least 2 samples (torch.export
            specialises sizes 0 and 1).

    Keyword Args:
        batch_dim: The input dimension that indexes samples.

    Returns:
        ``(forward, backward)`` bytes per cut, index ``k`` = the cut before segment ``k``.

    Raises:
        ValueError: the micro-batch has fewer than 2 samples, the model does not export with
            a dynamic batch size, or its dynamic graph differs from the static one.

    Example:
        >>> from autopipe.models import seed_transformer
        >>> model, args = seed_transformer(vocab_size=100, d_model=16, num_layers=1, batch=2, seq_len=8)
        >>> fwd, bwd = symbolic_cut_bytes(model, args)
        >>> fwd[2]
        512*b
    """
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, numbers.Integral) or batch_dim < 0:
        raise ValueError(f"batch_dim={batch_dim!r} must be an integer >= 0 (the input dimension that indexes samples)")
    args, kwargs = resolve_example_inputs(model, example_args, example_kwargs)
    base = _base_size(args, kwargs, int(batch_dim))
    if base < 2:
        raise ValueError(f"the example micro-batch has {base} sample(s) along batch_dim={batch_dim}; "
                         "torch.export treats sizes 0 and 1 as constants, so give at least 2")
    traced = trace(model, args, kwargs)
    kwargs = traced.example_kwargs  # as traced: an explicit use_cache=True made False (autopipe.planning.hf_compat)
    cost_graph = build_cost_graph(traced)
    needs_grad = {node.name: rg for node, rg in requires_grad_map(traced).items()}
    dim = torch.export.Dim("b")
    try:
        # The same capture as trace()'s: a Hugging Face KV cache off while exporting.
        with contextlib.redirect_stdout(io.StringIO()), hf_compat.training_config(model):
            exported = torch.export.export(model, args, kwargs,
                                           dynamic_shapes=_dynamic_shapes(model, args, kwargs, batch_dim, base, dim))
    except Exception as e:  # noqa: BLE001 - re-raised with the reason, cause kept
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the model does not export with a dynamic batch size along batch_dim={batch_dim}: {reason}") from e
    nodes = _match_nodes(traced.exported, exported)
    static_vals = {n.name: n.meta.get("val") for n in traced.exported.graph.nodes}
    batch_symbols = {
        leaf.shape[batch_dim].node.expr
        for n in exported.graph.nodes if n.op == "placeholder" and n.name in exported.graph_signature.user_inputs
        for leaf in tree_leaves(n.meta.get("val"))
        if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and isinstance(leaf.shape[batch_dim], torch.SymInt)
    }
    if len(batch_symbols) != 1:
        raise ValueError(f"expected one symbolic batch size among the inputs, found {sorted(map(str, batch_symbols))}")
    (batch_symbol,) = batch_symbols
    fwd, bwd = [], []
    for k, names in enumerate(cost_graph.cut_tensors):
        f = w = sympy.Integer(0)
        for name in names:
            if name not in nodes:
                raise ValueError(
                    f"tensor {name!r} crossing cut {k} has no counterpart in the graph exported with a dynamic "
                    "batch size (the model's code depends on the batch size?), so its size cannot be read symbolically"
                )
            nbytes = _bytes_expr(nodes[name].meta.get("val"), batch_symbol)
            if nbytes.subs(B, base) != tensor_bytes(static_vals[name]):  # a wrong pairing
                raise ValueError(f"tensor {name!r} crossing cut {k} has {tensor_bytes(static_vals[name])} bytes at "
                                 f"b={base} but its dynamic-shape counterpart has {nbytes.subs(B, base)}")
            f += nbytes
            if needs_grad.get(name, False):
                w += nbytes
        fwd.append(sympy.expand(f))
        bwd.append(sympy.expand(w))
    return fwd, bwd
